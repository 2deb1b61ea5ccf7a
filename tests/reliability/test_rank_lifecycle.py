"""Ranks of ``sdcscope train --nproc 2`` never outlive their launcher, and a hung rank ends the job:
after ``kill -9`` of the launcher no rank (nor torchrun) remains after ``--timeout`` seconds; a
rank stopped with SIGSTOP ends the job with one line naming it and what it and its peer were
doing, the exit code for an infrastructure failure, and the failure file the line points to; a
rank killed with SIGKILL is named with its signal, its peer's immediate connection reset told
apart from a timeout, and torchrun's own report kept in torchrun.log, off the console."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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


def _start(out: Path, *extra: str) -> tuple[subprocess.Popen, dict[int, int], list[int]]:
    """A 2-rank run training; (the launcher, {rank: pid}, every process under the launcher)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "--nproc", "2", "--steps", "100000", "--batch-size", "2", "--timeout", str(TIMEOUT), *extra]
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


def _two_free_ports() -> int:
    """A port p with p + 1 free too: ranks 0 and 1 serve Prometheus on them."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                if port < 65535 and b.connect_ex(("127.0.0.1", port + 1)) != 0:
                    try:
                        b.bind(("127.0.0.1", port + 1))
                    except OSError:
                        continue
                    return port
    pytest.skip("no two adjacent free ports")


def _scrape(port: int) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            if "sdcscope_step{" in text:
                return text
        except OSError:
            pass
        assert time.monotonic() < deadline, f"nothing served on port {port}"
        time.sleep(0.2)


def test_a_killed_rank_is_named_with_its_signal_and_each_rank_served_its_metrics(tmp_path):
    out, port = tmp_path / "run", _two_free_ports()
    proc, ranks, tree = _start(out, "--prometheus-port", str(port))
    try:
        served = {rank: _scrape(port + rank) for rank in (0, 1)}  # rank r on port + r, labelled r
        os.kill(ranks[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=TIMEOUT + 60)
    finally:
        _cleanup(proc, tree)
    for rank, text in served.items():
        assert f'sdcscope_grad_norm{{rank="{rank}"}}' in text and "# HELP sdcscope_layer_grad_norm" in text, text
    assert proc.returncode == ExitCode.INFRASTRUCTURE, (proc.returncode, stderr)
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr  # torchrun's report: 40 lines
    assert not re.search(r"^[WEI]\d{4} ", stderr, re.M), stderr  # nor torchrun's own log lines
    last = [line for line in stderr.splitlines() if line.startswith("error:")][-1]
    assert f"rank 1 (pid {ranks[1]}) was killed by signal 9 (SIGKILL)" in last, last  # it said "exited"
    assert "rank 0 lost its connection to it at once" in last and "--timeout" not in last, last
    assert "SIGKILL" in (out / "torchrun.log").read_text()
    assert _alive(tree) == []
