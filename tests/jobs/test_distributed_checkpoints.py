"""A plain DDP run (``--nproc 2``, no ``--parallel``) on two gloo ranks checkpoints periodically
through torch.distributed.checkpoint, and a copy that lost everything after its step-2 checkpoint
(as after ``kill -9``) resumes to the steps its config.json records and ends bitwise where the
uninterrupted run ends; the resume of the complete run says so and launches nothing."""

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

pytestmark = pytest.mark.distributed

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000, eval_batches=1)
DIST = DistConfig(backend="gloo", timeout_s=60)


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


def _json(path):
    return json.loads(path.read_text())


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
