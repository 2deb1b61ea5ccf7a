"""Sharded checkpoints (torch.distributed.checkpoint) of FSDP2 and tensor-parallel runs on two gloo
ranks: a run stopped after step k and resumed ends bitwise where the uninterrupted run ends; a
tampered shard is refused by name; a fault-tainted newer checkpoint is passed over for the
verified one; a resume on another layout is refused before any rank starts."""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from helpers import at, rank_flip
from sdcscope.engine import TrainConfig
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.rundir import CheckpointPolicy, periodic_dir
from sdcscope.engine.state import CheckpointError
from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.workloads import WorkloadConfig

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000, eval_batches=1)
DIST = DistConfig(backend="gloo", timeout_s=60)
EVERY_2 = CheckpointPolicy(every=2, keep=3)


def _job(out, kind: str, steps: int, specs=(), guard: GuardConfig | None = None) -> dict:
    from sdcscope.jobs.torchrun import make_job

    return make_job(
        out,
        2,
        steps=steps,
        workload=WORKLOAD,
        train=TrainConfig(seed=0),
        dist_config=DIST,
        specs=[FaultSpec.from_dict(s) for s in specs],
        guard=guard,
        parallel=Topology(kind=kind),
        checkpoints=EVERY_2,
    ).to_dict()


def _resume(out, steps: int):
    from sdcscope.jobs.torchrun import resume_job

    return resume_job(out, steps, dist_config=DIST, checkpoints=EVERY_2)


def _world(rank: int, world: int, jobs: list[dict]) -> None:
    """Every job on the same two ranks, one after the other (the process start is paid once)."""
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DIST)
    for job in jobs:
        run_job(Job.from_dict(job))


