"""Spatial patterns: from a :class:`~.spec.Pattern` to the flat indices it hits.

Indices are flat, row-major indices into a tensor's logical shape (``tensor.view(-1)``
order for a contiguous tensor). All index sets are built with ``arange`` arithmetic and
broadcasting -- their size is the number of selected elements, never ``numel`` -- and
random choices are drawn from the given ``torch.Generator`` only.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

from .formats import Format, check_bits, resolve_format
from .shapes import Pattern
from .vocab import ALL, RANDOM

__all__ = ["resolve_indices", "sample_bit_errors", "swizzle_permutation", "SWIZZLE_ROLES"]

SWIZZLE_ROLES = ("input", "output")
"""The two channel axes a swizzle permutes independently."""

ChannelDim = int | tuple[int | None, int | None] | None


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


def _pick(what: str, value: int | str, n: int, shape: tuple[int, ...], gen: torch.Generator) -> int:
    """``value`` checked to lie in ``0..n-1``, or a uniform draw from that range."""
    if value == RANDOM:
        return int(torch.randint(n, (1,), generator=gen))
    if not value < n:
        raise ValueError(
            f"pattern {what} {value} is out of range for a tensor of shape {list(shape)}; allowed: 0..{n - 1}"
        )
    return int(value)


def _block(shape: Sequence[int], fixed: dict[int, int]) -> torch.Tensor:
    """Sorted flat indices of all elements whose index along dim ``d`` is ``fixed[d]``."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offset = sum(fixed[d] * strides[d] for d in fixed)
    free = [d for d in range(len(shape)) if d not in fixed]
    out = torch.tensor(offset, dtype=torch.long)
    for k, d in enumerate(free):
        axis = torch.arange(shape[d], dtype=torch.long) * strides[d]
        out = out.unsqueeze(-1) + axis.view(*([1] * k), -1)
    return out.reshape(-1)


