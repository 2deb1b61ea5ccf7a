"""torchrun's agent as the launcher runs it: ``torch.distributed.run`` unchanged, with its own log
lines and its report of a failed rank (``ChildFailedError``, some 40 lines ending in a traceback)
written to a log file instead of the console, and each failed rank's exit code or signal written
for the launcher, which says in one line what happened (:mod:`sdcscope.jobs.launcher`).

``python -m sdcscope.jobs.agent LOG EXITS TORCHRUN-ARGS...``; exit code 0, or 1 as torchrun's.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Sequence

__all__ = ["main"]


def _log_to(path: str) -> logging.Logger:
    """torch's loggers (torchrun's and elastic's among them: torch gives many of them a stderr
    handler of their own) write to ``path`` instead of the console."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger("torch")] + [
        lg
        for name, lg in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(lg, logging.Logger)
    ]
    for logger in loggers:
        streams = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        for stream in streams:
            logger.removeHandler(stream)
        if streams or logger.name == "torch":
            logger.addHandler(handler)
    return logging.getLogger("torch")


def main(argv: Sequence[str] | None = None) -> int:
    log_path, exits_path, *args = sys.argv[1:] if argv is None else list(argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logger = _log_to(log_path)
    try:
        run(parse_args(args))
    except ChildFailedError as exc:  # one or more ranks failed: their codes for the launcher
        first, _ = exc.get_first_failure()
        exits = {
            str(rank): {"pid": f.pid, "exitcode": f.exitcode, "first": rank == first}
            for rank, f in exc.failures.items()
        }
        logger.error("%s", exc.format_msg())
        with open(exits_path, "w") as fh:
            json.dump(exits, fh)
        return 1
    except Exception:  # torchrun itself failed (rendezvous, a signal): the launcher says so
        logger.error("torchrun failed:\n%s", traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
