"""The run directory contract (docs/architecture.md): config.json, metrics.jsonl, injections.jsonl,
events.jsonl, summary.json, and ``checkpoint/`` for resuming."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sdcscope.common.io import JsonlWriter, as_written, dumps, file_in_the_way, read_json, read_jsonl, write_json
from sdcscope.engine.state import MANIFEST_FILE

__all__ = [
    "RUN_FILES",
    "LOG_FILES",
    "CHECKPOINT_DIR",
    "JsonlWriter",
    "as_written",
    "dumps",
    "read_json",
    "read_jsonl",
    "write_json",
    "check_new_run_dir",
    "has_checkpoint",
]

RUN_FILES = ("config.json", "metrics.jsonl", "injections.jsonl", "events.jsonl", "summary.json")
LOG_FILES = ("metrics.jsonl", "injections.jsonl", "events.jsonl")
CHECKPOINT_DIR = "checkpoint"


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` saved a checkpoint it can be resumed from."""
    return (Path(run_dir) / CHECKPOINT_DIR / MANIFEST_FILE).is_file()


def check_writable(path: Path, flag: str = "--out") -> None:
    """Refuse, before any work, an output ``path`` (a folder, or a file's path) that cannot be
    written (a read-only mount, a parent without write permission, /proc): tried with a probe
    folder made and removed at once in ``path``, or in its nearest existing parent."""
    anchor = path if path.is_dir() else next(p for p in path.absolute().parents if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sdcscope-probe-", dir=anchor))
    except OSError as exc:
        raise ValueError(
            f"{flag} {str(path)!r} cannot be written: {str(anchor)!r} refuses new files ({exc.strerror or exc})"
        ) from None


def check_new_run_dir(path: str | Path) -> Path:
    """A run may be written to a missing or empty folder only: never over another run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a file, not a folder")
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise ValueError(f"--out {str(path)!r} cannot be created: {str(blocker)!r} is a file, not a folder")
    check_writable(path)
    if path.is_dir() and any(path.iterdir()):
        if not (path / "config.json").exists():
            raise ValueError(f"--out {str(path)!r} already holds other files; give a new or empty folder")
        if has_checkpoint(path):
            raise ValueError(
                f"--out {str(path)!r} already holds another run; give a new or empty folder "
                f"(or continue that run: sdcscope train --resume {path} --steps N)"
            )
        raise ValueError(
            f"--out {str(path)!r} already holds another run, which saved no checkpoint and cannot "
            "be resumed; give a new or empty folder (or delete it)"
        )
    return path