def _grid(shape: Sequence[int], chosen: dict[int, torch.Tensor]) -> torch.Tensor:
    """Sorted flat indices of all elements whose index along dim ``d`` lies in ``chosen[d]``
    (a sorted 1-D tensor of distinct indices); unconstrained dims take every index."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    out = torch.zeros((), dtype=torch.long)
    for d in range(len(shape)):
        axis = chosen[d] if d in chosen else torch.arange(shape[d], dtype=torch.long)
        out = out.unsqueeze(-1) + (axis * strides[d]).view(*([1] * d), -1)
    return out.reshape(-1)


def swizzle_permutation(n: int, seed: int, step: int, role: str) -> torch.Tensor:
    """The channel-to-lane map of a swizzled MAC array at ``step``: ``perm[c]`` is the physical
    lane that logical channel ``c`` (of ``n``) runs on. A uniform random permutation drawn from
    a generator keyed by a stable hash of (``seed``, ``step``, ``role``, ``n``) -- the same on
    every run and platform; ``role`` (``"input"`` or ``"output"``) makes the input- and
    output-channel maps independent."""
    if role not in SWIZZLE_ROLES:
        raise ValueError(f"unknown swizzle role {role!r}; allowed: {list(SWIZZLE_ROLES)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"swizzle channel count must be an int >= 1, got {n!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"swizzle step must be an int >= 0, got {step!r}")
    data = json.dumps(["swizzle", seed, step, role, n], separators=(",", ":")).encode()
    key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
    return torch.randperm(n, generator=torch.Generator().manual_seed(key))


def _mac_cell(
    pattern: Pattern, shape: tuple[int, ...], generator: torch.Generator, channel_dim: ChannelDim, step: int | None
) -> torch.Tensor:
    """Index set of a ``mac_cell`` pattern (see :func:`resolve_indices`)."""
    out_dim, in_dim = _channel_dims(channel_dim, shape)
    axes = ((out_dim, "output_channel", "output", 1), (in_dim, "input_channel", "input", 0))
    lanes: dict[int, torch.Tensor] = {}
    if pattern.array is None:  # one cell per channel pair: the lane is the channel
        for dim, what, _, _ in axes:
            if dim is not None:
                c = _pick(what, getattr(pattern, what), shape[dim], shape, generator)
                lanes[dim] = torch.tensor([c], dtype=torch.long)
    else:  # cell (a, b) of an R x C array serves every lane congruent to it
        cell = {
            what: (
                int(torch.randint(pattern.array[axis], (1,), generator=generator))
                if getattr(pattern, what) == RANDOM
                else int(getattr(pattern, what))
            )
            for _, what, _, axis in axes
        }
        for dim, what, _, axis in axes:
            if dim is not None:
                start = min(cell[what], shape[dim])  # a cell past the last channel is idle
                lanes[dim] = torch.arange(start, shape[dim], pattern.array[axis], dtype=torch.long)
    if pattern.swizzled:
        if step is None:
            raise ValueError(
                "pattern swizzle 'per_step' re-maps the channels every step: resolve_indices needs step= (an int >= 0)"
            )
        for dim, _, role, _ in axes:
            if dim is not None:
                perm = swizzle_permutation(shape[dim], pattern.swizzle_seed, step, role)
                lanes[dim] = torch.isin(perm, lanes[dim]).nonzero().flatten()
    if any(v.numel() == 0 for v in lanes.values()):
        return _empty()  # the cell's row or column is idle on this GEMM
    return _grid(shape, lanes)


def _channel_dims(channel_dim: ChannelDim, shape: tuple[int, ...]) -> tuple[int | None, int | None]:
    ndim = len(shape)
    if channel_dim is None:
        if ndim < 2:
            raise ValueError(
                f"pattern 'mac_cell' on a weight needs a tensor with >= 2 dims "
                f"(out channels, in channels, ...), got shape {list(shape)}"
            )
        return 0, 1
    dims = (channel_dim, None) if isinstance(channel_dim, int) else tuple(channel_dim)
    out: list[int | None] = []
    for d in dims:
        if d is not None and not -ndim <= d < ndim:
            raise ValueError(f"channel dim {d} is out of range for shape {list(shape)}; allowed: {-ndim}..{ndim - 1}")
        out.append(None if d is None else d % ndim)
    if out[0] is not None and out[0] == out[1]:
        raise ValueError(f"output and input channel dims must differ, got {channel_dim!r}")
    return out[0], out[1]


def resolve_indices(
    pattern: Pattern,
    shape: Sequence[int],
    generator: torch.Generator,
    *,
    channel_dim: ChannelDim = None,
    step: int | None = None,
) -> torch.Tensor:
    """Sorted, distinct flat indices (CPU int64) that ``pattern`` hits in a tensor of ``shape``.

    Rows and columns refer to the 2-D view ``[prod(shape[:-1]), shape[-1]]``. A ``pe``
    pattern selects output elements (i, j) with ``i % R == r`` and ``j % C == c``; it is
    empty when the tensor is smaller than the PE's offset (that PE is idle).

    ``mac_cell`` (software model of an NVDLA-style MAC cell a x b: it computes every
    product that involves weight[b, a], i.e. input channel a and output channel b) selects
    the elements whose index along the *output-channel dim* is b and along the
    *input-channel dim* is a; a dim given as ``None`` is not constrained. ``channel_dim``
    says which dims those are:

    - ``None`` (default): a weight-shaped tensor ``[out, in, ...]`` -- weight, param_grad,
      optimizer state, gemm.grad_weight: selects ``weight[b, a, ...]``.
    - an int ``d``: an output tensor whose dim ``d`` holds output channels (``1`` for a
      conv output [N, C_out, H, W], ``-1`` for a linear output [..., out]) -- gemm.forward,
      activation: selects every element of output channel b.
    - a pair ``(out_dim, in_dim)``: general form; e.g. ``(None, -1)`` for a linear's
      gemm.grad_input dX = dY W [..., in], where the cell corrupts input channel a.

    With ``array`` [R, C] (the MAC array: R input-channel rows, C output-channel columns) the
    channels of a GEMM are folded onto the array: channel c runs on lane c, lane c uses row
    ``c mod R`` (input) or column ``c mod C`` (output), so cell (a, b) serves every channel
    pair (i, o) with ``i % R == a`` and ``o % C == b``. A random cell is drawn inside the
    array (output column first, then input row); a cell whose row or column no channel of
    this GEMM reaches (``a >= in_channels``) is idle: no indices.

    With ``swizzle: per_step`` logical channel c runs on lane ``perm_t[c]`` at ``step`` t
    (:func:`swizzle_permutation` of the pattern's ``swizzle_seed``, one permutation per
    axis), so the channels that meet the faulty cell are ``{c : perm_t[c] in lanes}``;
    ``step`` is then required. Swizzling moves the faulty products, it never adds any.

    ``strided`` selects flat elements ``start + i * stride``; ``warp`` the flat elements
    ``w * warp_size + lane`` for its lanes and warps w (``warp``, ``warp + stride``, ...): the
    addresses a faulty SIMT lane, or a warp-aligned periodic corruption, touches when thread t of a
    kernel writes flat element t. Lanes past the end of a partial last warp select nothing.

    The ``tensor`` pattern selects bits, not elements: use :func:`sample_bit_errors`.
    An empty tensor yields no indices.
    """
    shape = tuple(int(s) for s in shape)
    kind = pattern.kind
    if kind == "tensor":
        raise ValueError("pattern kind 'tensor' selects bits, not elements; use sample_bit_errors")
    numel = math.prod(shape)
    if numel == 0:
        return _empty()
    rows, cols = math.prod(shape[:-1]), (shape[-1] if shape else 1)
    if kind == "element":
        if isinstance(pattern.index, tuple):
            if len(pattern.index) != len(shape):
                raise ValueError(
                    f"pattern index {list(pattern.index)} has {len(pattern.index)} dims, "
                    f"the tensor has shape {list(shape)}"
                )
            fixed = {d: _pick(f"index[{d}]", i, shape[d], shape, generator) for d, i in enumerate(pattern.index)}
            return _block(shape, fixed)
        flat = _pick("index", pattern.index, numel, shape, generator)
        return torch.tensor([flat], dtype=torch.long)
    if kind == "burst":
        k = pattern.length
        if k > numel:
            raise ValueError(f"pattern burst length {k} exceeds the {numel} elements of shape {list(shape)}")
        start = _pick("burst start", pattern.start, numel - k + 1, shape, generator)
        return torch.arange(start, start + k, dtype=torch.long)
    if kind in ("row", "column"):
        dim = 0 if kind == "row" else 1
        fixed = {dim: _pick(f"{kind} index", pattern.index, (rows, cols)[dim], shape, generator)}
        return _block((rows, cols), fixed)
    if kind == "pe":
        n_r, n_c = pattern.array
        if pattern.pe == RANDOM:
            r, c = (_pick("pe", RANDOM, n, shape, generator) for n in (n_r, n_c))
        else:
            r, c = pattern.pe
        if r >= rows or c >= cols:
            return _empty()
        i = torch.arange(r, rows, n_r, dtype=torch.long)
        j = torch.arange(c, cols, n_c, dtype=torch.long)
        return (i.unsqueeze(1) * cols + j.unsqueeze(0)).reshape(-1)
    if kind == "strided":
        return _strided(pattern, numel, shape, generator)
    if kind == "warp":
        return _warp(pattern, numel, shape, generator)
    assert kind == "mac_cell", kind
    return _mac_cell(pattern, shape, generator, channel_dim, step)


def _periodic(what: str, n: int, stride: int, count: int | None, start: int | str, shape, gen) -> torch.Tensor:
    """``start, start + stride, ...`` below ``n`` (or ``count`` of them, which must fit). A random
    ``start`` is drawn in the first period (with ``count``: wherever the whole run fits)."""
    if count is None:
        first = _pick(what, start, n if start != RANDOM else min(stride, n), shape, gen)
        return torch.arange(first, n, stride, dtype=torch.long)
    span = stride * (count - 1) + 1
    if span > n:
        raise ValueError(
            f"pattern count {count} with stride {stride} spans {span} {what.split()[0]}s, more than the {n} of a "
            f"tensor of shape {list(shape)}; allowed: count <= {(n - 1) // stride + 1}"
        )
    first = _pick(what, start, n - span + 1, shape, gen)
    return torch.arange(first, first + span, stride, dtype=torch.long)


def _strided(pattern: Pattern, numel: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every ``stride``-th flat element from ``start`` (see :func:`resolve_indices`)."""
    return _periodic("element start", numel, pattern.stride, pattern.count, pattern.start, shape, gen)


