"""Hardware-shaped faults: strided and warp-aligned element sets, multi-bit bursts within a word,
and a periodic schedule whose firings hit the same elements and bits -- against brute-force
references, with the validation errors naming the bad value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.faults import (
    FaultSpec,
    FaultSpecError,
    Pattern,
    apply_spec,
    check_spec,
    fault_generator,
    fires,
    get_format,
    load_specs,
    resolve_indices,
)
from sdcscope.faults.ops import burst_masks

SHAPES = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
WIDTHS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3fn": 8, "fp64": 64, "int8": 8}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def spec(**kw) -> FaultSpec:
    base = {"site": "weight", "target": "w", "model": "bitflip", "schedule": {"kind": "transient", "step": 0}}
    return FaultSpec.from_dict({**base, **kw})


@settings(max_examples=80, deadline=None)
@given(
    shape=SHAPES,
    stride=st.integers(1, 40),
    start=st.one_of(st.just("random"), st.integers(0, 40)),
    count=st.one_of(st.none(), st.integers(1, 8)),
    seed=st.integers(0, 2**31),
)
def test_strided_is_every_kth_element_from_its_start(shape, stride, start, count, seed):
    numel = int(np.prod(shape))
    pattern = Pattern(kind="strided", stride=stride, start=start, count=count)
    try:
        got = resolve_indices(pattern, shape, gen(seed)).tolist()
    except ValueError as exc:  # only a start or a span that does not fit, named with the shape
        span = 0 if count is None else stride * (count - 1)
        assert (start != "random" and start + span >= numel) or span >= numel, exc
        assert str(list(shape)) in str(exc)
        return
    first = got[0]
    want = [i for i in range(numel) if i >= first and (i - first) % stride == 0][: count or numel]
    assert got == want
    assert start == first if start != "random" else (first < stride if count is None else True)
    assert got == resolve_indices(pattern, shape, gen(seed)).tolist()  # a pure function of the generator


@settings(max_examples=80, deadline=None)
@given(
    numel=st.integers(1, 300),
    size=st.sampled_from([32, 64, 4]),
    lanes=st.one_of(
        st.just("random"), st.just("all"), st.lists(st.integers(0, 31), min_size=1, max_size=5, unique=True)
    ),
    warp=st.one_of(st.just("random"), st.integers(0, 9)),
    stride=st.one_of(st.none(), st.integers(1, 4)),
    count=st.one_of(st.none(), st.integers(1, 3)),
    seed=st.integers(0, 2**31),
)
def test_warp_is_lanes_of_warp_aligned_periodic_warps(numel, size, lanes, warp, stride, count, seed):
    if isinstance(lanes, list):
        lanes = list(dict.fromkeys(lane % size for lane in lanes))
    pattern = Pattern(kind="warp", lanes=lanes, warp=warp, stride=stride, count=count, warp_size=size)
    n_warps = -(-numel // size)
    try:
        got = resolve_indices(pattern, (numel,), gen(seed)).tolist()
    except ValueError as exc:
        n = 1 if stride is None and count is None else count
        span = 0 if n is None else (stride or 1) * (n - 1)
        assert (warp != "random" and warp + span >= n_warps) or span >= n_warps, exc
        return
    assert got == sorted(set(got))
    idx = np.arange(numel)
    hit_warps = sorted({i // size for i in got})
    hit_lanes = {i % size for i in got}
    if got:
        w0, step = hit_warps[0], stride or 1
        if warp != "random":
            assert w0 == warp
        n = (1 if stride is None else None) if count is None else count
        warps = [w for w in range(w0, n_warps, step)][:n]
        lane_set = set(range(size)) if lanes == "all" else set(lanes) if lanes != "random" else hit_lanes
        assert lanes != "random" or len(lane_set) == 1
        want = idx[np.isin(idx // size, warps) & np.isin(idx % size, sorted(lane_set))].tolist()
        assert got == want
    else:  # only lanes past the end of a partial last warp
        assert lanes != "all"


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(sorted(WIDTHS)),
    width=st.integers(1, 64),
    low=st.integers(0, 63),
    span=st.one_of(st.none(), st.integers(1, 64)),
    seed=st.integers(0, 2**31),
)
def test_burst_masks_are_adjacent_bits_inside_the_range(fmt, width, low, span, seed):
    f, bits_width = get_format(fmt), WIDTHS[fmt]
    bits = None if span is None else list(range(low % bits_width, min(low % bits_width + span, bits_width)))
    room = bits_width if bits is None else len(bits)
    if width > room:
        with pytest.raises(ValueError, match=f"burst_bits {width} does not fit.*allowed: 1..{room}"):
            burst_masks(3, width, f, gen(seed), bits)
        return
    masks = burst_masks(200, width, f, gen(seed), bits)
    assert masks.dtype == f.int_dtype and masks.shape == (200,)
    lo, hi = (0, bits_width - 1) if bits is None else (bits[0], bits[-1])
    starts = set()
    for m in masks.tolist():
        m %= 1 << bits_width  # the word's bits, unsigned
        set_bits = [b for b in range(bits_width) if m >> b & 1]
        assert set_bits == list(range(set_bits[0], set_bits[0] + width))  # adjacent
        assert lo <= set_bits[0] and set_bits[-1] <= hi
        starts.add(set_bits[0])
    assert starts <= set(range(lo, hi - width + 2))
    if hi - lo - width + 2 <= 4:  # every start position is drawn, given enough draws
        assert starts == set(range(lo, hi - width + 2))


def test_a_burst_flips_each_hit_element_in_its_own_run_of_adjacent_bits():
    s = spec(bits=list(range(23, 31)), burst_bits=3, pattern={"kind": "strided", "stride": 4, "start": 1})
    t = torch.randn(6, 8)
    before = t.clone()
    result = apply_spec(s, t, gen(3))
    assert result.index.tolist() == list(range(1, 48, 4))
    changed = (t.view(torch.int32) != before.view(torch.int32)).reshape(-1).nonzero().flatten()
    assert changed.tolist() == result.index.tolist()
    xor = (result.before.view(torch.int32) ^ result.after.view(torch.int32)).tolist()
    lows = set()
    for m in xor:
        low = (m & -m).bit_length() - 1
        assert m == 0b111 << low and 23 <= low <= 28  # three adjacent exponent bits
        lows.add(low)
    assert len(lows) > 1  # each element draws its own burst


def test_stuck_at_bursts_force_the_run():
    s = spec(model="stuck_at_1", burst_bits=4, format="bf16", pattern={"kind": "warp", "lanes": "all", "warp": 0})
    t = torch.zeros(40, dtype=torch.bfloat16)
    result = apply_spec(s, t, gen(0))
    assert result.index.tolist() == list(range(32))  # the whole first warp, not the partial second
    for m in t.view(torch.int16)[:32].tolist():
        m %= 1 << 16
        low = (m & -m).bit_length() - 1
        assert m == 0b1111 << low
    assert not t.view(torch.int16)[32:].any()


@pytest.mark.parametrize(
    "changes,error,needles",
    [
        ({"pattern": {"kind": "strided", "stride": 0}}, ValueError, ["stride", ">= 1", "got 0"]),
        ({"pattern": {"kind": "strided"}}, ValueError, ["needs 'stride'"]),
        ({"pattern": {"kind": "strided", "stride": 2, "count": 0}}, ValueError, ["count", "got 0"]),
        ({"pattern": {"kind": "warp", "lanes": [33]}}, ValueError, ["lanes [33]", "0..31"]),
        ({"pattern": {"kind": "warp", "lanes": [40], "warp_size": 64}}, None, []),
        ({"pattern": {"kind": "warp", "lanes": [3, 3]}}, ValueError, ["distinct", "[3, 3]"]),
        ({"pattern": {"kind": "warp", "lanes": []}}, ValueError, ["lanes", "empty"]),
        ({"pattern": {"kind": "warp", "lanes": "odd"}}, ValueError, ["'odd'", "random", "all"]),
        ({"pattern": {"kind": "warp", "stride": 0}}, ValueError, ["stride", "got 0"]),
        ({"pattern": {"kind": "warp", "warp_size": 0}}, ValueError, ["warp_size", "got 0"]),
        ({"pattern": {"kind": "warp", "every": 2}}, ValueError, ["every", "lanes", "warp_size"]),
        ({"bits": [1], "burst_bits": 0}, ValueError, ["burst_bits", ">= 1", "got 0"]),
        ({"burst_bits": 65}, ValueError, ["burst_bits 65", "64-bit", "1..64"]),
        ({"burst_bits": 17, "format": "fp16"}, ValueError, ["burst_bits 17", "16-bit fp16", "1..16"]),
        ({"bits": [30, 29], "burst_bits": 3}, ValueError, ["burst_bits 3", "bits 29..30", "1..2"]),
        ({"bits": [23, 25], "burst_bits": 2}, ValueError, ["[23, 25]", "contiguous"]),
        ({"model": "zero", "burst_bits": 2}, ValueError, ["'zero'", "burst_bits"]),
        ({"burst_bits": 2, "pattern": {"kind": "tensor", "ber": 0.1}}, ValueError, ["'tensor'", "burst_bits"]),
        ({"bits": [1], "schedule": {"kind": "periodic"}}, ValueError, ["needs 'every'"]),
        ({"bits": [1], "schedule": {"kind": "periodic", "every": 0}}, ValueError, ["every", "got 0"]),
        ({"bits": [1], "schedule": {"kind": "periodic", "every": 2, "start": 4, "stop": 4}}, ValueError, ["stop"]),
        ({"bits": [1], "schedule": {"kind": "periodic", "every": 2, "p": 0.5}}, ValueError, ["'p'", "every"]),
    ],
)
def test_bad_hardware_shapes_are_refused_naming_the_value(changes, error, needles):
    if error is None:
        spec(bits=[1], **changes)  # a 64-lane wavefront has lane 40
        return
    with pytest.raises(error) as exc:
        spec(**{"bits": [1], **changes} if "burst_bits" not in changes else changes)
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))


def test_a_burst_or_pattern_that_does_not_fit_the_tensor_is_a_fault_spec_error():
    wide = spec(burst_bits=20)  # fits the widest format, not a 16-bit one
    assert check_spec(wide, torch.float32, (4, 4)) == 1
    with pytest.raises(FaultSpecError, match="burst_bits 20 does not fit the 16-bit bf16 word"):
        check_spec(wide, torch.bfloat16, (4, 4))
    counted = spec(bits=[3], pattern={"kind": "strided", "stride": 5, "count": 4})
    assert check_spec(counted, torch.float32, (4, 4)) == 4
    with pytest.raises(FaultSpecError, match=r"count 4 with stride 5 spans 16 elements.*\[3, 4\].*count <= 3"):
        check_spec(counted, torch.float32, (3, 4))
    far = spec(bits=[3], pattern={"kind": "warp", "warp": 2})
    with pytest.raises(FaultSpecError, match=r"warp index 2 is out of range.*allowed: 0..1"):
        check_spec(far, torch.float32, (40,))


def test_periodic_fires_every_n_steps_once_and_recurs_in_place():
    s = spec(
        bits=list(range(23, 31)),
        burst_bits=2,
        pattern={"kind": "warp", "lanes": [5, 17], "stride": 3},
        schedule={"kind": "periodic", "every": 4, "start": 2, "stop": 15, "micro_batch": 1},
        seed=7,
    )
    assert [t for t in range(20) if fires(s, t, 1, "w", 0)] == [2, 6, 10, 14]
    assert not any(fires(s, t, m, "w", 0) for t in range(20) for m in (None, 0, 2))
    assert s.schedule.recurs and not spec(bits=[1]).schedule.recurs
    firings = []
    for step in (2, 6, 10, 14):
        t = torch.ones(400)
        r = apply_spec(s, t, fault_generator(s, step, 1, "w", 0))
        firings.append((r.index.tolist(), (r.before.view(torch.int32) ^ r.after.view(torch.int32)).tolist()))
    assert all(f == firings[0] for f in firings)  # the same elements and bits, every firing
    assert len({i // 32 % 3 for i in firings[0][0]}) == 1 and {i % 32 for i in firings[0][0]} == {5, 17}
    transient = spec(bits=list(range(23, 31)), burst_bits=2, pattern={"kind": "warp", "lanes": [5, 17], "stride": 3})
    draws = {
        tuple(apply_spec(transient, torch.ones(400), fault_generator(transient, t, 0, "w", 0)).index.tolist())
        for t in range(8)
    }
    assert len(draws) > 1  # a transient fault draws afresh at each event


def test_hardware_shapes_round_trip_through_a_fault_file(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text(
        "- {site: gemm.forward, target: fc, model: bitflip, bits: [23, 24, 25, 26, 27, 28, 29, 30], burst_bits: 3,\n"
        "   pattern: {kind: warp, lanes: [0, 31], stride: 4}, schedule: {kind: periodic, every: 10, start: 5}}\n"
        "- {site: activation, target: fc, model: stuck_at_1, bits: [30],\n"
        "   pattern: {kind: strided, stride: 32, start: 7}, schedule: {kind: transient, step: 3}}\n"
    )
    a, b = load_specs(f)
    assert a.burst_bits == 3 and a.pattern.lanes == (0, 31) and a.pattern.warp == "random"
    assert a.pattern.warp_size == 32 and "warp_size" not in a.pattern.to_dict()
    assert a.schedule.every == 10 and b.pattern.start == 7
    for s in (a, b):
        assert FaultSpec.from_dict(s.to_dict()) == s
    assert a.pattern.draws and not b.pattern.draws
