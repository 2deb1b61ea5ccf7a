"""JSON and JSON-lines helpers shared by every room (run directories, logs, results)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/Infinity: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), allow_nan=False, default=str)


def as_written(obj: Any) -> Any:
    """``obj`` as it reads back from a JSON file written here (tuples become lists, non-finite
    floats strings): the form to compare with what a run directory records."""
    return json.loads(dumps(obj))


def write_json(path: str | Path, obj: Any) -> None:
    """Atomic JSON write (tmp file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class JsonlWriter:
    """Append-only JSON-lines file, flushed per record so a killed run keeps what it wrote.

    The file is opened on the first write (or :meth:`touch`), so building a writer creates
    nothing: validation can run before any output exists.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f = None

    def _open(self):
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        return self._f

    def touch(self) -> None:
        self._open().flush()

    def write(self, record: dict[str, Any]) -> None:
        f = self._open()
        f.write(dumps(record) + "\n")
        f.flush()

    def truncate_after(self, key: str, limit: int) -> None:
        """Drop records with ``record[key] >= limit`` (used when a run resumes from a checkpoint)."""
        self.close()
        kept = [r for r in read_jsonl(self.path) if r.get(key, -1) < limit]
        self.path.write_text("".join(dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
