"""The Guard over sharded training (gloo on loopback): FSDP2 and tensor parallel runs of the GPT,
``--parallel`` through the torchrun job's own code; refusals of what cannot be guarded there."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import at, rank_flip, two_rank_job
from sdcscope.engine import TrainConfig
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000)
NONFINITE = {  # an output element's exponent stuck at all ones on rank 1 from step 2: inf or NaN
    "site": "gemm.forward",
    "target": "blocks.1.mlp.fc",
    "rank": 1,
    "model": "stuck_at_1",
    "bits": list(range(23, 31)),
    "pattern": {"kind": "element", "index": 5},
    "schedule": {"kind": "permanent", "start": 2},
}


def _job(out, kind: str, steps: int, specs=(), guard: GuardConfig | None | bool = True):
    guard_config = GuardConfig(profile="full") if guard is True else guard or None  # every GEMM every step
    return two_rank_job(out, kind, steps, specs, guard_config, crossrank=bool(guard)).to_dict()


def _world(rank: int, world: int, jobs: list[dict], out) -> None:
    """Every job on the same two ranks (one world: the process start is paid once), then the
    refusals a user meets in an own script with a tensor-parallel model."""
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for job in jobs:
        run_job(Job.from_dict(job))  # a guard's stop ends every rank cleanly, after the same step
    wl = make_workload(WORKLOAD)
    torch.manual_seed(0)
    model = wl.build_model()
    topology = Topology(kind="tp")
    topology.apply(model, topology.build_mesh(world, "cpu"), wl)
    opt = wl.build_optimizer(model)
    refused = {}
    for name, cfg in {
        "abft": GuardConfig(metrics=None),
        "metrics": GuardConfig(abft=None, metrics={"stats_every": 2}),  # set by the user: refused
        "default metrics": GuardConfig(abft=None),  # the default's: switched off, by the one table
        "zclip": GuardConfig(metrics=None, abft=None, zclip={}),
    }.items():
        try:
            guard = Guard(model, opt, cfg)
            refused[name] = None if guard.metrics is None else "built with metrics on"
            guard.close()
        except ValueError as exc:
            refused[name] = str(exc)
    if rank == 0:
        (out / "refused.json").write_text(json.dumps(refused))


def _events(path) -> list[dict]:
    return [json.loads(line) for line in (path / "events.jsonl").read_text().splitlines()]


def _summary(path) -> dict:
    return json.loads((path / "summary.json").read_text())


def test_fsdp_and_tp_guarded_runs_detect_name_repair_and_refuse(tmp_path):
    # a forward-GEMM exponent flip on rank 1 at step 2 of an FSDP2 run: rank 1's ABFT check of the
    # unsharded weight's GEMM finds it, every rank replays the step together, the fault is gone
    # (transient), the re-execution is kept, and the run ends where the clean run ends, bit for bit
    fault = rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(2), bit=30)
    # the policy asks to quarantine the rank: under FSDP2 it owns a shard nobody else holds, so
    # every rank stops after the same step, the ledger names the device
    quarantine = GuardConfig(profile="full", policy={"rules": {"abft:transient": ["quarantine"]}})
    jobs = [
        _job(tmp_path / "fsdp_clean", "fsdp", 4),
        _job(tmp_path / "fsdp_fault", "fsdp", 4, [fault]),
        _job(tmp_path / "tp_clean", "tp", 3),
        _job(
            tmp_path / "fsdp_stop",
            "fsdp",
            4,
            [rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(1), bit=26)],
            quarantine,
        ),
        # a permanent fault that makes a GEMM's output non-finite on rank 1, under the default
        # (balanced: sampled ABFT) profile: the non-finite loss reaches every rank
        _job(tmp_path / "fsdp_nonfinite", "fsdp", 8, [NONFINITE], GuardConfig()),
    ]
    spawn(_world, 2, (jobs, tmp_path), timeout_s=300)

    clean, faulty = _summary(tmp_path / "fsdp_clean"), _summary(tmp_path / "fsdp_fault")
    assert clean["outcome"] == faulty["outcome"] == "completed"
    assert clean["parallel"] == "fsdp" and clean["replicas_identical"]
    assert _events(tmp_path / "fsdp_clean") == []
    events = _events(tmp_path / "fsdp_fault")
    abft = [e for e in events if e["detector"] == "abft"]
    assert abft and all(e["step"] == 2 for e in events)
    assert {(e["rank"], e["module"], e["gemm"]) for e in abft} == {(1, "blocks.0.mlp.fc", "forward")}
    assert all(e["verdict"] == "transient" and e["action"] == "recompute" for e in events)
    assert faulty["param_sha256"] == clean["param_sha256"]

    tp = _summary(tmp_path / "tp_clean")
    assert tp["outcome"] == "completed" and tp["parallel"] == "tp" and tp["replicas_identical"]
    assert _events(tmp_path / "tp_clean") == []
    config = json.loads((tmp_path / "tp_clean" / "config.json").read_text())
    assert config["guard"]["metrics"] is None  # switched off under sharding, with a warning
    assert config["guard"]["abft"]["targets"] is None  # every GEMM, the split linears' local ones too

    stop = _summary(tmp_path / "fsdp_stop")
    assert stop["outcome"] == "stopped" and stop["steps"] == 2 and "owns a shard" in stop["stop_reason"]
    last = _events(tmp_path / "fsdp_stop")[-1]
    assert (last["detector"], last["verdict"], last["action"]) == ("guard", "stopped", "stop")
    ledger = json.loads((tmp_path / "fsdp_stop" / "ledger.json").read_text())
    assert [d["rank"] for d in ledger["devices"].values() if d["suspicions"]] == [1]

    # a sharded non-finite escalates like a single-process one: its replay checks every GEMM, so
    # the first finding names rank 1 and the faulty layer (one event, not one per rank that saw
    # the NaN surface at ln_f), and the site's strikes stop the run with the ledger naming rank 1
    events = _events(tmp_path / "fsdp_nonfinite")
    first = events[0]
    assert (first["step"], first["detector"], first["rank"], first["module"]) == (2, "nonfinite", 1, "blocks.1.mlp.fc")
    assert first["evidence"]["replay"]["caught"] == {"1": ["blocks.1.mlp.fc"]}
    assert [e["step"] for e in events if e["detector"] == "nonfinite"] == sorted({e["step"] for e in events})
    assert all(e["rank"] in (1, None) for e in events)  # the healthy rank is never named
    nonfinite = _summary(tmp_path / "fsdp_nonfinite")
    assert nonfinite["outcome"] == "stopped" and "blocks.1.mlp.fc" in nonfinite["stop_reason"]
    ledger = json.loads((tmp_path / "fsdp_nonfinite" / "ledger.json").read_text())
    assert [d["rank"] for d in ledger["devices"].values() if d.get("faulty")] == [1]

    refused = json.loads((tmp_path / "refused.json").read_text())
    assert refused["abft"] is None  # ABFT checks the split linears on each rank's local shards
    assert refused["metrics"].startswith("guard metrics is not supported in a sharded run")
    assert refused["default metrics"] is None
    assert refused["zclip"].startswith("guard zclip is not supported in a sharded run")


def test_parallel_layouts_are_checked_before_any_rank_starts(tmp_path):
    from sdcscope.jobs.torchrun import make_job

    with pytest.raises(ValueError, match="parallel"):
        Topology(kind="zero3")
    with pytest.raises(ValueError, match="--nproc a multiple of 2"):
        Topology(kind="hsdp").check(3)
    with pytest.raises(ValueError, match="cnn workload has no parallelize plan"):
        Topology(kind="fsdp").check(2, make_workload(WorkloadConfig(workload="cnn")))
    with pytest.raises(ValueError, match="n_head=2 .* allowed degrees: 1, 2"):
        Topology(kind="tp").check(3, make_workload(WORKLOAD))
    with pytest.raises(ValueError, match="eval-every with --parallel fsdp: evaluation of a sharded model"):
        make_job(tmp_path / "x", 2, train=TrainConfig(eval_every=2), parallel=Topology(kind="fsdp"))
    with pytest.raises(ValueError, match="site 'comm' under --parallel tp"):
        make_job(
            tmp_path / "x",
            2,
            specs=[FaultSpec.from_dict(rank_flip("comm", "bucket.0", 1, at(1)))],
            parallel=Topology(kind="tp"),
        )
    assert not (tmp_path / "x").exists()


def test_train_parallel_needs_several_ranks_and_a_known_layout(tmp_path):
    from typer.testing import CliRunner

    from sdcscope.cli import app

    got = CliRunner().invoke(app, ["train", "--parallel", "fsdp", "--steps", "1", "--out", str(tmp_path / "a")])
    assert got.exit_code == 2 and "give --nproc N" in got.output
    got = CliRunner().invoke(
        app, ["train", "--parallel", "zero3", "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "b")]
    )
    assert got.exit_code == 2 and "unknown parallel 'zero3'" in got.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
