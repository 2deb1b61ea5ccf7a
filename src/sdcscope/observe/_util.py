"""Helpers shared by :mod:`sdcscope.observe` and :mod:`sdcscope.detect` (which may import observe).

* the duck-typed **MatMul contract**: a module whose class (or instance) has ``is_matmul = True``
  and whose ``forward(a, b)`` returns ``a @ b`` (batched, no bias). ``sdcscope.workloads.gpt.MatMul``
  follows it; so can any user module. Nothing here imports the workloads room.
* shell-style module-name patterns (``fnmatch``, ``*`` also crosses dots) resolved against
  ``model.named_modules()``, with close matches in the error when a pattern matches nothing;
* conversion of metric values to strict JSON.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

import torch
from torch import nn


def is_matmul(module: nn.Module) -> bool:
    """True for modules following the MatMul contract (``is_matmul = True``, ``forward(a, b) = a @ b``)."""
    return getattr(module, "is_matmul", False) is True


def dense_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors with the norms and extremes of ``grads``: a sparse gradient (``nn.Embedding(sparse=True)``)
    as its coalesced values, which the fused ``torch._foreach_*`` reductions accept."""
    return [g.coalesce().values() if g.is_sparse else g for g in grads]


def _device_type(device: torch.device | str) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def autocast_on(device: torch.device | str) -> bool:
    """Whether autocast is enabled for ``device``'s type (False for a type autocast does not know)."""
    try:
        return torch.is_autocast_enabled(_device_type(device))
    except RuntimeError:  # a device type autocast does not know
        return False


def no_autocast(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Disable autocast for ``device``: hooks run inside the model's autocast region, where an
    fp32 matmul of a monitor or checksum would silently run in bf16."""
    if not autocast_on(device):  # the common case: nothing to switch off
        return _NULL
    return torch.autocast(_device_type(device), enabled=False)


_NULL = contextlib.nullcontext()


def match_modules(
    model: nn.Module,
    patterns: Iterable[str] | None,
    *,
    where: Callable[[nn.Module], bool] = lambda m: True,
    option: str = "modules",
    strict: bool = True,
) -> dict[str, nn.Module]:
    """``{name: module}`` for modules accepted by ``where`` whose name matches any pattern.

    ``patterns=None`` selects every accepted module. With ``strict``, a pattern that matches no
    accepted module raises ``ValueError`` naming it and the closest candidate names.
    """
    candidates = {name: m for name, m in model.named_modules() if name and where(m)}
    if patterns is None:
        return candidates
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    chosen: dict[str, nn.Module] = {}
    for pat in patterns:
        hits = {n: m for n, m in candidates.items() if fnmatchcase(n, pat)}
        if not hits and strict:
            close = difflib.get_close_matches(pat, list(candidates), n=3, cutoff=0.4)
            hint = f"; closest: {', '.join(close)}" if close else ""
            shown = ", ".join(list(candidates)[:8]) + (", ..." if len(candidates) > 8 else "")
            raise ValueError(
                f"{option} pattern {pat!r} matches no eligible module{hint} "
                f"(eligible: {shown or 'none'})"
            )
        chosen.update(hits)
    return chosen


def jsonable(value: object) -> object:
    """Strict-JSON version of a metric/evidence value: non-finite floats become the strings
    ``"nan"``, ``"inf"``, ``"-inf"`` (``float()`` reads them back); tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a stray 0-d tensor / numpy scalar
        return jsonable(value.item())
    return value
