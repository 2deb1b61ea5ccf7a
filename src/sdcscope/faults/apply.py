"""Apply a whole :class:`~.spec.FaultSpec` to one tensor (pattern, format, model)."""

from __future__ import annotations

import torch

from .formats import format_of, get_format
from .ops import FaultResult, apply_fault
from .patterns import ChannelDim, resolve_indices, sample_bit_errors
from .spec import FaultSpec

__all__ = ["apply_spec"]


def apply_spec(
    spec: FaultSpec,
    tensor: torch.Tensor,
    generator: torch.Generator,
    *,
    channel_dim: ChannelDim = None,
    step: int | None = None,
) -> FaultResult:
    """Apply ``spec``'s fault to ``tensor`` in place and return what changed.

    Resolves the spec's pattern on the tensor's shape (``channel_dim``: see
    :func:`.patterns.resolve_indices`; only ``mac_cell`` uses it, and ``step`` too when it
    swizzles its channels), checks ``bits``
    against the format the fault lives in (``spec.format`` or the tensor's dtype) and
    calls :func:`.ops.apply_fault`. ``generator`` is normally
    :func:`.schedule.fault_generator` for the event. Does not decide whether the fault
    fires: that is :func:`.schedule.fires`.
    """
    fmt = format_of(tensor.dtype) if spec.format is None else get_format(spec.format)
    if spec.pattern.kind == "tensor":
        index, masks = sample_bit_errors(
            spec.pattern.ber, tensor.numel(), fmt, generator, bits=spec.bits
        )
        return apply_fault(tensor, index, spec.model, masks, fmt=fmt, generator=generator)
    index = resolve_indices(spec.pattern, tensor.shape, generator, channel_dim=channel_dim, step=step)
    return apply_fault(tensor, index, spec.model, spec.bits, fmt=fmt, generator=generator)
