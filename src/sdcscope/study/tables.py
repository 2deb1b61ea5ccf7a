"""Report tables: a title, headers and rows of text cells, with an optional note."""

from __future__ import annotations

from typing import Any

__all__ = ["fmt", "table"]


def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(title: str, headers: list[str], rows: list[list[Any]], note: str = "") -> dict[str, Any]:
    return {"title": title, "headers": headers, "rows": [[fmt(v) for v in r] for r in rows], "note": note}
