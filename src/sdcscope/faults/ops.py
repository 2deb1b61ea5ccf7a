"""Bit-exact fault operations on tensors.

Every operation works on the integer view of the stored format (see :mod:`.formats`):
a flip is an XOR, stuck-at-0 an AND-NOT and stuck-at-1 an OR with a bit mask, so the
result is exactly the stored word with those bits changed -- nothing is rounded, clamped
or canonicalised, and NaN/Inf results are kept as they come out.

``bits`` is either a sequence of bit positions, applied to every selected element, or an
integer tensor of per-element masks in the format's ``int_dtype`` (one mask per selected
element, as :func:`.patterns.sample_bit_errors` returns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

from .formats import Format, check_bits, fault_format, format_of

__all__ = [
    "MODELS",
    "BIT_MODELS",
    "Bits",
    "FaultResult",
    "bitflip",
    "stuck_at",
    "random_value",
    "zero",
    "apply_fault",
    "burst_masks",
    "check_burst",
]

MODELS: tuple[str, ...] = ("bitflip", "stuck_at_0", "stuck_at_1", "random_value", "zero")
"""Fault models, by name."""

BIT_MODELS: tuple[str, ...] = ("bitflip", "stuck_at_0", "stuck_at_1")
"""The fault models that act on chosen bit positions (and need ``bits``)."""

Bits = Union[Sequence[int], torch.Tensor]


def _mask(bits: Bits, fmt: Format, device: torch.device) -> torch.Tensor:
    """``bits`` as an integer mask tensor of ``fmt.int_dtype`` on ``device``."""
    if isinstance(bits, torch.Tensor):
        if bits.dtype != fmt.int_dtype:
            raise TypeError(f"a mask tensor for {fmt.name} must have dtype {fmt.int_dtype}, got {bits.dtype}")
        return bits.to(device)
    if len(bits) == 0:
        raise ValueError(f"no bit positions given; allowed: 0..{fmt.width - 1} for {fmt.name}")
    return torch.tensor(fmt.mask(bits), dtype=fmt.int_dtype, device=device)


def check_burst(width: int, fmt: Format, bits: Sequence[int] | None = None) -> tuple[int, int]:
    """``(lowest, highest)`` bit a burst of ``width`` adjacent bits may start at inside ``bits`` (a
    contiguous range of positions in ``fmt``; default the whole word). Raises ``ValueError`` for a
    burst wider than the range, or ``bits`` that are not contiguous."""
    span = tuple(range(fmt.width)) if bits is None else tuple(sorted(check_bits(bits, fmt)))
    if span != tuple(range(span[0], span[-1] + 1)):
        raise ValueError(
            f"bits {list(bits)} must be a contiguous range for burst_bits (the burst's adjacent bits lie in it)"
        )
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= len(span):
        where = f"bits {span[0]}..{span[-1]}" if bits is not None else f"the {fmt.width}-bit {fmt.name} word"
        raise ValueError(f"burst_bits {width!r} does not fit {where}; allowed: 1..{len(span)}")
    return span[0], span[-1] - width + 1


def burst_masks(
    n: int, width: int, fmt: Format, generator: torch.Generator, bits: Sequence[int] | None = None
) -> torch.Tensor:
    """``n`` masks (``fmt.int_dtype``) of ``width`` adjacent bits each: a multi-bit burst within a
    word, its lowest bit drawn uniformly (from ``generator``) for each element so that the burst
    lies inside ``bits`` (:func:`check_burst`)."""
    first, last = check_burst(width, fmt, bits)
    low = first + torch.randint(last - first + 1, (n,), generator=generator)
    run = low.unsqueeze(1) + torch.arange(width, dtype=torch.long)
    masks = (torch.ones_like(run) << run).sum(1)  # distinct bits: the sum is their OR (int64 wraps)
    if fmt.width < 64:  # as the signed word
        sign = 1 << (fmt.width - 1)
        masks = torch.where(masks >= sign, masks - 2 * sign, masks)
    return masks.to(fmt.int_dtype)


def bitflip(values: torch.Tensor, bits: Bits) -> torch.Tensor:
    """``values`` with ``bits`` inverted (XOR), as a new tensor of the same dtype."""
    fmt = format_of(values.dtype)
    ints = values.view(fmt.int_dtype)
    return (ints ^ _mask(bits, fmt, values.device)).view(values.dtype)


def stuck_at(values: torch.Tensor, bits: Bits, level: int) -> torch.Tensor:
    """``values`` with ``bits`` forced to ``level`` (0: AND-NOT, 1: OR), as a new tensor."""
    if level not in (0, 1):
        raise ValueError(f"stuck-at level must be 0 or 1, got {level!r}")
    fmt = format_of(values.dtype)
    ints = values.view(fmt.int_dtype)
    mask = _mask(bits, fmt, values.device)
    out = ints | mask if level else ints & ~mask
    return out.view(values.dtype)


def random_value(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random bit pattern of the format for every element of ``values``.

    This is what a corrupted register or memory word holds, so for floats the result may
    be NaN or +-Inf (about 0.4 % of fp32 patterns, 3 % of fp16 and 0.8 % of fp8_e4m3fn). The
    draw uses ``generator`` (a CPU generator) only, never torch's global RNG.
    """
    fmt = format_of(values.dtype)
    if fmt.width == 64:  # randint's bounds are int64 themselves: two 32-bit halves
        hi = torch.randint(-(1 << 31), 1 << 31, values.shape, generator=generator, dtype=torch.int64)
        ints = (hi << 32) | torch.randint(0, 1 << 32, values.shape, generator=generator, dtype=torch.int64)
    else:
        half = 1 << (fmt.width - 1)
        ints = torch.randint(-half, half, values.shape, generator=generator, dtype=torch.int64)
    return ints.to(fmt.int_dtype).to(values.device).view(values.dtype)


