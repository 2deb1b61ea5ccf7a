"""Reading ``trace.jsonl``: a header line, then one record per training step or evaluation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcscope.invariants.traceconfig import TRACE_FILE, TRACE_FORMAT


@dataclass
class Trace:
    header: dict[str, Any]
    records: list[dict[str, Any]]
    source: str

    def phase(self, phase: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["phase"] == phase]


def trace_path(run: str | Path) -> Path:
    """``RUN_DIR/trace.jsonl`` (or the file itself when given one)."""
    path = Path(run)
    if path.is_dir():
        path = path / TRACE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace at {str(path)!r}: record one with `sdcscope invariants trace` or a TraceRecorder(out=RUN_DIR)"
        )
    return path


def load_trace(run: str | Path) -> Trace:
    path = trace_path(run)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON lines: {exc}") from None
    if not rows or rows[0].get("kind") != "header" or rows[0].get("format") != TRACE_FORMAT:
        raise ValueError(f"{str(path)!r} does not start with a {TRACE_FORMAT} header line")
    return Trace(header=rows[0], records=rows[1:], source=str(path))
