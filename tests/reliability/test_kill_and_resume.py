"""``kill -9`` of ``sdcscope train`` at a random step (a random moment: between steps, inside a
periodic checkpoint write, ...), then ``--resume``: the run continues from its newest complete
checkpoint and ends with the parameters of an uninterrupted run, bit for bit; nothing is logged
twice, no temporary file is left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.engine import Run, TrainConfig, read_jsonl
from sdcscope.engine.rundir import CheckpointPolicy
from sdcscope.workloads import WorkloadConfig

pytestmark = pytest.mark.slow

STEPS = 60
ARGS = ["--steps", str(STEPS), "--batch-size", "2", "--checkpoint-every", "3", "--keep-checkpoints", "2"]
CLI = [sys.executable, "-c", "import sys; from sdcscope.cli import main; sys.exit(main())"]


def _lines(path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _kill_at(out, step: int) -> int:
    """Start a training subprocess and SIGKILL it once ``step`` steps are logged; the steps logged then."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*CLI, "train", *ARGS, "--out", str(out)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while _lines(out / "metrics.jsonl") < step:
            if proc.poll() is not None:
                pytest.fail(f"training ended before it was killed: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("training did not reach the step to kill it at")
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return _lines(out / "metrics.jsonl")


def test_kill_9_at_a_random_step_then_resume_equals_an_uninterrupted_run(tmp_path):
    seed = int.from_bytes(os.urandom(2), "little")
    step = random.Random(seed).randrange(4, STEPS - 4)
    logged = _kill_at(tmp_path / "run", step)
    assert logged < STEPS, "killed too late to test anything"

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess trained (OMP_NUM_THREADS=1): bitwise comparable
    try:
        resumed = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "run"), "--steps", str(STEPS)])
        reference = Run(
            tmp_path / "reference",
            WorkloadConfig(batch_size=2),
            TrainConfig(),
            checkpoints=CheckpointPolicy(every=0),
        ).train(STEPS)
    finally:
        torch.set_num_threads(threads)
    assert resumed.exit_code == 0, (seed, step, resumed.output)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["param_sha256"] == reference["param_sha256"], (seed, step)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(STEPS))
    assert not list((tmp_path / "run").rglob("*.tmp")), (seed, step)
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) <= 2  # bounded
