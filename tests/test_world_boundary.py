"""One world, one decision: only the world factory (``sdcscope.common.world``) inspects DDP wrappers
or DTensor types, and the guard has one decision loop (``StepSession.decide``)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sdcscope"
FACTORY = SRC / "common" / "world.py"
TYPE_CHECKS = re.compile(
    r"isinstance\([^)]*\b(DistributedDataParallel|DDP|DTensor)\b"  # isinstance(x, DDP)
    r"|__name__\s*==\s*[\"'](DTensor|DistributedDataParallel)[\"']"  # type(t).__name__ == "DTensor"
    r"|[\"']to_local[\"']"  # hasattr(t, "to_local")
    r"|getattr\([^)]*[\"']sharded[\"']"  # getattr(g.ranks, "sharded", False)
)


def sources():
    return sorted(p for p in SRC.rglob("*.py") if p != FACTORY)


def test_no_code_outside_the_world_factory_inspects_ddp_or_dtensor_types():
    found = [
        f"{p.relative_to(SRC)}:{i}: {line.strip()}"
        for p in sources()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if TYPE_CHECKS.search(line)
    ]
    assert not found, "ask sdcscope.common.world (world_of, is_dtensor, local, is_ddp) instead:\n" + "\n".join(found)


def test_the_scan_sees_a_type_check():
    """The pattern catches the forms it forbids (else the test above would pass on anything)."""
    for line in ("isinstance(m, DistributedDataParallel)", 'type(t).__name__ == "DTensor"', 'hasattr(t, "to_local")'):
        assert TYPE_CHECKS.search(line), line
    assert not TYPE_CHECKS.search("world = world_of(model, ddp)")


def test_the_guard_decides_in_one_place():
    decides = [
        f"{p.relative_to(SRC)}:{i}"
        for p in sources()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*def decide\(", line)
    ]
    assert decides == [f"guard/session.py:{_line('guard/session.py', 'def decide(')}"], decides


def _line(path: str, text: str) -> int:
    return next(i for i, line in enumerate((SRC / path).read_text().splitlines(), 1) if text in line)


def test_the_docs_show_the_support_table_the_code_reads():
    from sdcscope.common.world import support_markdown

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    shown = text.split("<!-- support-table -->\n", 1)[1].split("\n<!-- /support-table -->", 1)[0]
    regenerate = "python -c 'from sdcscope.common.world import support_markdown as t; print(t())'"
    assert shown == support_markdown(), f"regenerate the table: {regenerate}"
