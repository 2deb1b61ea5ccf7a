"""The launcher of a torchrun job on this machine (``sdcscope train --nproc N``).

The job is validated here, saved as a job file in a temporary folder and run by torchrun on N
local ranks (:mod:`sdcscope.jobs.torchrun`). SIGINT, SIGTERM and SIGHUP are forwarded to the
ranks, which stop after the same step; the launcher waits for them (bounded) and raises
:class:`~sdcscope.engine.run.Interrupted` with the run's summary.

The job's exit code is the ranks' own, not torchrun's (torchrun exits 1 whatever its ranks said):
each rank writes its code for the launcher (:data:`~sdcscope.jobs.ranklife.EXIT_CODES_ENV`), so a
rank that refused the job makes it exit ``USER_ERROR``; ranks that ended cleanly after the guard
stopped the run make it exit ``GUARD_STOPPED`` (:func:`job_code`).

Nothing outlives the launcher: torchrun gets SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``
on Linux) and every rank watches the launcher itself (:func:`sdcscope.jobs.ranklife.watch_launcher`).
Once a rank has recorded a failure (``failure.rank{r}.json``: a peer died or hung), the ranks
still running are looked at (stopped? which rank?), killed, and the whole story written to
``failure.json`` (:func:`describe_failure` makes the one line the CLI prints).

torchrun runs through :mod:`sdcscope.jobs.agent`: its own log lines and its report of a failed rank
go to ``torchrun.log`` (kept in the run directory when the job failed), not to the console, and
the exit code or signal of each failed rank reaches the line: ``rank 1 (pid N) was killed by
signal 9 (SIGKILL) at step 2; rank 0 lost its connection to it at once (Connection reset by
peer)`` -- or, for a rank that hangs, ``... gave up after --timeout 300 s``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdcscope.common.exitcodes import ExitCode
from sdcscope.engine.dist import DistributedError, free_port
from sdcscope.engine.run import Interrupted
from sdcscope.engine.rundir import read_json, read_jsonl, write_json
from sdcscope.jobs.ranklife import EXIT_CODES_ENV, LAUNCHER_ENV
from sdcscope.jobs.torchrun import Job, check_job, save_job

__all__ = ["launch", "LAUNCHER_SIGNALS", "describe_failure", "job_code", "FAILURE_FILE"]

TORCHRUN_LOG = "torchrun.log"
"""torchrun's own log lines and its account of failed ranks, kept in the run directory of a failed job."""
FAILURE_FILE = "failure.json"
"""The launcher's account of a failed job: every rank's state and what each failure file says."""
FAILURE_GRACE_S = 3.0
"""Seconds the other ranks get to record their own failure once one rank has recorded one."""
REAPED_GRACE_S = 20.0
"""Seconds torchrun gets to end the job by itself, once one rank recorded a failure, when it has
already reaped a rank: it then knows how that rank ended (a signal, an exit code) and writes it as
it exits; cut short, that rank's end is unknown (a loaded machine delays torchrun's turn)."""
RANK_CODES = (ExitCode.USER_ERROR, ExitCode.STORAGE, ExitCode.INTERNAL)
"""Rank exit codes that say what ended the job better than its peers' ``INFRASTRUCTURE`` (they
lost the world because that rank left) or torchrun's 1."""
_STATES = {
    "T": "stopped by a signal (SIGSTOP or a debugger)",
    "t": "stopped by a debugger",
    "D": "blocked in uninterruptible I/O",
    "R": "running but not taking part in the collective",
    "S": "waiting, not taking part in the collective",
}


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


def _linux() -> bool:
    return sys.platform.startswith("linux")


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


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (Linux; torchrun then stops its
    ranks). Elsewhere the ranks' own watch (:func:`sdcscope.jobs.ranklife.watch_launcher`) acts."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _rank_of(pid: int) -> int | None:
    """The torchrun rank of process ``pid`` (its RANK environment variable), or None."""
    with contextlib.suppress(OSError, ValueError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    return None


def _state(pid: int) -> str | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2 :].split()[0]
    return None


def _grace(ranks: dict[int, int]) -> float:
    """How long torchrun may take to end a job in which a rank recorded a failure."""
    return REAPED_GRACE_S if any(_state(pid) is None for pid in ranks.values()) else FAILURE_GRACE_S


