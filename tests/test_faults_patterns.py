"""Spatial patterns: hand-computed index sets, a brute-force reference, and BER sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.faults import Pattern, resolve_indices, sample_bit_errors


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def flat(shape, *multi) -> list[int]:
    return sorted(int(np.ravel_multi_index(m, shape)) for m in multi)


def ids(pattern: Pattern, shape, **kw) -> list[int]:
    return resolve_indices(pattern, shape, gen(), **kw).tolist()


def test_pe_hand_computed():
    p = Pattern(kind="pe", array=[2, 4], pe=[1, 3])
    want = flat((6, 8), *[(i, j) for i in (1, 3, 5) for j in (3, 7)])
    assert ids(p, [6, 8]) == want == [11, 15, 27, 31, 43, 47]
    assert ids(p, [2, 3, 8]) == want  # the 2-D view of [2, 3, 8] is [6, 8]
    assert ids(p, [1, 3]) == []  # the PE at row 1 is idle on a 1-row output
    assert ids(Pattern(kind="pe", array=[3, 1], pe=[2, 0]), [1, 1]) == []


def test_pe_random_is_one_pe():
    p = Pattern(kind="pe", array=[2, 4])
    got = set(ids(p, [6, 8]))
    candidates = [
        {i * 8 + j for i in range(r, 6, 2) for j in range(c, 8, 4)} for r in range(2) for c in range(4)
    ]
    assert got in candidates


def test_mac_cell_on_weight_and_outputs():
    p = Pattern(kind="mac_cell", input_channel=1, output_channel=2)
    w = torch.arange(4 * 3 * 2 * 2).view(4, 3, 2, 2)
    assert ids(p, w.shape) == w[2, 1].flatten().tolist() == [28, 29, 30, 31]
    lin = torch.arange(5 * 3).view(5, 3)  # nn.Linear weight [out, in]
    assert ids(p, lin.shape) == [7]
    conv_out = torch.arange(2 * 4 * 3 * 3).view(2, 4, 3, 3)
    assert ids(p, conv_out.shape, channel_dim=1) == conv_out[:, 2].flatten().tolist()
    lin_out = torch.arange(2 * 5 * 6).view(2, 5, 6)
    assert ids(p, lin_out.shape, channel_dim=-1) == lin_out[..., 2].flatten().tolist()
    grad_in = torch.arange(2 * 5 * 3).view(2, 5, 3)  # dX of a linear: input channels last
    assert ids(p, grad_in.shape, channel_dim=(None, -1)) == grad_in[..., 1].flatten().tolist()


def test_mac_cell_errors():
    p = Pattern(kind="mac_cell", input_channel=0, output_channel=0)
    with pytest.raises(ValueError, match=r">= 2 dims .*\[7\]"):
        ids(p, [7])
    with pytest.raises(ValueError, match=r"output_channel 3 .*\[3, 2\].*0\.\.2"):
        ids(Pattern(kind="mac_cell", output_channel=3), [3, 2])
    with pytest.raises(ValueError, match=r"channel dim 2 .*\[3, 2\]"):
        ids(p, [3, 2], channel_dim=2)
    with pytest.raises(ValueError, match="differ"):
        ids(p, [3, 2], channel_dim=(1, -1))


def test_element_burst_row_column():
    assert ids(Pattern(kind="element", index=5), [2, 3]) == [5]
    assert ids(Pattern(kind="element", index=[1, 0, 2]), [2, 3, 4]) == [14]
    assert ids(Pattern(kind="burst", length=3, start=4), [2, 4]) == [4, 5, 6]
    assert ids(Pattern(kind="burst", length=8), [2, 4]) == list(range(8))
    assert ids(Pattern(kind="row", index=1), [2, 2, 3]) == [3, 4, 5]
    assert ids(Pattern(kind="column", index=2), [2, 2, 3]) == [2, 5, 8, 11]
    assert ids(Pattern(kind="row", index=0), [5]) == [0, 1, 2, 3, 4]  # 1-D: one row
    assert ids(Pattern(kind="column", index=0), []) == [0]  # 0-d: one element
    assert ids(Pattern(kind="row"), [0, 4]) == []  # nothing to corrupt


@pytest.mark.parametrize(
    ("pattern", "shape", "needles"),
    [
        (Pattern(kind="element", index=6), [2, 3], ["index 6", "[2, 3]", "0..5"]),
        (Pattern(kind="element", index=[0, 3]), [2, 3], ["index[1] 3", "[2, 3]", "0..2"]),
        (Pattern(kind="element", index=[0, 0, 0]), [2, 3], ["[0, 0, 0]", "[2, 3]"]),
        (Pattern(kind="burst", length=7), [2, 3], ["length 7", "[2, 3]"]),
        (Pattern(kind="burst", length=2, start=5), [2, 3], ["start 5", "[2, 3]", "0..4"]),
        (Pattern(kind="row", index=2), [2, 3], ["row index 2", "[2, 3]", "0..1"]),
        (Pattern(kind="column", index=3), [2, 3], ["column index 3", "[2, 3]", "0..2"]),
        (Pattern(kind="tensor", ber=0.1), [2, 3], ["sample_bit_errors"]),
    ],
)
def test_out_of_range_names_the_shape(pattern, shape, needles):
    with pytest.raises(ValueError) as info:
        ids(pattern, shape)
    for needle in needles:
        assert needle in str(info.value)


def _reference(pattern: Pattern, shape: tuple[int, ...], got: list[int]) -> set[int]:
    """Brute force over every multi-index; random choices are read back from ``got``."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    i, j = np.divmod(np.arange(math.prod(shape)), cols)
    multi = np.indices(shape).reshape(len(shape), -1)
    if pattern.kind == "row":
        sel = i == (got[0] // cols)
    elif pattern.kind == "column":
        sel = j == (got[0] % cols)
    elif pattern.kind == "pe":
        (n_r, n_c), first = pattern.array, got[0]
        sel = (i % n_r == (first // cols) % n_r) & (j % n_c == (first % cols) % n_c)
    else:  # mac_cell on a weight [out, in, ...]
        sel = (multi[0] == multi[0][got[0]]) & (multi[1] == multi[1][got[0]])
    assert rows * cols == len(sel)
    return set(np.flatnonzero(sel).tolist())


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple),
    kind=st.sampled_from(["row", "column", "pe", "mac_cell"]),
    array=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 2**32),
)
def test_random_patterns_match_brute_force(shape, kind, array, seed):
    pattern = Pattern(kind=kind, array=array) if kind == "pe" else Pattern(kind=kind)
    got = resolve_indices(pattern, shape, gen(seed))
    assert got.dtype == torch.long
    values = got.tolist()
    assert values == sorted(set(values))
    if kind == "pe" and not values:  # random PE idle on this small output
        return
    assert set(values) == _reference(pattern, shape, values)
    assert torch.equal(got, resolve_indices(pattern, shape, gen(seed)))


