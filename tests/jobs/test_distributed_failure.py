"""A world that cannot be formed, or loses a rank, fails with a clear error and keeps its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sdcscope.engine import TrainConfig, read_jsonl
from sdcscope.engine.dist import DistConfig, DistributedError, free_port, init_distributed, spawn
from sdcscope.engine.distrun import DistRun
from sdcscope.jobs import make_job, save_job
from sdcscope.workloads import WorkloadConfig

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000)


class DieAt:
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def before_step(self, ctx) -> None:
        if ctx.trainer.rank == self.rank and ctx.step == self.step:
            os._exit(3)  # the process vanishes, as with a dead device or node


def _dies(rank: int, world: int, out) -> None:
    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=30))
    DistRun(out, WORKLOAD, TrainConfig(seed=0)).train(10, callbacks=[DieAt(rank=1, step=3)])


def test_a_rank_that_dies_fails_the_world_clearly_and_keeps_the_run_directory(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(DistributedError) as info:
        spawn(_dies, 2, (out,), timeout_s=120)
    message = str(info.value)
    assert "rank 0: DistributedError: rank 0 lost the world at step 3" in message
    assert "rank 1: exited with code 3" in message
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    failure = json.loads((out / "failure.rank0.json").read_text())
    assert failure["step"] == 3 and "peer rank died" in failure["error"]


def test_a_world_that_cannot_form_times_out_with_a_clear_error(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    out = tmp_path / "run"
    job = save_job(make_job(out, 2, steps=2, dist_config=DistConfig(timeout_s=2)), tmp_path / "job.json")
    proc = subprocess.run(
        [sys.executable, "-m", "sdcscope.jobs.torchrun", str(job)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 5  # ExitCode.INFRASTRUCTURE
    assert f"rank 0 could not form a world of 2 ranks at 127.0.0.1:{port} within 2 s" in proc.stderr
    assert not out.exists()