def zero(values: torch.Tensor) -> torch.Tensor:
    """All-zero bit patterns (``+0.0`` for floats) shaped like ``values``."""
    return torch.zeros_like(values)


@dataclass(frozen=True)
class FaultResult:
    """What :func:`apply_fault` changed.

    ``index`` holds flat (row-major, logical) indices; ``before`` and ``after`` the
    element values in the tensor's own dtype and on its device.
    """

    index: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor

    def to_dict(self) -> dict[str, list]:
        """Index, before and after as Python lists (floats for float formats)."""

        def values(t: torch.Tensor) -> list:
            return (t if not t.is_floating_point() else t.double()).tolist()  # exact for fp64 too

        return {
            "index": self.index.tolist(),
            "before": values(self.before),
            "after": values(self.after),
        }


def _faulty(values: torch.Tensor, model: str, bits: Bits | None, generator: torch.Generator | None) -> torch.Tensor:
    if model in BIT_MODELS:
        if bits is None:
            raise ValueError(f"model {model!r} needs bit positions")
        if model == "bitflip":
            return bitflip(values, bits)
        return stuck_at(values, bits, int(model[-1]))
    if bits is not None and (isinstance(bits, torch.Tensor) or len(bits) > 0):
        raise ValueError(f"model {model!r} takes no bit positions; bits are for {list(BIT_MODELS)}")
    if model == "random_value":
        if generator is None:
            raise ValueError("model 'random_value' needs a torch.Generator")
        return random_value(values, generator)
    if model == "zero":
        return zero(values)
    raise ValueError(f"unknown fault model {model!r}; allowed: {list(MODELS)}")


def apply_fault(
    tensor: torch.Tensor,
    index: torch.Tensor,
    model: str,
    bits: Bits | None = None,
    *,
    fmt: Format | str | None = None,
    generator: torch.Generator | None = None,
) -> FaultResult:
    """Apply fault ``model`` in place to the elements of ``tensor`` at flat ``index``.

    ``index`` is a 1-D integer tensor of distinct flat indices into the tensor's logical
    (row-major) shape, whatever its strides; contiguous and non-contiguous tensors are
    both modified in place, through their integer view, under ``torch.no_grad``.

    ``fmt`` names the format the fault lives in when it differs from the tensor's own
    (``None``: the tensor's dtype). Example: a flip in the bf16 compute copy of an fp32
    master weight. The selected elements are then first converted (rounded, with torch's
    conversion) to ``fmt`` -- that rounding is part of the fault model -- the fault is
    applied to the ``fmt`` bits, and the result is converted back, which is exact when the
    tensor's format is the wider one. Both formats must then be float formats.

    ``bits`` are checked against the format the fault lives in; ``generator`` is needed
    by ``random_value``. Returns the indices with the values before and after.
    """
    stored = format_of(tensor.dtype)
    compute = fault_format(tensor.dtype, fmt)
    if bits is not None and not isinstance(bits, torch.Tensor):
        bits = check_bits(bits, compute)
    if index.dtype != torch.long or index.dim() != 1:
        raise TypeError(f"index must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}")
    numel = tensor.numel()
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= numel:
            raise ValueError(
                f"flat index {low if low < 0 else high} is out of range for a tensor of "
                f"shape {list(tensor.shape)}; allowed: 0..{numel - 1}"
            )
    with torch.no_grad():
        ints = tensor.view(stored.int_dtype)
        device_index = index.to(tensor.device)
        if ints.is_contiguous():
            target, key = ints.view(-1), (device_index,)
        else:
            target, key = ints, torch.unravel_index(device_index, ints.shape)
        before = target[key].view(tensor.dtype)
        work = before if compute == stored else before.to(compute.dtype)
        faulty = _faulty(work, model, bits, generator)
        after = faulty if compute == stored else faulty.to(tensor.dtype)
        target[key] = after.view(stored.int_dtype)
    return FaultResult(index, before, after)
