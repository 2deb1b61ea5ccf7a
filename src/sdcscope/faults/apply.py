"""Apply a whole :class:`~.spec.FaultSpec` to one tensor (pattern, format, model), or check
beforehand that it fits a tensor of a given dtype and shape."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import Format, check_bits, fault_format
from .ops import FaultResult, apply_fault, burst_masks, check_burst
from .patterns import ChannelDim, resolve_indices, sample_bit_errors
from .spec import FaultSpec, FaultSpecError
from .tokens import apply_token_fault
from .vocab import TOKEN_MODELS

__all__ = ["apply_spec", "check_spec"]


def _locate(
    spec: FaultSpec,
    dtype: torch.dtype,
    shape: Sequence[int] | None,
    generator: torch.Generator,
    channel_dim: ChannelDim,
    step: int | None,
) -> tuple[Format, torch.Tensor | None]:
    """The format the fault lives in and the flat indices its pattern hits (``None`` for the
    ``tensor`` pattern, which picks bits, or when ``shape`` is unknown). Every way the spec can
    fail to fit the tensor raises :class:`FaultSpecError`."""
    try:
        fmt = fault_format(dtype, spec.format)
        if spec.burst_bits is not None:
            check_burst(spec.burst_bits, fmt, spec.bits)
        elif spec.bits is not None:
            check_bits(spec.bits, fmt)
        if shape is None or spec.pattern.kind == "tensor":
            return fmt, None
        return fmt, resolve_indices(spec.pattern, shape, generator, channel_dim=channel_dim, step=step)
    except (TypeError, ValueError) as exc:
        raise FaultSpecError(str(exc)) from None


def check_spec(
    spec: FaultSpec, dtype: torch.dtype, shape: Sequence[int] | None = None, *, channel_dim: ChannelDim = None
) -> int | None:
    """Raise :class:`FaultSpecError` when ``spec`` cannot be applied to a tensor of ``dtype``
    (and ``shape``, when known): the checks :func:`apply_spec` makes, without a tensor. The
    pattern's fixed locations are checked against ``shape``; ``"random"`` ones always fit.
    Returns how many elements the pattern selects in ``shape`` (for ``"random"`` fields: in one
    draw), ``None`` when not known (no ``shape``, or the ``tensor`` pattern)."""
    _, index = _locate(spec, dtype, shape, torch.Generator(), channel_dim, step=0)
    return None if index is None else int(index.numel())


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
    swizzles its channels), draws each element's burst of ``burst_bits`` adjacent bits
    (:func:`.ops.burst_masks`, after the indices, from the same generator), checks ``bits``
    against the format the fault lives in (``spec.format`` or the tensor's dtype) and
    calls :func:`.ops.apply_fault`; a spec that does not fit the tensor raises
    :class:`FaultSpecError` before any value changes. ``generator`` is normally
    :func:`.schedule.fault_generator` for the event. Does not decide whether the fault
    fires: that is :func:`.schedule.fires`.
    """
    fmt, index = _locate(spec, tensor.dtype, tensor.shape, generator, channel_dim, step)
    if spec.model in TOKEN_MODELS:  # a whole slot of a dispatch: its row (the pattern's)
        try:
            return apply_token_fault(tensor, index, spec.model)
        except ValueError as exc:
            raise FaultSpecError(str(exc)) from None
    if index is None:  # the tensor pattern: independent bit errors
        index, masks = sample_bit_errors(spec.pattern.ber, tensor.numel(), fmt, generator, bits=spec.bits)
        return apply_fault(tensor, index, spec.model, masks, fmt=fmt, generator=generator)
    bits = spec.bits
    if spec.burst_bits is not None:  # a burst of adjacent bits per element, drawn after the indices
        bits = burst_masks(index.numel(), spec.burst_bits, fmt, generator, spec.bits)
    return apply_fault(tensor, index, spec.model, bits, fmt=fmt, generator=generator)