def _summary(path) -> dict:
    return json.loads((path / "summary.json").read_text())


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two worlds of two ranks: the runs, then the resumes of those that stopped early. FSDP2:
    ``whole`` (4 steps, a checkpoint at step 2), ``killed`` (its copy that lost everything after
    step 2), ``tainted`` (a fault at step 2 that the guard only reports); tensor parallel:
    ``tp_whole`` (3 steps), ``tp_stopped`` (2 steps, then resumed from its final checkpoint)."""
    tmp = tmp_path_factory.mktemp("sharded_checkpoints")
    names = ("whole", "killed", "tainted", "tp_whole", "tp_stopped")
    paths = {n: tmp / n for n in names}
    # the flip at step 2 is found by ABFT and, with no policy, only reported: the state is tainted from then on
    report_only = GuardConfig.from_dict({"profile": "full", "policy": {"defaults": False}})  # every GEMM checked
    fault = rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(2), bit=30)
    first = [
        _job(paths["whole"], "fsdp", 4),
        _job(paths["tainted"], "fsdp", 3, [fault], report_only),
        _job(paths["tp_whole"], "tp", 3),
        _job(paths["tp_stopped"], "tp", 2),
    ]
    spawn(_world, 2, (first,), timeout_s=300)
    paths["reference"] = _summary(paths["whole"])["param_sha256"]
    shutil.copytree(paths["whole"], tmp / "pristine")  # the tamper test's copy, as written
    paths["pristine"] = tmp / "pristine"
    # a run killed after step 3, before its final checkpoint: the periodic step-2 one is the newest
    shutil.copytree(paths["whole"], paths["killed"])
    shutil.rmtree(paths["killed"] / "checkpoint")
    second, paths["chosen"] = [], {}
    for name in ("killed", "tp_stopped"):
        job, chosen, skipped = _resume(paths[name], 4 if name == "killed" else 3)
        assert skipped == []
        paths["chosen"][name] = chosen
        second.append(job.to_dict())
    spawn(_world, 2, (second,), timeout_s=300)
    return paths


def test_fsdp_run_resumed_from_its_periodic_checkpoint_ends_bitwise_as_uninterrupted(runs):
    # every rank wrote its own shard file; the manifest lists every file with its sha256
    manifest = _manifest(periodic_dir(runs["pristine"], 2))
    assert manifest["format"] == "sdcscope-dcp-checkpoint/1" and manifest["step"] == 2
    assert manifest["layout"] == {"parallel": "fsdp", "inner": 2, "world_size": 2}
    assert {"__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt", ".metadata"} == set(manifest["files"])
    assert manifest["verified"] is None  # no guard watched
    assert _manifest(runs["pristine"] / "checkpoint")["step"] == 4

    killed = runs["killed"]
    assert runs["chosen"]["killed"] == periodic_dir(killed, 2)
    summary = _summary(killed)
    assert (summary["outcome"], summary["steps"]) == ("completed", 4)
    assert summary["param_sha256"] == runs["reference"]
    config = json.loads((killed / "config.json").read_text())
    assert config["resumes"] == [{"from_step": 2, "steps": 4}]
    metrics = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # the steps trained again replace their rows
    assert _manifest(killed / "checkpoint")["step"] == 4


def test_tensor_parallel_run_resumed_from_its_final_checkpoint_ends_bitwise_as_uninterrupted(runs):
    stopped = runs["tp_stopped"]
    assert runs["chosen"]["tp_stopped"] == stopped / "checkpoint"
    assert _summary(stopped)["steps"] == 3
    assert _summary(stopped)["param_sha256"] == _summary(runs["tp_whole"])["param_sha256"]


def test_fault_tainted_newer_checkpoint_is_passed_over_for_the_verified_one(runs):
    tainted = runs["tainted"]
    # step 2 was verified by every rank's guard; the checkpoint after the reported fault was not
    assert _manifest(periodic_dir(tainted, 2))["verified"] is True
    assert _manifest(tainted / "checkpoint")["verified"] is False
    _, chosen, skipped = _resume(tainted, 4)
    assert chosen == periodic_dir(tainted, 2)
    assert [p for p, _ in skipped] == [tainted / "checkpoint"] and "unresolved guard finding" in skipped[0][1]


def test_tampered_shard_and_another_layout_are_refused_by_name(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["pristine"], run)
    shutil.rmtree(run / "checkpoints")  # the final checkpoint is the only one

    # another layout than the checkpoint's: refused by name before any rank starts
    with pytest.raises(ValueError, match=r"--nproc 4: the run and its checkpoints are --nproc 2"):
        _resume_with(run, nproc=4)
    with pytest.raises(ValueError, match=r"--parallel tp: the run and its checkpoints are --parallel fsdp"):
        _resume_with(run, parallel="tp")
    edited = tmp_path / "edited"
    shutil.copytree(run, edited)
    config = json.loads((edited / "config.json").read_text())
    config["parallel"]["kind"] = "hsdp"
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"written by --parallel fsdp --nproc 2 .* not resharded"):
        _resume(edited, 4)

    # one shard file changed on disk: verify and resume name it
    shard = run / "checkpoint" / "__1_0.distcp"
    _flip_a_byte(shard)
    with pytest.raises(CheckpointError, match=f"{shard}.*does not match its manifest"):
        _resume(run, 4)
    from sdcscope.cli import app

    got = CliRunner().invoke(app, ["checkpoint", "verify", str(run / "checkpoint")])
    text = " ".join(got.output.split())
    assert got.exit_code == 2 and f"{shard}' does not match its manifest" in text, text
    _flip_a_byte(shard)  # restored: it verifies again, as a sharded checkpoint
    got = CliRunner().invoke(app, ["checkpoint", "verify", str(run)])
    assert got.exit_code == 0, got.output
    text = " ".join(got.output.split())
    assert "5 file(s) match their sha256 and load (weights_only), sharded (torch.distributed.checkpoint, " in text
    assert "--parallel fsdp on 2 ranks)" in text
    assert f"train --resume {run} continues from {run / 'checkpoint'}" in text

    # rank0.pt rewritten with its sha256 resealed: it matches, but does not load with weights_only=True,
    # so the resume refuses it as a bad checkpoint (exit 2, the file named) before any rank starts
    rank0 = run / "checkpoint" / "rank0.pt"
    torch.save({"step": 4, "when": datetime.date(2026, 1, 1)}, rank0)
    manifest = _manifest(run / "checkpoint")
    manifest["files"]["rank0.pt"] = hashlib.sha256(rank0.read_bytes()).hexdigest()
    (run / "checkpoint" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{rank0}' does not load with weights_only=True"):
        _resume(run, 4)
    for args in (["train", "--resume", str(run), "--timeout", "20"], ["checkpoint", "verify", str(run)]):
        got = CliRunner().invoke(app, args)
        text = " ".join(got.output.split())
        assert got.exit_code == 2 and f"{rank0}' does not load with weights_only=True" in text, text
        assert "lost the world" not in text and "Traceback" not in text, text  # no rank started, none blamed


def _resume_with(out, **given):
    from sdcscope.jobs.torchrun import resume_job

    return resume_job(out, 4, dist_config=DIST, **given)