def _warp(pattern: Pattern, numel: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """The chosen lanes of the chosen warps (see :func:`resolve_indices`)."""
    size = pattern.warp_size
    warps = -(-numel // size)  # the last one may be partial
    count = 1 if pattern.stride is None and pattern.count is None else pattern.count
    chosen = _periodic("warp index", warps, pattern.stride or 1, count, pattern.warp, shape, gen)
    if pattern.lanes == ALL:
        lanes = torch.arange(size, dtype=torch.long)
    elif pattern.lanes == RANDOM:
        lanes = torch.randint(size, (1,), generator=gen)
    else:
        lanes = torch.tensor(pattern.lanes, dtype=torch.long)
    flat = (chosen.unsqueeze(1) * size + lanes.unsqueeze(0)).reshape(-1)
    return flat[flat < numel]  # lanes past the end of a partial last warp run no thread


def _distinct(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers drawn uniformly from ``0..n-1``, sorted."""
    if 4 * k >= n:
        return torch.randperm(n, generator=gen)[:k].sort().values
    chosen = _empty()
    while chosen.numel() < k:
        draw = torch.randint(n, (k - chosen.numel(),), generator=gen)
        chosen = torch.unique(torch.cat([chosen, draw]))
    return chosen


def sample_bit_errors(
    ber: float,
    numel: int,
    fmt: Format | str | torch.dtype,
    generator: torch.Generator,
    bits: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent bit errors at rate ``ber`` over ``numel`` elements of format ``fmt``.

    Every candidate bit (``bits``, default all bits of ``fmt``) of every element is hit
    independently with probability ``ber``. Sampled without a per-bit draw: the number of
    hits is drawn from Binomial(numel * len(bits), ber), then that many distinct (element,
    bit) positions uniformly. Returns ``(index, masks)``: the sorted flat indices of the
    elements with at least one hit and, for each, the mask of its hit bits in
    ``fmt.int_dtype`` -- ready for ``apply_fault(tensor, index, model, masks)``.
    """
    fmt = resolve_format(fmt)
    candidates = torch.tensor(range(fmt.width) if bits is None else check_bits(bits, fmt), dtype=torch.long)
    total = numel * candidates.numel()
    if not 0 < ber <= 1:
        raise ValueError(f"ber must be in (0, 1], got {ber!r}")
    if total == 0:
        return _empty(), torch.empty(0, dtype=fmt.int_dtype)
    k = int(
        torch.binomial(
            torch.tensor([float(total)], dtype=torch.float64),
            torch.tensor([float(ber)], dtype=torch.float64),
            generator=generator,
        ).item()
    )
    positions = _distinct(total, k, generator)
    element = positions // candidates.numel()
    weight = torch.ones_like(positions) << candidates[positions % candidates.numel()]
    index, inverse = torch.unique_consecutive(element, return_inverse=True)
    masks = torch.zeros(index.numel(), dtype=torch.long).index_add_(0, inverse, weight)
    if fmt.width < 64:  # as the signed word (int64 masks already wrap)
        sign = 1 << (fmt.width - 1)
        masks = torch.where(masks >= sign, masks - 2 * sign, masks)
    return index, masks.to(fmt.int_dtype)
