"""Fault specs of the collectives (FSDP2's ``comm.all_gather``, ``comm.reduce_scatter``, a
pipeline's ``comm.p2p``) are refused with the bad value and the allowed ones -- a missing or
unknown source, direction or phase, a rank or source outside the world, a link the pipeline does
not have, a topology that runs no such collective -- before any rank starts."""

from __future__ import annotations

import pytest

from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec

BASE = {
    "site": "comm.all_gather",
    "target": "blocks.0.mlp.fc.weight",
    "rank": 1,
    "source": 0,
    "model": "bitflip",
    "bits": [30],
    "schedule": {"kind": "transient", "step": 2},
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": None}, "needs source"),
        ({"direction": "sideways"}, "unknown direction 'sideways'.*'recv', 'send'"),
        ({"direction": "send", "rank": 1}, "direction 'send'.*rank 1 must be the source or null"),
        ({"phase": "after"}, "unknown comm.all_gather phase 'after'.*'forward', 'backward'"),
        (
            {"site": "comm.reduce_scatter"},
            r"source 0 is only used with sites \['comm.all_gather', 'comm.all_to_all', 'comm.p2p'\]",
        ),
        ({"site": "weight", "source": None, "direction": "recv"}, "direction 'recv' is only used with"),
        ({"site": "comm.reduce_scatter", "source": None, "phase": "forward"}, "phase 'forward' is only used"),
    ],
)
def test_bad_link_fields_are_refused_with_the_allowed_values(change, message):
    with pytest.raises(ValueError, match=message):
        FaultSpec.from_dict({**BASE, **change})


def test_a_send_fault_lives_on_its_source_and_round_trips():
    spec = FaultSpec.from_dict({**BASE, "direction": "send", "rank": None, "phase": "backward"})
    assert FaultSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "kind, nproc, change, message",
    [
        ("fsdp", 2, {"source": 2}, "source 2 does not exist; allowed: 0..1"),
        ("fsdp", 2, {"rank": 3}, "rank 3 does not exist"),
        ("ddp", 2, {}, "DDP runs no all-gather"),
        ("tp", 2, {}, "comm.all_gather.*--parallel tp"),
    ],
)
def test_the_job_refuses_what_its_world_cannot_run(tmp_path, kind, nproc, change, message):
    from sdcscope.jobs.torchrun import make_job

    with pytest.raises(ValueError, match=message):
        make_job(tmp_path / "run", nproc, specs=[FaultSpec.from_dict({**BASE, **change})], parallel=Topology(kind=kind))


P2P = {
    "site": "comm.p2p",
    "target": "blocks.0",
    "rank": 1,
    "source": 0,
    "model": "bitflip",
    "bits": [30],
    "schedule": {"kind": "transient", "step": 2, "micro_batch": 1},
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": None}, "site 'comm.p2p' needs source"),
        ({"rank": None}, "site 'comm.p2p' needs rank: the destination"),
        ({"direction": "send"}, "direction 'send': site 'comm.p2p' corrupts what arrived"),
        ({"phase": "after"}, "unknown comm.p2p phase 'after'.*'forward', 'backward'"),
    ],
)
def test_bad_p2p_fields_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        FaultSpec.from_dict({**P2P, **change})


def test_a_p2p_fault_takes_a_micro_batch_and_round_trips():
    spec = FaultSpec.from_dict({**P2P, "phase": "backward", "rank": 0, "source": 1})
    assert spec.schedule.micro_batch == 1 and FaultSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "kind, nproc, change, message",
    [
        ("ddp", 2, {}, "DDP runs no pipeline send/recv"),
        ("fsdp", 2, {}, "FSDP2 and tensor parallelism run no pipeline send/recv"),
        ("pp", 3, {"phase": "backward"}, "source 0 does not send to rank 1 in the backward.*neighbour is rank 2"),
        ("pp", 2, {"phase": "backward"}, "rank 1 is pipeline stage 1 of 2: nothing arrives there in the backward"),
        ("pp", 3, {"rank": 2}, "source 0 does not send to rank 2.*neighbour is rank 1"),
        ("pp", 2, {"rank": 0, "source": 1}, "rank 0 is pipeline stage 0 of 2: nothing arrives there"),
        ("fsdp+pp", 4, {"rank": 3, "source": 0}, "neighbour is rank 1 \\(pipeline stage 0\\)"),
    ],
)
def test_the_job_refuses_a_p2p_link_the_pipeline_does_not_have(tmp_path, kind, nproc, change, message):
    from sdcscope.engine import TrainConfig
    from sdcscope.jobs.torchrun import make_job

    spec = FaultSpec.from_dict({**P2P, **change})
    with pytest.raises(ValueError, match=message):
        make_job(tmp_path / "run", nproc, train=TrainConfig(grad_accum=4), specs=[spec], parallel=Topology(kind=kind))


def test_1f1b_needs_a_micro_batch_per_stage(tmp_path):
    from sdcscope.engine import TrainConfig
    from sdcscope.jobs.torchrun import make_job

    with pytest.raises(ValueError, match="--schedule 1f1b over 2 pipeline stages needs --grad-accum 2 or more"):
        make_job(tmp_path / "run", 2, train=TrainConfig(grad_accum=1), parallel=Topology(kind="pp"))
    make_job(tmp_path / "run", 2, train=TrainConfig(grad_accum=1), parallel=Topology(kind="pp", schedule="gpipe"))


def test_check_job_takes_a_boundary_activation_and_refuses_another_target(tmp_path):
    from sdcscope.engine import TrainConfig
    from sdcscope.jobs.torchrun import check_job, make_job
    from sdcscope.workloads import WorkloadConfig

    def job(target):
        spec = FaultSpec.from_dict({**P2P, "target": target})
        workload = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000)
        return make_job(
            tmp_path / target,
            2,
            steps=3,
            workload=workload,
            train=TrainConfig(grad_accum=2),
            specs=[spec],
            parallel=Topology(kind="pp"),
        )

    check_job(job("blocks.0"))
    with pytest.raises(ValueError, match=r"fault spec #0 \(comm.p2p\).*matches no boundary.*allowed: \['blocks.0'\]"):
        check_job(job("blocks.1"))
