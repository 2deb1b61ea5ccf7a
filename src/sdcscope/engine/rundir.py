"""The run directory contract (see DESIGN.md): config.json, metrics.jsonl, injections.jsonl,
events.jsonl, summary.json, and ``checkpoint/`` for resuming."""

from __future__ import annotations

from pathlib import Path

from sdcscope._io import JsonlWriter, dumps, read_jsonl, write_json

__all__ = ["RUN_FILES", "JsonlWriter", "dumps", "read_jsonl", "write_json", "check_new_run_dir"]

RUN_FILES = ("config.json", "metrics.jsonl", "injections.jsonl", "events.jsonl", "summary.json")


def check_new_run_dir(path: str | Path) -> Path:
    """A run may be written to a missing or empty folder only: never over another run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()):
        what = "another run" if (path / "config.json").exists() else "other files"
        raise ValueError(f"--out {str(path)!r} already holds {what}; give a new or empty folder "
                         "(or --resume it to continue that run)")
    return path
