"""Process exit codes a scheduler can act on: one table for every command and every rank.

They are distinct so that a launcher or a job scheduler can tell a bad command line (fix the
spec) from a run that crashed or was stopped by the guard (inspect the run, maybe exclude the
node named in the ledger) and from an infrastructure failure (retry elsewhere).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug in sdcscope: a traceback was printed
    USER_ERROR = 2  # bad input, refused before any work (spec, option, path, checkpoint)
    CRASHED = 3  # the run finished with a non-finite loss or parameters (outcome ``crash``)
    GUARD_STOPPED = 4  # the guard stopped the run: stalled, or a persistent fault it cannot exclude
    INFRASTRUCTURE = 5  # a rank died or hung, a collective failed, the launcher was lost
    STORAGE = 6  # a write failed: disk full, read-only file system, permission denied
    INTERRUPTED = 130  # SIGINT (128 + signal number for other signals)


DESCRIPTIONS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.INTERNAL: "internal error in sdcscope (a traceback is printed)",
    ExitCode.USER_ERROR: "user error: bad spec, option, path or checkpoint, refused before any work",
    ExitCode.CRASHED: "the run crashed: non-finite loss or parameters",
    ExitCode.GUARD_STOPPED: "the guard stopped the run (stalled, or a persistent fault it cannot exclude)",
    ExitCode.INFRASTRUCTURE: "infrastructure failure: a rank died or hung, or a collective failed",
    ExitCode.STORAGE: "storage failure: disk full, read-only file system or permission denied",
    ExitCode.INTERRUPTED: "interrupted by a signal (128 + its number; 130 for SIGINT)",
}
