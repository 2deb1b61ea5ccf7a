"""Tensor helpers shared by the observers, detectors and mitigations: the values of a (possibly
sparse) gradient, and autocast switched off inside hooks that must compute in full precision."""

from __future__ import annotations

import contextlib

import torch

from sdcscope.common.world import local


def dense_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors with the norms and extremes of ``grads``: a sparse gradient (``nn.Embedding(sparse=True)``)
    as its coalesced values, which the fused ``torch._foreach_*`` reductions accept; a DTensor
    gradient as its local shard (the caller reduces over the mesh what must be global)."""
    return [g.coalesce().values() if g.is_sparse else local(g) for g in grads]


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
