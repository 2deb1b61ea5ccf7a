"""Tensor-valued facts of a trace: exact checksums, and fetching many values with one copy.

The recorder keeps what it measures on the device while a step runs (:func:`checksum` of the
watched tensors, losses, norms, masks) and resolves them all when the record closes with
:func:`fetch`, so a step costs one device-to-host copy however many values it records.
"""

from __future__ import annotations

import numpy as np
import torch

Pending = tuple[torch.Tensor, "dict | list", "str | int", bool, bool]
"""A value waiting to be fetched: ``(tensor, target, key, integer, vector)``; ``target[key]``
receives it (a list when ``vector``), through int64 when ``integer``."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 16
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _chunk_weights(n: int, device: torch.device) -> torch.Tensor:
    """The first n of the fixed chunk of odd weights (cached views of one tensor per device)."""
    w = _weights.get((n, device))
    if w is None:
        full = _weights.get((_CHUNK, device))
        if full is None:
            g = torch.Generator().manual_seed(0x5DC5C0)
            full = _weights[(_CHUNK, device)] = (torch.randint(-(2**61), 2**61, (_CHUNK,), generator=g) * 2 + 1).to(
                device
            )
        w = _weights[(n, device)] = full[:n]
    return w


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Exact integer checksum of a tensor's bits: a 0-d int64 tensor, computed on its device.

    ``Σ bits_i · w_(i mod L) · c_(i div L)  mod 2^64`` with odd weights: flipping any bit of any
    element changes it (the product of odd weights is odd), it depends on positions, and
    integer addition makes it independent of reduction order, so equal tensors give equal
    checksums on any device.  Unlike a hash of the first row of values scaled by 1e8, nothing
    of the tensor is left out.  The weights are one fixed chunk of L, so memory stays bounded.
    """
    flat = (t.detach() if t.requires_grad else t).reshape(-1)
    if flat.dtype != torch.int64:
        if flat.dtype == torch.bool or flat.is_floating_point():
            flat = flat.view(_INT_VIEW[flat.element_size()])
        flat = flat.to(torch.int64)
    n = flat.numel()
    if n <= _CHUNK:
        return (flat * _chunk_weights(n, flat.device)).sum()
    rows = n // _CHUNK
    total = (flat[rows * _CHUNK :] * _chunk_weights(n - rows * _CHUNK, flat.device)).sum()
    per_row = (flat[: rows * _CHUNK].view(rows, _CHUNK) * _chunk_weights(_CHUNK, flat.device)).sum(dim=1)
    return total + (per_row * (torch.arange(rows, device=flat.device) * 2 + 3)).sum()


def fetch(pending: list[Pending]) -> None:
    """Write each pending value into its ``target[key]``.  On an accelerator, all with one
    device-to-host copy (floats travel as the bits of float64 in an int64 buffer); on the CPU,
    where reading a value costs no synchronization, directly (cheaper than building the buffer)."""
    if all(t.device.type == "cpu" for t, *_ in pending):
        for t, target, key, _, vector in pending:
            target[key] = t.tolist() if vector else t.item()
        return
    device = pending[0][0].device
    floats = [p for p in pending if not p[3]]
    ints = [p for p in pending if p[3]]
    parts = [t.reshape(-1).to(device, torch.float64).view(torch.int64) for t, *_ in floats]
    parts += [t.reshape(-1).to(device, torch.int64) for t, *_ in ints]
    buf = torch.cat(parts).cpu().numpy()
    n_float = sum(t.numel() for t, *_ in floats)
    values = buf[:n_float].view(np.float64).tolist() + buf[n_float:].tolist()
    i = 0
    for t, target, key, _, vector in floats + ints:
        n = t.numel()
        target[key] = values[i : i + n] if vector else values[i]
        i += n
