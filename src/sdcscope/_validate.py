"""Small validation helpers shared by every room's configs (errors name the value and the allowed ones)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}{hint}")


def check_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a real ``bool`` (a string such as ``'no'`` is refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a boolean; allowed: true, false")


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer > 0 (``bool`` is refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer (>= 1)")


def check_non_negative(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= 0 (``bool`` is refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")


def check_float(name: str, value: object, *, low: float | None = None,
                high: float | None = None, low_open: bool = False, high_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number (not a ``bool``, not a
    string) within the given bounds."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        rule = " and ".join(s for s in (lo, hi) if s)
        raise ValueError(f"{name}={value!r} must be a finite number{' ' + rule if rule else ''}")


def build_config(cls, data: object, what: str):
    """``cls(**data)`` for a dataclass ``cls`` and any mapping ``data`` (a dict, an OmegaConf or
    Hydra config, a ``MappingProxyType``); an unknown key is refused naming the allowed ones."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown {what} key {key!r}{hint}; allowed: {', '.join(names)}")
    return cls(**dict(data))