def _failures(out: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in sorted(out.glob("failure.rank*.json")) if out.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            record = read_json(path)
            found[int(record.get("rank", path.stem.removeprefix("failure.rank")))] = record
    return found


def _exit_status(pid: int) -> int | None:
    """The wait status of ``pid`` while it is a zombie (Linux >= 3.5: /proc/PID/stat field 52)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[49])
    return None


def _ended(exitcode: int | None) -> str | None:
    """How a rank's process ended, from its exit code (< 0: the signal that killed it)."""
    if exitcode is None:
        return None
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _fate(pid: int, exit: dict[str, Any] | None) -> dict[str, Any]:
    """What became of a rank that recorded no failure: how it ended (torchrun's account, or the
    zombie's status), else what its live process is doing."""
    fate: dict[str, Any] = {"pid": pid}
    exitcode = None if exit is None else exit.get("exitcode")
    state = _state(pid)
    if exitcode is None and state == "Z" and (status := _exit_status(pid)) is not None:
        exitcode = -(status & 0x7F) if status & 0x7F else status >> 8
    if exitcode is not None:
        fate.update(exitcode=exitcode, ended=_ended(exitcode))
    elif state in (None, "Z"):
        fate["ended"] = "died (its exit status is unknown)"
    else:
        fate.update(state=state, doing=_STATES.get(state, f"in state {state}"))
    return fate


_RESETS = ("connection reset by peer", "connection closed by peer", "connection refused", "broken pipe")


def _gave_up(rank: int, record: dict[str, Any], timeout_s: float | None) -> str:
    """How rank ``rank`` lost its peer: at once (its connection reset) or after the timeout."""
    error, doing = str(record.get("error") or ""), record.get("doing") or "in a collective"
    lowered = error.lower()
    if "timeout" in lowered or "timed out" in lowered:
        waited = "" if timeout_s is None else f" after --timeout {timeout_s:g} s"
        return f"rank {rank} gave up{waited}: {doing}"
    reset = next((r for r in _RESETS if r in lowered), None)
    why = reset.capitalize() if reset else "its collective failed"
    return f"rank {rank} lost its connection to it at once ({why}): {doing}"


def _record_failure(
    out: Path, ranks: dict[int, int], timeout_s: float | None, exits: dict[int, dict[str, Any]] | None = None
) -> None:
    """``failure.json``: each rank's fate (its own failure record; how it ended, from torchrun's
    ``exits`` or its zombie; or its process state now), and the one line that sums it up."""
    records = _failures(out)
    exits = exits or {}
    fates = {}
    for rank in sorted({*ranks, *exits}):
        pid = ranks.get(rank, (exits.get(rank) or {}).get("pid", 0))
        if rank in records:
            fates[rank] = {"pid": pid, "failed": records[rank].get("error"), "step": records[rank].get("step")}
        else:
            fates[rank] = _fate(pid, exits.get(rank))
    silent = [r for r, f in fates.items() if "failed" not in f]
    silent.sort(key=lambda r: (not (exits.get(r) or {}).get("first"), "ended" not in fates[r], r))
    failed = [r for r, f in fates.items() if "failed" in f]
    if silent:
        r = silent[0]
        what = fates[r].get("ended") or f"hung: {fates[r]['doing']}"
        step = max((records[k].get("step", 0) for k in failed), default=None)
        line = f"rank {r} (pid {fates[r]['pid']}) {what}" + ("" if step is None else f" at step {step}")
        if failed:
            line += "; " + _gave_up(failed[0], records[failed[0]], timeout_s)
    elif failed:
        line = str(records[failed[0]].get("error"))
    else:
        line = "the job failed before any rank recorded why"
    with contextlib.suppress(OSError):
        write_json(out / FAILURE_FILE, {"message": line, "ranks": {str(k): v for k, v in fates.items()}})


def job_code(rc: int, ranks: dict[int, int], out: Path) -> int:
    """The exit code of a job whose torchrun ended with ``rc``, its ranks with ``ranks`` (rank ->
    code, those that said): the lowest rank's code among :data:`RANK_CODES` when one failed so;
    ``GUARD_STOPPED`` when every rank ended cleanly after the guard stopped the run; 0 on success;
    else ``INFRASTRUCTURE`` (a rank died, hung or lost its peers; torchrun exits 1 then)."""
    if rc == 0:
        return ExitCode.GUARD_STOPPED if _read_summary(out).get("outcome") == "stopped" else 0
    telling = [code for _, code in sorted(ranks.items()) if code in RANK_CODES]
    return ExitCode(telling[0]) if telling else ExitCode.INFRASTRUCTURE  # a lost rank; torchrun's 1 is no bug


def _exits(path: Path) -> dict[int, dict[str, Any]]:
    """The failed ranks' exit codes and pids as torchrun saw them (:mod:`sdcscope.jobs.agent`)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return {int(rank): dict(v) for rank, v in read_json(path).items()}
    return {}


def _rank_codes(folder: Path) -> dict[int, int]:
    """The exit codes the ranks wrote in ``folder`` (:data:`~sdcscope.jobs.ranklife.EXIT_CODES_ENV`)."""
    codes = {}
    for path in folder.glob("rank*"):
        with contextlib.suppress(OSError, ValueError):
            codes[int(path.name.removeprefix("rank"))] = int(path.read_text())
    return codes


def describe_failure(out: Path, rc: int) -> tuple[int, str]:
    """The exit code and the one line for a job :func:`launch` ended with ``rc``: the guard's stop
    (its reason names the rank and the site); a rank's own refusal, storage failure or bug (its
    error is above); else the launcher's ``failure.json`` when it wrote one, the first rank failure
    record, or the code alone."""
    if rc == ExitCode.GUARD_STOPPED:
        reason = _read_summary(out).get("stop_reason", "see summary.json")
        return ExitCode.GUARD_STOPPED, f"the guard stopped the run: {reason} (ledger: {out / 'ledger.json'})"
    if rc in RANK_CODES:
        code = ExitCode(rc)
        return code, f"a rank ended the job with exit code {int(code)} ({code.name}); its error is above"
    path = out / FAILURE_FILE
    with contextlib.suppress(OSError, ValueError):
        return ExitCode.INFRASTRUCTURE, f"{read_json(path)['message']} (details: {path})"
    records = _failures(out)
    if records:
        rank = min(records)
        return ExitCode.INFRASTRUCTURE, f"{records[rank].get('error')} (details: {out / f'failure.rank{rank}.json'})"
    log = out / TORCHRUN_LOG
    where = f"torchrun's log: {log}" if log.is_file() else "see the rank errors above"
    return ExitCode.INFRASTRUCTURE, f"distributed training failed (exit code {rc}); {where}"


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
    ``nproc`` local ranks through torchrun; return its exit code (:func:`job_code`: 0 when every
    rank succeeded and the run was not stopped by the guard).
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
        log, exits_path = Path(folder) / TORCHRUN_LOG, Path(folder) / "exits.json"
        cmd = [
            sys.executable,
            "-m",
            "sdcscope.jobs.agent",
            str(log),
            str(exits_path),
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "-m",
            "sdcscope.jobs.torchrun",
            str(path),
        ]
        codes = Path(folder) / "exit"
        codes.mkdir()
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid()), EXIT_CODES_ENV: str(codes)}
        with _held_signals() as stop:
            proc = subprocess.Popen(
                cmd, start_new_session=stop is not None, env=env, preexec_fn=_die_with_parent if _linux() else None
            )
            try:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                ranks: dict[int, int] = {}  # rank -> pid, as seen while they ran
                failed_at = None
                while proc.poll() is None and not stop:
                    if deadline is not None and time.monotonic() > deadline:
                        raise DistributedError(f"the world of {nproc} ranks did not finish within {timeout_s:g} s")
                    for pid in _children(proc.pid) or ():
                        if pid not in ranks.values() and (rank := _rank_of(pid)) is not None:
                            ranks[rank] = pid
                    if failed_at is None and _failures(job.out):
                        failed_at = time.monotonic()
                    if failed_at is not None and time.monotonic() > failed_at + _grace(ranks):
                        _record_failure(job.out, ranks, job.dist.timeout_s)
                        _kill(proc)  # a hung rank never leaves by itself
                        break
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(0.2)
                rc = _stop(proc, stop, grace_s) if stop else proc.returncode
                exits = _exits(exits_path)
                if rc and not stop and not (job.out / FAILURE_FILE).exists() and (_failures(job.out) or exits):
                    _record_failure(job.out, ranks, job.dist.timeout_s, exits)
                rc = job_code(rc, _rank_codes(codes), job.out)
                if rc and job.out.is_dir() and log.is_file():  # torchrun's account, kept off the console
                    with contextlib.suppress(OSError):
                        shutil.copyfile(log, job.out / TORCHRUN_LOG)
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
