"""Small validation helpers shared by the workload configs (errors name the value and the allowed ones)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}{hint}")


def check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def check_non_negative(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
