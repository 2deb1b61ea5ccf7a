"""Tensor names, shell-style patterns and the bit masks the trace stores sets of parameters in.

Invariants name parameters by qualified name (``blocks.0.attn.q_proj.weight``), never by shape
or position, so a check can never compare two unrelated tensors that happen to look alike.  A
set of parameters is written compactly in YAML as patterns (``["*"]``, ``["blocks.*"]``) and
in the trace as an integer bit mask over the header's parameter list.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from sdcscope.common.validate import close_matches as _closest


def close_matches(pattern: str, names: Sequence[str]) -> str:
    """' (close matches: a, b)' for an error message, or '' if nothing is close.

    A wildcard pattern (``blocks.0.atn.*``) is compared with module paths and answered with
    patterns (``blocks.0.attn.*``); an exact name with names.
    """
    pool = {n: n for n in names}
    probe = pattern
    if "*" in pattern or "?" in pattern:
        probe = pattern.rstrip("*?").rstrip(".") or pattern
        for n in names:
            parts = n.split(".")
            for k in range(1, len(parts)):
                pool.setdefault(".".join(parts[:k]), ".".join(parts[:k]) + ".*")
    close = _closest(probe, pool, n=3, cutoff=0.5)
    return f" (close matches: {', '.join(pool[c] for c in close)})" if close else ""


def resolve(patterns: Iterable[str], names: Sequence[str], what: str) -> list[str]:
    """Names matching any pattern, in ``names`` order; a pattern matching nothing is an error."""
    hit: set[str] = set()
    for pattern in patterns:
        found = fnmatch.filter(names, pattern)
        if not found:
            raise ValueError(
                f"{what} pattern {pattern!r} matches no tensor of the model being "
                f"checked{close_matches(pattern, names)}"
            )
        hit.update(found)
    return [n for n in names if n in hit]


def compress(selected: Iterable[str], names: Sequence[str]) -> list[str]:
    """The fewest ``module.*`` patterns (or exact names) that select exactly ``selected``.

    For each selected name, the shortest module prefix whose every tensor is selected wins, so
    "all parameters but the frozen embedding" reads as ``[blocks.*, ln_f.*, ...]``.
    """
    chosen = set(selected)
    if chosen == set(names):
        return ["*"]
    out: list[str] = []
    for name in names:
        if name not in chosen:
            continue
        parts = name.split(".")
        pattern = name
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k]) + "."
            if all(n in chosen for n in names if n.startswith(prefix)):
                pattern = prefix + "*"
                break
        if pattern not in out:
            out.append(pattern)
    return out


def mask_of(selected: Iterable[str], names: Sequence[str]) -> int:
    index = {n: i for i, n in enumerate(names)}
    mask = 0
    for n in selected:
        mask |= 1 << index[n]
    return mask


def names_of(mask: int, names: Sequence[str]) -> list[str]:
    return [n for i, n in enumerate(names) if mask >> i & 1]


def to_hex(mask: int) -> str:
    return hex(mask)


def from_hex(value: str) -> int:
    return int(value, 16)


def pair_up(a: str, b: str, names: Sequence[str], what: str) -> list[tuple[str, str]]:
    """Pairs (x, y) of tensors named by ``a`` and ``b``, which hold one ``*`` each or none.

    ``a = replicas.0.*`` and ``b = replicas.1.*`` pair every tensor under ``replicas.0`` with the
    tensor of the same suffix under ``replicas.1``; a counterpart that does not exist is an error.
    """
    if a.count("*") != b.count("*") or a.count("*") > 1:
        raise ValueError(f"{what}: a={a!r} and b={b!r} must both hold one '*' or both none")
    if "*" not in a:
        for n in (a, b):
            if n not in names:
                raise ValueError(
                    f"{what}: tensor {n!r} does not exist in the model being checked{close_matches(n, names)}"
                )
        return [(a, b)]
    head, tail = a.split("*")
    rx = re.compile(re.escape(head) + "(.*)" + re.escape(tail) + r"\Z")
    known = set(names)
    pairs = []
    for n in names:
        m = rx.match(n)
        if m is None:
            continue
        other = b.replace("*", m.group(1))
        if other not in known:
            raise ValueError(
                f"{what}: {n!r} has no counterpart {other!r} in the model being checked{close_matches(other, names)}"
            )
        pairs.append((n, other))
    if not pairs:
        raise ValueError(f"{what}: pattern {a!r} matches no tensor of the model being checked{close_matches(a, names)}")
    return pairs
