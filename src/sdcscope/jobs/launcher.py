"""The launcher of a torchrun job on this machine (``sdcscope train --nproc N``).

The job is validated here, saved as a job file in a temporary folder and run by torchrun on N
local ranks (:mod:`sdcscope.jobs.torchrun`). SIGINT, SIGTERM and SIGHUP are forwarded to the
ranks, which stop after the same step; the launcher waits for them (bounded) and raises
:class:`~sdcscope.engine.run.Interrupted` with the run's summary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdcscope.engine.dist import DistributedError, free_port
from sdcscope.engine.run import Interrupted
from sdcscope.engine.rundir import read_json, read_jsonl, write_json
from sdcscope.jobs.torchrun import Job, check_job, save_job

__all__ = ["launch", "LAUNCHER_SIGNALS"]


LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals :func:`launch` catches and forwards to the ranks (SIGHUP as SIGTERM)."""


@contextlib.contextmanager
def _held_signals() -> Iterator[list[int] | None]:
    """Collect :data:`LAUNCHER_SIGNALS` (every one received, in order) instead of dying of them;
    None where handlers cannot be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in LAUNCHER_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _children(pid: int) -> list[int] | None:
    """The live child processes of ``pid`` (torchrun's: the ranks), from /proc; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's children (the ranks), then torchrun, and reap it."""
    for pid in _children(proc.pid) or ():
        _signal(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _stop(proc: subprocess.Popen, stop: list[int], grace_s: float) -> int:
    """Forward the stop request to the ranks (torchrun itself without /proc), wait up to
    ``grace_s`` for the job to end, and kill what is left (at once on a second signal)."""
    forward = stop[0] if stop[0] in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM
    deadline, told = time.monotonic() + grace_s, set()
    while proc.poll() is None:
        if len(stop) > 1 or time.monotonic() > deadline:
            _kill(proc)
            break
        ranks = _children(proc.pid)
        for pid in [proc.pid] if ranks is None else ranks:  # ranks started late are told too
            if pid not in told:
                _signal(pid, forward)
                told.add(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.2)
    return proc.returncode


def _interrupted_summary(out: Path, world: int) -> dict[str, Any]:
    """Rank 0's summary of an interrupted run; where it wrote none (the ranks were killed, or
    stopped before training), one from metrics.jsonl, written to ``out`` if it exists."""
    summary = _read_summary(out)
    if "steps" in summary:
        return summary
    rows = []
    with contextlib.suppress(OSError, ValueError):
        rows = read_jsonl(out / "metrics.jsonl")
    last = rows[-1] if rows else {}
    summary = {
        "outcome": "interrupted",
        "final_train_loss": last.get("loss"),
        "final_val_loss": None,
        "steps": last["step"] + 1 if "step" in last else 0,
        "world_size": world,
    }
    if out.is_dir():
        write_json(out / "summary.json", summary)
    return summary


def _read_summary(out: Path) -> dict[str, Any]:
    """``out/summary.json``, or {} where there is none (or it does not read)."""
    with contextlib.suppress(OSError, ValueError):
        return read_json(out / "summary.json")
    return {}


def launch(job: Job, *, timeout_s: float | None = None, grace_s: float = 30.0) -> int:
    """Validate ``job`` here (:func:`~sdcscope.jobs.torchrun.check_job`), then run it on its
    ``nproc`` local ranks through torchrun; return its exit code (0 when every rank succeeded).
    Past ``timeout_s`` the ranks are terminated (torchrun forwards the signal) and
    :class:`DistributedError` is raised.

    SIGINT, SIGTERM or SIGHUP (torchrun runs in its own session, so a terminal's Ctrl-C reaches
    this process only) is forwarded to the ranks, which stop after the same step; past ``grace_s``,
    or on a second signal, they are killed. Then :class:`Interrupted` is raised with the run's
    summary (outcome ``interrupted``; written here from metrics.jsonl if rank 0 could not), and so
    it is when the ranks were stopped by a signal from elsewhere."""
    nproc = job.nproc
    check_job(job)
    with tempfile.TemporaryDirectory(prefix="sdcscope-job-") as folder:
        path = save_job(job, Path(folder) / "job.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "-m",
            "sdcscope.jobs.torchrun",
            str(path),
        ]
        with _held_signals() as stop:
            proc = subprocess.Popen(cmd, start_new_session=stop is not None)
            try:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while proc.poll() is None and not stop:
                    if deadline is not None and time.monotonic() > deadline:
                        raise DistributedError(f"the world of {nproc} ranks did not finish within {timeout_s:g} s")
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(0.2)
                rc = _stop(proc, stop, grace_s) if stop else proc.returncode
            finally:
                if proc.poll() is None:
                    proc.terminate()  # torchrun forwards it to the ranks
                    try:
                        proc.wait(grace_s)
                    except subprocess.TimeoutExpired:
                        _kill(proc)
    if stop or _read_summary(job.out).get("outcome") == "interrupted":
        summary = _interrupted_summary(job.out, nproc)
        if summary.get("outcome") == "interrupted":  # not a run that completed before the signal took effect
            raise Interrupted(stop[0] if stop else signal.SIGTERM, summary)
    return rc
