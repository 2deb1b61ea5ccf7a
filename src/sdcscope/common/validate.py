"""The validation toolkit of every room's configs and specs: choices, keys, numbers, booleans.

One rule for which exception a mistake raises: ``TypeError`` for a value of the wrong *type* (a string
where a number is expected, a list where a mapping is expected, a number where a name is expected),
``ValueError`` for a value of the right type that is wrong (an unknown key or choice, a number out of
range). Messages name the bad value and the allowed ones, with the closest allowed name where one is
close (:func:`did_you_mean`).

Why not pydantic: the configs are plain dataclasses checked in ``__post_init__``, which a user builds
from Python, YAML, OmegaConf or Hydra alike; pydantic would add a dependency to a base install kept
small, its coercion (``"3"`` -> 3, ``"yes"`` -> True) is what these checks exist to refuse, and its
error text would not be the one-line "value, allowed ones, did you mean" message the CLI prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any

BRIEF_CHARS = 120
"""The longest a value is written in an error message: a message names a bad value, it does not
print a whole document (a YAML file's list of lists, a multi-megabyte string)."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40


def brief(value: object, limit: int = BRIEF_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (containers to their
    first items, long strings around a ``...``): a short value reads exactly as its ``repr``."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a user object whose repr fails still gets named
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_keys(what: str, data: Mapping, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    """Refuse (ValueError) a mapping that lacks a required key, naming what is missing, what is
    required and what else is allowed (a dataclass would say ``__init__() missing 2 required
    keyword-only arguments``)."""
    required = list(required)
    missing = [k for k in required if k not in data]
    if missing:
        optional = [k for k in optional if k not in required]
        also = f"; optional: {', '.join(optional)}" if optional else ""
        raise ValueError(f"{what} lacks {', '.join(map(repr, missing))}; a {what} needs {', '.join(required)}{also}")


def required_fields(cls) -> list[str]:
    """The fields of dataclass ``cls`` without a default, in order."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def close_matches(value: object, allowed: Iterable[object], *, n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The names of ``allowed`` closest to ``value`` (at most ``n``, best first)."""
    return difflib.get_close_matches(str(value), [str(a) for a in allowed], n=n, cutoff=cutoff)


def did_you_mean(value: object, allowed: Iterable[object], *, n: int = 1) -> str:
    """``" (did you mean 'x'?)"`` for an error message, or ``""`` when nothing in ``allowed`` is close."""
    close = close_matches(value, allowed, n=n)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (names): TypeError for a value that is no
    string, ValueError for an unknown name."""
    allowed = list(allowed)
    if value in allowed:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} {brief(value)} must be a string; allowed: {', '.join(allowed)}")
    raise ValueError(f"unknown {name} {brief(value)}; allowed: {', '.join(allowed)}{did_you_mean(value, allowed, n=3)}")


def choice(what: str, value: Any, allowed: Iterable[str]) -> str:
    """``value`` when it is one of ``allowed``, as :func:`check_choice`, the allowed ones written as a
    list (the fault spec's wording: ``allowed: ['none', 'per_step']``)."""
    allowed = list(allowed)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {brief(value)}; allowed: {allowed}")
    if value not in allowed:
        raise ValueError(f"unknown {what} {brief(value)}{did_you_mean(value, allowed)}; allowed: {allowed}")
    return value


def check_keys(what: str, data: Mapping, names: Iterable[str], allowed: Iterable[str] | None = None) -> None:
    """Refuse a key of ``data`` that is not in ``names`` (ValueError), with the closest of ``allowed``
    (default ``names``; then of ``names``) as a hint and ``allowed`` listed."""
    names = list(names)
    allowed = names if allowed is None else list(allowed)
    for key in data:
        if key not in names:
            hint = did_you_mean(key, allowed) or did_you_mean(key, names)
            raise ValueError(f"unknown {what} key {brief(key)}{hint}; allowed: {', '.join(allowed)}")


def check_mapping(what: str, data: object) -> Mapping:
    """``data`` when it is a mapping (a dict, an OmegaConf or Hydra config, a ``MappingProxyType``);
    TypeError otherwise."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, got {brief(data)}")
    return data


def build_config(cls, data: object, what: str):
    """``cls(**data)`` for a dataclass ``cls`` and any mapping ``data``; an unknown key is refused
    naming the allowed ones."""
    check_mapping(what, data)
    check_keys(what, data, [f.name for f in dataclasses.fields(cls)])
    missing_keys(what, data, required_fields(cls), [f.name for f in dataclasses.fields(cls)])
    return cls(**dict(data))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(what: str, value: Any, minimum: int | None = 0) -> int:
    """``value`` when it is an int (never a ``bool``) >= ``minimum`` (``None``: any)."""
    if not _is_int(value):
        raise TypeError(f"{what} must be an int, got {brief(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {brief(value)}")
    return value


def check_bool(name: str, value: object) -> None:
    """Refuse (TypeError) anything but a real ``bool`` (a string such as ``'no'`` too)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={brief(value)} must be a boolean; allowed: true, false")


def check_positive(name: str, value: object) -> None:
    """Refuse anything but an integer > 0: TypeError for a non-integer (a ``bool`` too), ValueError
    for one <= 0."""
    if not _is_int(value):
        raise TypeError(f"{name}={brief(value)} must be a positive integer (>= 1)")
    if value <= 0:
        raise ValueError(f"{name}={brief(value)} must be a positive integer (>= 1)")


def check_non_negative(name: str, value: object) -> None:
    """Refuse anything but an integer >= 0: TypeError for a non-integer (a ``bool`` too), ValueError
    for a negative one."""
    if not _is_int(value):
        raise TypeError(f"{name}={brief(value)} must be an integer >= 0")
    if value < 0:
        raise ValueError(f"{name}={brief(value)} must be an integer >= 0")


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Refuse anything but a finite real number within the given bounds: TypeError for a non-number
    (a ``bool``, a string), ValueError for a non-finite one or one out of bounds."""
    lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
    rule = " and ".join(s for s in (lo, hi) if s)
    message = f"{name}={brief(value)} must be a finite number{' ' + rule if rule else ''}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(message)
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(message)
