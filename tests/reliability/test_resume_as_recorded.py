"""A run that lost everything after a checkpoint (as after ``kill -9``), and a finished run, given to
``sdcscope train --resume DIR`` with no other option: the resume continues the run as its
config.json records it -- its steps target (not the CLI default), its checkpoint policy, the
checkpoint it took said -- and ends bitwise where the uninterrupted run ends; a complete run is
left as it is (nothing trained, nothing launched). In one process, and for a plain DDP run
(``--nproc 2``, no ``--parallel``) on two gloo ranks, which checkpoints periodically through
torch.distributed.checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.engine import TrainConfig
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.rundir import CheckpointPolicy, periodic_dir
from sdcscope.workloads import WorkloadConfig

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000, eval_batches=1)
DIST = DistConfig(backend="gloo", timeout_s=60)


def _json(path):
    return json.loads(path.read_text())


def _ok(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _files(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resume_continues_the_run_as_its_config_records_it(tmp_path):
    """After a kill (everything after the step-2 checkpoint lost) ``--resume DIR`` trains to the
    recorded steps with the recorded checkpoint policy and says from where; a complete run is
    left as it is; a larger --steps and another --checkpoint-every are taken, said and recorded."""
    run = tmp_path / "r"
    _ok("train", "--steps", 6, "--batch-size", 2, "--checkpoint-every", 2, "--keep-checkpoints", 3, "--out", run)
    assert _json(run / "config.json")["checkpoints"] == {"every": 2, "keep": 3}
    whole = _json(run / "summary.json")["param_sha256"]
    shutil.rmtree(run / "checkpoint")  # as if killed after step 3: the step-2 checkpoint is the newest
    shutil.rmtree(periodic_dir(run, 4))
    out = _ok("train", "--resume", run)
    assert f"resuming from {periodic_dir(run, 2)} (step 2) to step 6, as config.json records" in out, out
    summary = _json(run / "summary.json")
    assert (summary["steps"], summary["param_sha256"]) == (6, whole)
    assert periodic_dir(run, 4).is_dir()  # the recorded --checkpoint-every 2, not the default 100

    before = _files(run)
    out = _ok("train", "--resume", run)  # complete: nothing trained, nothing changed
    assert f"{run} is complete: 6 steps, as its config.json records; nothing to train" in out, out
    assert "--steps N (N > 6)" in out and _files(run) == before

    out = _ok("train", "--resume", run, "--steps", 8, "--checkpoint-every", 7)
    assert "(step 6) to step 8, --steps 8 extends the 6 steps config.json records" in out, out
    assert "checkpoints: --checkpoint-every 7 (the run had 2)" in out, out
    config = _json(run / "config.json")
    assert (config["steps"], config["checkpoints"]) == (8, {"every": 7, "keep": 3})
    assert config["resumes"][-1] == {"from_step": 6, "steps": 8, "changed": {"checkpoints.every": 7}}
    assert periodic_dir(run, 7).is_dir() and _json(run / "summary.json")["steps"] == 8


def _world(rank: int, world: int, whole: str, killed: str) -> None:
    """The run, then (rank 0 copies it without what came after step 2) its resume: one world."""
    from pathlib import Path

    import torch.distributed as dist

    from sdcscope.jobs.torchrun import make_job, resume_job, run_job

    init_distributed(DIST)
    policy = CheckpointPolicy(every=2, keep=3)
    run_job(
        make_job(whole, 2, steps=4, workload=WORKLOAD, train=TrainConfig(seed=0), dist_config=DIST, checkpoints=policy)
    )
    if rank == 0:
        shutil.copytree(whole, killed)
        shutil.rmtree(Path(killed) / "checkpoint")
        shutil.rmtree(periodic_dir(killed, 4), ignore_errors=True)
    dist.barrier()
    job, chosen, _ = resume_job(killed, dist_config=DIST)  # steps and policy: as config.json records
    assert (job.steps, job.checkpoints, chosen) == (4, policy, periodic_dir(killed, 2)), (job.steps, chosen)
    run_job(job)


@pytest.mark.distributed
def test_a_ddp_run_checkpoints_and_resumes_bitwise(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    spawn(_world, 2, (str(whole), str(killed)), timeout_s=240)
    manifest = _json(periodic_dir(whole, 2) / "manifest.json")
    assert manifest["format"] == "sdcscope-dcp-checkpoint/1" and manifest["step"] == 2
    assert manifest["layout"] == {"parallel": "ddp", "inner": 2, "world_size": 2}
    assert {"rank0.pt", "rank1.pt", ".metadata"} <= set(manifest["files"])
    assert _json(whole / "config.json")["checkpoints"] == {"every": 2, "keep": 3}
    summary = _json(killed / "summary.json")
    assert (summary["outcome"], summary["steps"]) == ("completed", 4)
    assert summary["param_sha256"] == _json(whole / "summary.json")["param_sha256"]
    assert _json(killed / "config.json")["resumes"] == [{"from_step": 2, "steps": 4}]
    assert [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]

    done = CliRunner().invoke(app, ["train", "--resume", str(whole)])  # complete: nothing launched
    text = " ".join(done.output.split())
    assert done.exit_code == 0 and f"{whole} is complete: 4 steps, as its config.json records" in text, text
    verified = CliRunner().invoke(app, ["checkpoint", "verify", str(whole)])
    assert verified.exit_code == 0 and "--parallel ddp on 2 ranks" in verified.output, verified.output
