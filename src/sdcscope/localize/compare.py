"""Element-wise comparison of a suspect tensor with its reference.

Exact mode (``atol == rtol == 0`` and the same dtype) compares the stored bits, so ``-0.0`` vs
``0.0`` and NaN payloads count. Otherwise values are compared in float64:
``|s - r| <= atol + rtol * |r|``, both-NaN and equal infinities are equal.

Statistics follow Ma et al. (ACL 2025): *mismatch frequency* = share of differing elements,
*mismatch severity* = mean relative difference ``|s - r| / |r|`` over the differing elements
with ``r != 0`` (a non-finite suspect counts as ``inf``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TensorDiff", "diff"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TensorDiff:
    numel: int
    count: int
    severity: float
    magnitude: float
    """Largest |s - r| (inf when a value became non-finite)."""
    relative: float
    """|s - r| / |r| at the element of ``magnitude`` (inf when r is 0)."""
    index: list[list[int]]
    """Multi-indices of the differing elements, largest difference first (at most ``limit``)."""
    reference: float | None
    suspect: float | None

    @property
    def frequency(self) -> float:
        return self.count / self.numel if self.numel else 0.0


def _differs(s: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    if atol == 0 and rtol == 0 and s.dtype == r.dtype:
        if s.is_floating_point() and s.element_size() in _INT_VIEW:
            view = _INT_VIEW[s.element_size()]
            return s.contiguous().view(view) != r.contiguous().view(view)
        return s != r
    s64, r64 = s.double(), r.double()
    close = (s64 == r64) | ((s64 - r64).abs() <= atol + rtol * r64.abs()) | (s64.isnan() & r64.isnan())
    return ~close


def diff(
    suspect: torch.Tensor, reference: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0, limit: int = 8
) -> TensorDiff:
    """Compare ``suspect`` with ``reference`` (same shape; a shape mismatch is a full mismatch)."""
    s, r = suspect.detach(), reference.detach().to(suspect.device)
    numel = s.numel()
    if s.shape != r.shape:
        return TensorDiff(numel, numel, math.inf, math.inf, math.inf, [], None, None)
    mask = _differs(s, r, atol, rtol)
    count = int(mask.sum())
    if count == 0:
        return TensorDiff(numel, 0, 0.0, 0.0, 0.0, [], None, None)
    s64, r64 = s.double()[mask], r.double()[mask]
    d = (s64 - r64).abs()
    d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
    nonzero = r64 != 0
    rel = d[nonzero] / r64[nonzero].abs()
    severity = float(rel.mean()) if rel.numel() else 0.0
    order = torch.argsort(d, descending=True, stable=True)[:limit]
    flat = mask.reshape(-1).nonzero().squeeze(1)[order]
    index = torch.stack(torch.unravel_index(flat, s.shape), dim=1).tolist() if s.dim() else [[] for _ in order]
    worst = int(order[0])
    ref_v, sus_v = float(r64[worst]), float(s64[worst])
    relative = float(d[worst]) / abs(ref_v) if ref_v != 0 else math.inf
    return TensorDiff(numel, count, severity, float(d[worst]), relative, index, ref_v, sus_v)
