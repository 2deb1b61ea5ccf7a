"""Bit-exact fault ops, checked against an independent struct/pure-Python reference."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.faults import (
    FORMATS,
    apply_fault,
    bitflip,
    check_bits,
    format_of,
    get_format,
    random_value,
    sample_bit_errors,
    stuck_at,
    zero,
)

# ------------------------------------------------------------ independent reference


def _f64(p: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", p))[0]


def _f32(p: int) -> float:
    return struct.unpack("<f", struct.pack("<I", p))[0]


def _f16(p: int) -> float:
    return struct.unpack("<e", struct.pack("<H", p))[0]


def _bf16(p: int) -> float:
    return _f32(p << 16)  # bf16 is the top half of an fp32 word


def _minifloat(p: int, exp_bits: int, man_bits: int, ieee_special: bool) -> float:
    """Decode an fp8 pattern. ``ieee_special``: e5m2 (all-ones exponent = Inf/NaN);
    otherwise e4m3fn (no Inf, only S.1111.111 is NaN)."""
    sign = -1.0 if p >> (exp_bits + man_bits) else 1.0
    e = (p >> man_bits) & ((1 << exp_bits) - 1)
    m = p & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    top = (1 << exp_bits) - 1
    if ieee_special and e == top:
        return sign * math.inf if m == 0 else math.nan
    if not ieee_special and e == top and m == (1 << man_bits) - 1:
        return math.nan
    if e == 0:
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


# name -> (width, decoder from an unsigned pattern, sign, exponent bits, mantissa bits)
REFERENCE = {
    "fp64": (64, _f64, 63, 11, 52),
    "fp32": (32, _f32, 31, 8, 23),
    "fp16": (16, _f16, 15, 5, 10),
    "bf16": (16, _bf16, 15, 8, 7),
    "fp8_e4m3fn": (8, lambda p: _minifloat(p, 4, 3, False), 7, 4, 3),
    "fp8_e5m2": (8, lambda p: _minifloat(p, 5, 2, True), 7, 5, 2),
    "int8": (8, lambda p: p - 256 if p >= 128 else p, None, None, None),
    "int32": (32, lambda p: p - 2**32 if p >= 2**31 else p, None, None, None),
}
NAMES = sorted(REFERENCE)


def _tensor(patterns: list[int], name: str) -> torch.Tensor:
    """A tensor of format ``name`` holding the unsigned bit ``patterns``."""
    fmt = get_format(name)
    signed = [p - (1 << fmt.width) if p >= 1 << (fmt.width - 1) else p for p in patterns]
    return torch.tensor(signed, dtype=fmt.int_dtype).view(fmt.dtype)


def _patterns(t: torch.Tensor) -> list[int]:
    fmt = format_of(t.dtype)
    return [v % (1 << fmt.width) for v in t.view(fmt.int_dtype).tolist()]


def _same_value(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want))


def _values(t: torch.Tensor) -> list:
    return (t.double() if t.is_floating_point() else t).tolist()


def _case(name: str):
    width = REFERENCE[name][0]
    return st.lists(st.integers(0, (1 << width) - 1), min_size=1, max_size=40)


settings.register_profile("faults", max_examples=40, deadline=None)
settings.load_profile("faults")


# ------------------------------------------------------------------------ table


@pytest.mark.parametrize("name", NAMES)
def test_format_table_matches_reference_layout(name):
    width, _, sign, exp, man = REFERENCE[name]
    fmt = get_format(name)
    assert fmt.width == width
    if fmt.is_float:
        assert torch.finfo(fmt.dtype).bits == width
    assert torch.empty(0, dtype=fmt.dtype).element_size() * 8 == width
    assert torch.empty(0, dtype=fmt.int_dtype).element_size() * 8 == width
    assert format_of(fmt.dtype) is fmt
    if sign is None:
        assert fmt.sign is fmt.exponent is fmt.mantissa is None
    else:
        assert list(fmt.sign) == [sign]
        assert list(fmt.exponent) == list(range(man, man + exp))
        assert list(fmt.mantissa) == list(range(man))


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_torch_decoding_matches_reference(name, data):
    patterns = data.draw(_case(name))
    decode = REFERENCE[name][1]
    got = _values(_tensor(patterns, name))
    assert all(_same_value(g, decode(p)) for g, p in zip(got, patterns))


# --------------------------------------------------------------------- the ops


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_bitflip_every_bit_matches_reference(name, data):
    patterns = data.draw(_case(name))
    width, decode = REFERENCE[name][:2]
    t = _tensor(patterns, name)
    for bit in range(width):
        out = bitflip(t, [bit])
        want = [p ^ (1 << bit) for p in patterns]
        assert _patterns(out) == want
        assert all(_same_value(g, decode(w)) for g, w in zip(_values(out), want))


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_stuck_at_every_bit_matches_reference(name, data):
    patterns = data.draw(_case(name))
    width = REFERENCE[name][0]
    t = _tensor(patterns, name)
    for bit in range(width):
        assert _patterns(stuck_at(t, [bit], 1)) == [p | (1 << bit) for p in patterns]
        assert _patterns(stuck_at(t, [bit], 0)) == [p & ~(1 << bit) for p in patterns]


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_flip_twice_is_identity_and_stuck_at_idempotent(name, data):
    patterns = data.draw(_case(name))
    width = REFERENCE[name][0]
    bits = data.draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=width, unique=True))
    t = _tensor(patterns, name)
    assert _patterns(bitflip(bitflip(t, bits), bits)) == patterns  # also for NaN results
    for level in (0, 1):
        once = stuck_at(t, bits, level)
        assert _patterns(stuck_at(once, bits, level)) == _patterns(once)


@pytest.mark.parametrize("name", [n for n in NAMES if REFERENCE[n][2] is not None])
@given(data=st.data())
def test_sign_bit_negates(name, data):
    patterns = data.draw(_case(name))
    t = _tensor(patterns, name)
    before, after = _values(t), _values(bitflip(t, [REFERENCE[name][2]]))
    for b, a in zip(before, after):
        if not math.isnan(b):
            assert _same_value(a, -b)


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_apply_fault_in_place_on_non_contiguous(name, data):
    width = REFERENCE[name][0]
    patterns = data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=12, max_size=12))
    bits = data.draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=3, unique=True))
    index = torch.tensor(sorted(data.draw(st.sets(st.integers(0, 11), min_size=1))))
    base = _tensor(patterns, name).view(3, 4)
    strided = base.t()  # [4, 3], non-contiguous; flat index k is strided.reshape(-1)[k]
    want = strided.contiguous()
    apply_fault(want, index, "bitflip", bits)
    result = apply_fault(strided, index, "bitflip", bits)
    assert not strided.is_contiguous()
    assert _patterns(strided.reshape(-1)) == _patterns(want.reshape(-1))
    mask = sum(1 << b for b in bits)
    flat = _patterns(base.t().contiguous().reshape(-1))
    orig = _patterns(_tensor(patterns, name).view(3, 4).t().contiguous().reshape(-1))
    assert flat == [p ^ mask if k in index.tolist() else p for k, p in enumerate(orig)]
    assert _patterns(result.before) == [orig[k] for k in index.tolist()]
    assert _patterns(result.after) == [flat[k] for k in index.tolist()]


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=20), st.integers(0, 15))
def test_fault_in_bf16_compute_copy_of_fp32(values, bit):
    t = torch.tensor(values, dtype=torch.float32)
    rounded = t.to(torch.bfloat16)  # the fault model: the element lives in a bf16 copy
    want = [_bf16(p ^ (1 << bit)) for p in _patterns(rounded)]
    result = apply_fault(t, torch.arange(len(values)), "bitflip", [bit], fmt="bf16")
    assert all(_same_value(g, w) for g, w in zip(_values(t), want))  # exact back in fp32
    assert result.after.dtype == torch.float32
    assert _patterns(result.before) == _patterns(torch.tensor(values, dtype=torch.float32))


def test_sign_mask_of_32_bit_formats_is_signed():
    assert get_format("fp32").mask([31]) == -(2**31)
    assert get_format("int32").mask([31, 0]) == -(2**31) + 1
    assert get_format("int8").mask([7]) == -128
    t = torch.tensor([5], dtype=torch.int32)
    assert bitflip(t, [31]).item() == 5 - 2**31


@pytest.mark.parametrize("name", NAMES)
def test_random_value_uses_only_the_generator(name):
    fmt = get_format(name)
    t = torch.zeros(4000, dtype=fmt.dtype)
    state = torch.get_rng_state()
    a = random_value(t, torch.Generator().manual_seed(3))
    b = random_value(t, torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)
    assert _patterns(a) == _patterns(b)
    ints = a.view(fmt.int_dtype).long()  # sign-extended: (ints >> bit) & 1 is still bit `bit` of the word
    for bit in range(fmt.width):  # every bit of the word is random
        share = ((ints >> bit) & 1).float().mean().item()
        assert 0.4 < share < 0.6


def test_zero_gives_all_zero_bits():
    for fmt in FORMATS.values():
        t = torch.ones(3).to(fmt.dtype)
        assert _patterns(zero(t)) == [0, 0, 0]
        apply_fault(t, torch.tensor([1]), "zero")
        assert _patterns(t)[1] == 0


def test_mask_tensor_from_bit_errors():
    t = torch.randn(500)
    before = t.clone()
    index, masks = sample_bit_errors(0.05, t.numel(), "fp32", torch.Generator().manual_seed(0))
    apply_fault(t, index, "bitflip", masks)
    diff = t.view(torch.int32) ^ before.view(torch.int32)
    assert torch.equal(diff[index], masks)
    assert int((diff != 0).sum()) == index.numel()


def test_parameter_is_modified_in_place():
    w = torch.nn.Parameter(torch.ones(2, 3))
    apply_fault(w, torch.tensor([4]), "bitflip", [31])
    assert w.requires_grad and w[1, 1].item() == -1.0 and w.sum().item() == 4.0


def test_to_dict_gives_python_numbers():
    t = torch.tensor([1.0, 2.0], dtype=torch.float8_e4m3fn)
    record = apply_fault(t, torch.tensor([1]), "bitflip", [7]).to_dict()
    assert record == {"index": [1], "before": [2.0], "after": [-2.0]}


FIRST = torch.tensor([0])


@pytest.mark.parametrize(
    ("call", "exc", "needles"),
    [
        (lambda t: apply_fault(t, FIRST, "bitflip", [40]), ValueError, ["40", "0..31"]),
        (lambda t: apply_fault(t, FIRST, "bitflip", [16], fmt="bf16"), ValueError, ["16", "0..15"]),
        (lambda t: apply_fault(t, FIRST, "bitflip"), ValueError, ["bitflip", "bit"]),
        (lambda t: apply_fault(t, FIRST, "bitflip", []), ValueError, ["0..31"]),
        (lambda t: apply_fault(t, FIRST, "zero", [3]), ValueError, ["zero", "bitflip"]),
        (lambda t: apply_fault(t, FIRST, "random_value"), ValueError, ["Generator"]),
        (lambda t: apply_fault(t, FIRST, "flip", [1]), ValueError, ["'flip'", "bitflip"]),
        (lambda t: apply_fault(t, torch.tensor([6]), "zero"), ValueError, ["[2, 3]", "0..5"]),
        (lambda t: apply_fault(t, FIRST, "zero", fmt="int8"), ValueError, ["int8", "fp32"]),
        (lambda t: apply_fault(t, torch.tensor([0.0]), "zero"), TypeError, ["int64"]),
        (lambda t: get_format("float33"), ValueError, ["float33", "fp32", "bf16"]),
        (lambda t: format_of(torch.complex64), ValueError, ["complex64", "torch.float64", "torch.float32"]),
        (lambda t: check_bits([1, 1], "fp16"), ValueError, ["distinct"]),
        (lambda t: check_bits([1.0], "fp16"), TypeError, ["1.0"]),
    ],
)
def test_errors_name_value_and_allowed(call, exc, needles):
    t = torch.zeros(2, 3)
    with pytest.raises(exc) as info:
        call(t)
    for needle in needles:
        assert needle in str(info.value)
    assert torch.equal(t, torch.zeros(2, 3))


@pytest.mark.parametrize(("name", "good", "bad"), [("int8", 7, 8), ("fp32", 31, 32), ("fp8_e5m2", 7, 9)])
def test_check_bits_range(name, good, bad):
    assert check_bits(list(range(good + 1)), name) == tuple(range(good + 1))
    with pytest.raises(ValueError, match=rf"bit {bad} .*allowed: 0\.\.{good}"):
        check_bits([bad], name)
