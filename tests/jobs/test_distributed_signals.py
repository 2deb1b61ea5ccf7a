"""``sdcscope train --nproc 2`` stopped by SIGTERM (to the CLI alone) or SIGINT (to its process
group, as a terminal's Ctrl-C): every rank stops, nothing is left running, summary.json says
``interrupted``, no rank claims a crash, and the CLI exits like a single-process interruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CLI = [sys.executable, "-c", "import sys; from sdcscope.cli import main; sys.exit(main())"]


def _survivors(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (the run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(cmdline)
    return found


def _start(out: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*CLI, "train", "--nproc", "2", "--steps", "100000", "--batch-size", "2", "--out", str(out), "--timeout", "30"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    deadline = time.monotonic() + 40
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_all(proc, out)
            pytest.fail(f"the run did not start training: {proc.communicate()}")
        time.sleep(0.2)
    return proc


def _kill_all(proc: subprocess.Popen, out: Path) -> None:
    """Clean up after a failed test: nothing of the run may outlive it."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(out) in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass
    proc.kill()
    proc.wait()


def _check_stopped(proc: subprocess.Popen, out: Path, signum: int) -> None:
    try:
        stdout, stderr = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        _kill_all(proc, out)
        pytest.fail("the CLI did not exit within 45 s of the signal")
    try:
        assert proc.returncode == 128 + signum, (proc.returncode, stdout, stderr)
        assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
        assert "interrupted at step" in stderr, stderr
        assert not list(out.glob("failure.rank*.json"))
        summary = json.loads((out / "summary.json").read_text())
        steps = len((out / "metrics.jsonl").read_text().splitlines())
        assert summary["outcome"] == "interrupted" and summary["steps"] == steps >= 3
        assert summary["world_size"] == 2 and summary["replicas_identical"]
        assert f"interrupted at step {steps} of 100000" in stderr
        assert (out / "config.json").is_file()
        deadline = time.monotonic() + 5  # torchrun and the ranks have been reaped already
        while _survivors(str(out)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _survivors(str(out)) == []
    finally:
        _kill_all(proc, out)


def test_sigterm_to_the_cli_stops_every_rank_and_saves_an_interrupted_summary(tmp_path):
    out = tmp_path / "sigterm-run"
    proc = _start(out)
    proc.send_signal(signal.SIGTERM)
    _check_stopped(proc, out, signal.SIGTERM)


def test_ctrl_c_to_the_process_group_stops_every_rank_quietly(tmp_path):
    out = tmp_path / "sigint-run"
    proc = _start(out, start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _check_stopped(proc, out, signal.SIGINT)


def test_a_killed_world_still_gets_an_interrupted_summary_from_its_metrics(tmp_path):
    from sdcscope.jobs.launcher import _interrupted_summary

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.5}\n')
    summary = _interrupted_summary(tmp_path, 2)  # rank 0 wrote none: the ranks were killed
    assert (summary["outcome"], summary["steps"], summary["final_train_loss"], summary["world_size"]) == (
        "interrupted",
        2,
        4.5,
        2,
    )
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert _interrupted_summary(tmp_path / "never-created", 2)["steps"] == 0
    assert not (tmp_path / "never-created").exists()