def _popcount(masks: torch.Tensor, width: int) -> int:
    m = masks.long() % (1 << width)
    return int(sum(((m >> b) & 1).sum() for b in range(width)))


@pytest.mark.parametrize("numel", [100_000, 500])  # sparse (rejection) and dense paths
def test_bit_error_rate_statistics(numel):
    ber, width = 1e-3 if numel > 1000 else 0.3, 32
    index, masks = sample_bit_errors(ber, numel, "fp32", gen(7))
    n_bits = numel * width
    flips = _popcount(masks, width)
    mean, sd = n_bits * ber, math.sqrt(n_bits * ber * (1 - ber))
    assert abs(flips - mean) < 5 * sd
    assert index.tolist() == sorted(set(index.tolist())) and index.max() < numel
    assert masks.dtype == torch.int32 and bool((masks != 0).all())
    per_bit = [int((((masks.long() % 2**32) >> b) & 1).sum()) for b in range(width)]
    expect = numel * ber
    assert all(abs(c - expect) < 6 * math.sqrt(expect) + 2 for c in per_bit)
    again = sample_bit_errors(ber, numel, "fp32", gen(7))
    assert torch.equal(again[0], index) and torch.equal(again[1], masks)


def test_bit_errors_restricted_bits_and_full_rate():
    index, masks = sample_bit_errors(0.05, 2000, "bf16", gen(1), bits=[14])
    assert set(masks.tolist()) == {1 << 14} and 40 < index.numel() < 170
    index, masks = sample_bit_errors(1.0, 10, "int8", gen(1))
    assert index.tolist() == list(range(10)) and masks.tolist() == [-1] * 10
    index, masks = sample_bit_errors(0.5, 0, "fp16", gen(1))
    assert index.numel() == masks.numel() == 0
    with pytest.raises(ValueError, match=r"bit 8 .*0\.\.7"):
        sample_bit_errors(0.1, 10, "fp8_e5m2", gen(1), bits=[8])
