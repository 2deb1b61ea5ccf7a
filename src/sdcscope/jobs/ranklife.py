"""A torchrun rank's ties to its launcher: the launcher's pid and the folder for the ranks' exit
codes travel in the environment; a rank watches the launcher (and torchrun) and stops when either
dies, writes its exit code where the launcher reads it, and logs each line naming itself."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sdcscope.common.exitcodes import ExitCode

LAUNCHER_ENV = "SDCSCOPE_LAUNCHER_PID"
"""The launcher's pid, in every rank's environment: a rank outlives neither it nor torchrun."""
EXIT_CODES_ENV = "SDCSCOPE_EXIT_CODES"
"""A folder where each rank writes its exit code (file ``rank{r}``): torchrun itself exits 1 on any
rank's failure, so the launcher reads there what the ranks said (a refused job: ``USER_ERROR``)."""


def _gone(pid: int, fd: int | None) -> bool:
    if fd is not None:
        import select

        return bool(select.select([fd], [], [], 0)[0])  # a pidfd reads ready once its process ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def watch_launcher(grace_s: float = 5.0, poll_s: float = 0.2) -> threading.Thread | None:
    """Stop this rank when its launcher (:data:`LAUNCHER_ENV`) or its parent (torchrun) dies: a
    SIGTERM to itself first (the ranks stop after the same step, as on Ctrl-C), and after
    ``grace_s`` an immediate exit (:data:`ExitCode.INFRASTRUCTURE`), so an orphaned rank never
    trains on. None when there is nothing to watch."""
    launcher = os.environ.get(LAUNCHER_ENV)
    parent = os.getppid()
    pid = int(launcher) if launcher and launcher.isdigit() else None
    fd = None
    if pid is not None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            os._exit(ExitCode.INFRASTRUCTURE)  # gone before this rank started
        except OSError:
            fd = None

    def watch() -> None:
        while os.getppid() == parent and (pid is None or not _gone(pid, fd)):
            time.sleep(poll_s)
        print(f"error: rank {os.environ.get('RANK', '?')}: its launcher is gone; stopping", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(ExitCode.INFRASTRUCTURE)

    thread = threading.Thread(target=watch, name="sdcscope-launcher-watch", daemon=True)
    thread.start()
    return thread


def configure_logging(level: str, rank: int | str) -> None:
    """This rank's log lines (one WARNING per guard event among them) on stderr at ``level``, each
    naming the rank: the launcher configures only its own process's logging."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s rank {rank} %(name)s: %(message)s"))
    logger = logging.getLogger("sdcscope")
    logger.setLevel(level)  # a name: ValueError when unknown
    logger.addHandler(handler)


def tell_launcher(code: int) -> None:
    """Write this rank's exit code where the launcher reads it (:data:`EXIT_CODES_ENV`)."""
    folder = os.environ.get(EXIT_CODES_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(str(int(code)))
