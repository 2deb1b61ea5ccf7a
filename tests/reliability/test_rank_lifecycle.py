"""Ranks of ``sdcscope train --nproc 2`` never outlive their launcher, and a hung rank ends the job:
after ``kill -9`` of the launcher no rank (nor torchrun) remains after ``--timeout`` seconds; a
rank stopped with SIGSTOP ends the job with one line naming it and what it and its peer were
doing, the exit code for an infrastructure failure, and the failure file the line points to."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcscope.common.exitcodes import ExitCode

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CLI = [sys.executable, "-c", "import sys; from sdcscope.cli import main; sys.exit(main())"]
TIMEOUT = 6  # --timeout: seconds a collective may wait (shortened: the default is 300)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = s[1]
    found, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"]


def _rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


def _start(out: Path) -> tuple[subprocess.Popen, dict[int, int], list[int]]:
    """A 2-rank run training; (the launcher, {rank: pid}, every process under the launcher)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--nproc", "2", "--steps", "100000", "--batch-size", "2", "--timeout", str(TIMEOUT)]
    proc = subprocess.Popen(
        [*CLI, *args, "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            _cleanup(proc)
            pytest.fail(f"the run did not start training: {proc.communicate()}")
        time.sleep(0.1)
    tree = _descendants(proc.pid)
    ranks = {r: p for p in tree if (r := _rank(p)) is not None and _stat(p) is not None}
    ranks = {r: p for r, p in ranks.items() if _stat(p)[1] != proc.pid}  # the ranks, not torchrun
    assert sorted(ranks) == [0, 1], (tree, ranks)
    return proc, ranks, tree


def _cleanup(proc: subprocess.Popen, pids: list[int] = ()) -> None:
    for pid in [*_descendants(proc.pid), *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_ranks_die_with_their_launcher(tmp_path):
    proc, ranks, tree = _start(tmp_path / "run")
    try:
        proc.send_signal(signal.SIGKILL)  # the launcher alone: torchrun and the ranks are not told
        proc.wait()
        deadline = time.monotonic() + TIMEOUT
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(tree) == [], f"still running {TIMEOUT} s after the launcher died: {_alive(tree)}"
    finally:
        _cleanup(proc, tree)


def test_a_stopped_rank_ends_the_job_with_one_line_naming_it(tmp_path):
    out = tmp_path / "run"
    proc, ranks, tree = _start(out)
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=TIMEOUT + 60)
        elapsed = time.monotonic() - t0
    finally:
        _cleanup(proc, tree)
    assert proc.returncode == ExitCode.INFRASTRUCTURE, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    last = [line for line in stderr.splitlines() if line.startswith("error:")][-1]
    assert f"rank 1 (pid {ranks[1]}) hung: stopped by a signal" in last, last
    assert f"after --timeout {TIMEOUT} s" in last and "rank 0 gave up" in last, last
    where = re.search(r"details: (\S+)\)", last).group(1)
    failure = json.loads(Path(where).read_text())
    assert failure["ranks"]["1"]["state"] == "T" and "failed" in failure["ranks"]["0"]
    assert (out / "failure.rank0.json").is_file()
    assert elapsed < TIMEOUT + 30, elapsed  # the collective's timeout, then the launcher ends it
    assert _alive(tree) == []
