"""Stored number formats and their bit layouts.

A fault's bit positions refer to the *stored* format of a value: bit 0 is the least
significant bit of the integer word that holds the value, bit ``width - 1`` the most
significant one (the sign for floats).  Every format is manipulated through a same-width
*signed* integer view (``tensor.view(fmt.int_dtype)``), which torch supports for bitwise
ops on CPU and GPU and for every layout (a same-size dtype view keeps shape and strides).

=============  =====  ======  ======  =========  =========
name           width  int     sign    exponent   mantissa
=============  =====  ======  ======  =========  =========
fp32           32     int32   31      30..23     22..0
fp16           16     int16   15      14..10     9..0
bf16           16     int16   15      14..7      6..0
fp8_e4m3fn     8      int8    7       6..3       2..0
fp8_e5m2       8      int8    7       6..2       1..0
int8           8      int8    --      --         --
int32          32     int32   --      --         --
=============  =====  ======  ======  =========  =========
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "get_format", "format_of", "resolve_format", "fault_format", "check_bits"]


@dataclass(frozen=True)
class Format:
    """One stored format.

    ``sign``, ``exponent`` and ``mantissa`` are the bit positions of each field as
    ``range`` objects (``30 in FORMATS["fp32"].exponent``); they are ``None`` for integer
    formats, whose bits are plain two's-complement bits.
    """

    name: str
    dtype: torch.dtype
    width: int
    int_dtype: torch.dtype
    sign: range | None = None
    exponent: range | None = None
    mantissa: range | None = None

    @property
    def is_float(self) -> bool:
        """Whether the format is a floating-point format."""
        return self.exponent is not None

    def mask(self, bits: Iterable[int]) -> int:
        """The signed integer whose set bits are ``bits``, in this format's int view range.

        The top bit is the negative value ``-2**(width-1)``, so the mask fits
        ``int_dtype`` (bit 31 of int32 is ``-2**31``, not ``2**31``).
        """
        value = 0
        for bit in check_bits(bits, self):
            value |= 1 << bit
        return value - (1 << self.width) if value >= 1 << (self.width - 1) else value


def _float(name: str, dtype: torch.dtype, int_dtype: torch.dtype, exp: int, man: int) -> Format:
    width = 1 + exp + man
    return Format(
        name,
        dtype,
        width,
        int_dtype,
        sign=range(width - 1, width),
        exponent=range(man, man + exp),
        mantissa=range(0, man),
    )


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _float("fp64", torch.float64, torch.int64, 11, 52),
        _float("fp32", torch.float32, torch.int32, 8, 23),
        _float("fp16", torch.float16, torch.int16, 5, 10),
        _float("bf16", torch.bfloat16, torch.int16, 8, 7),
        _float("fp8_e4m3fn", torch.float8_e4m3fn, torch.int8, 4, 3),
        _float("fp8_e5m2", torch.float8_e5m2, torch.int8, 5, 2),
        Format("int8", torch.int8, 8, torch.int8),
        Format("int32", torch.int32, 32, torch.int32),
    )
}

_BY_DTYPE: dict[torch.dtype, Format] = {f.dtype: f for f in FORMATS.values()}


def get_format(name: str) -> Format:
    """The format called ``name`` (one of :data:`FORMATS`)."""
    if not isinstance(name, str):
        raise TypeError(f"format name must be a str, got {name!r}; allowed: {sorted(FORMATS)}")
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; allowed: {sorted(FORMATS)}") from None


def format_of(dtype: torch.dtype) -> Format:
    """The stored format of tensors with ``dtype``."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        allowed = ", ".join(str(d) for d in _BY_DTYPE)
        raise ValueError(f"unsupported dtype {dtype}; supported: {allowed}") from None


def resolve_format(fmt: Format | str | torch.dtype) -> Format:
    """A :class:`Format` from a format, a format name or a torch dtype."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        return format_of(fmt)
    return get_format(fmt)


def fault_format(dtype: torch.dtype, fmt: Format | str | None = None) -> Format:
    """The format a fault on a ``dtype`` tensor lives in: ``fmt``, or the dtype's own for ``None``.

    Another format than the tensor's own needs both to be float formats (the selected values are
    rounded into ``fmt``); integer formats are only faulted in their own dtype.
    """
    stored = format_of(dtype)
    compute = stored if fmt is None else resolve_format(fmt)
    if compute != stored and not (compute.is_float and stored.is_float):
        raise ValueError(
            f"a fault in format {compute.name} on a {stored.name} tensor needs two float "
            f"formats; integer formats are only faulted in their own dtype (allowed here: "
            f"{stored.name}{' or another float format' if stored.is_float else ''})"
        )
    return compute


def check_bits(bits: Iterable[int], fmt: Format | str | torch.dtype) -> tuple[int, ...]:
    """Validate bit positions for ``fmt`` and return them as a tuple.

    Raises ``TypeError`` for a non-integer bit and ``ValueError`` for a bit outside
    ``0..width-1`` or a repeated bit (flipping a bit twice would cancel silently).
    """
    fmt = resolve_format(fmt)
    out = tuple(bits)
    for bit in out:
        if isinstance(bit, bool) or not isinstance(bit, int):
            raise TypeError(f"bit positions must be ints, got {bit!r}")
        if not 0 <= bit < fmt.width:
            raise ValueError(f"bit {bit} is out of range for {fmt.name}; allowed: 0..{fmt.width - 1}")
    if len(set(out)) != len(out):
        raise ValueError(f"bit positions must be distinct, got {list(out)}")
    return out
