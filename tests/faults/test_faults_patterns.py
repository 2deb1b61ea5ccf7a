"""Spatial patterns: hand-computed index sets, a brute-force reference, and BER sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.faults import FaultSpec, Pattern, load_specs, resolve_indices, sample_bit_errors, swizzle_permutation
from sdcscope.faults.vocab import MAC_CELL_SINGLE_AXIS, check_site_pattern


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
    candidates = [{i * 8 + j for i in range(r, 6, 2) for j in range(c, 8, 4)} for r in range(2) for c in range(4)]
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


def test_mac_cell_array_folds_channels_onto_the_cell():
    # array R=2 input rows x C=3 output columns; cell (a=1, b=2) serves inputs {1, 3}, outputs {2, 5}
    p = Pattern(kind="mac_cell", array=[2, 3], input_channel=1, output_channel=2)
    conv_w = (7, 5, 1, 2)  # [out, in, kh, kw], strides (10, 2, 2, 1)
    want = flat(conv_w, *[(o, i, 0, k) for o in (2, 5) for i in (1, 3) for k in (0, 1)])
    assert ids(p, conv_w) == want == [22, 23, 26, 27, 52, 53, 56, 57]
    assert ids(p, [6, 4]) == [2 * 4 + 1, 2 * 4 + 3, 5 * 4 + 1, 5 * 4 + 3] == [9, 11, 21, 23]  # Linear [out, in]
    assert ids(p, [2, 7, 1, 1], channel_dim=1) == [2, 5, 9, 12]  # conv output: channels 2, 5 of both samples
    assert ids(p, [2, 5], channel_dim=(None, -1)) == [1, 3, 6, 8]  # dX of a linear: input channels 1, 3
    # NVDLA small config 8x8 on conv1 [16, 1, 3, 3]: only row 0 is used
    small = Pattern(kind="mac_cell", array=[8, 8], input_channel=0, output_channel=0)
    assert ids(small, [16, 1, 3, 3]) == list(range(0, 9)) + list(range(72, 81))
    idle = Pattern(kind="mac_cell", array=[8, 8], input_channel=3, output_channel=0)
    assert ids(idle, [16, 1, 3, 3]) == []  # input row 3 gets no channel of a 1-channel input
    assert ids(Pattern(kind="mac_cell", array=[8, 8], input_channel=0, output_channel=7), [4, 2]) == []
    # an array at least as large as the tensor: exactly the plain cell
    assert ids(Pattern(kind="mac_cell", array=[8, 8], input_channel=1, output_channel=2), [4, 3]) == [7]


@pytest.mark.parametrize("seed", range(6))
def test_mac_cell_array_random_cell_is_one_cell_of_the_array(seed):
    p = Pattern(kind="mac_cell", array=[2, 3])
    got = set(ids_seed(p, [7, 5], seed))
    cells = {(a, b): {o * 5 + i for o in range(b, 7, 3) for i in range(a, 5, 2)} for a in range(2) for b in range(3)}
    cell = next(c for c, want in cells.items() if want == got)
    # the draw depends on the array, not on the tensor: the same generator picks the same cell
    a, b = cell
    assert set(ids_seed(p, [3, 4], seed)) == {o * 4 + i for o in range(b, 3, 3) for i in range(a, 4, 2)}


def ids_seed(pattern: Pattern, shape, seed: int, **kw) -> list[int]:
    return resolve_indices(pattern, shape, gen(seed), **kw).tolist()


def test_swizzle_permutation_is_a_deterministic_permutation_per_step():
    for n in (1, 2, 5, 16):
        for step in range(4):
            perm = swizzle_permutation(n, 3, step, "input")
            assert sorted(perm.tolist()) == list(range(n)) and perm.dtype == torch.long
            assert torch.equal(perm, swizzle_permutation(n, 3, step, "input"))
    maps = [swizzle_permutation(16, 3, step, "input").tolist() for step in range(8)]
    assert len({tuple(m) for m in maps}) == 8  # a new map every step
    assert swizzle_permutation(16, 3, 0, "output").tolist() != maps[0]  # the axes are independent
    assert swizzle_permutation(16, 4, 0, "input").tolist() != maps[0]  # and keyed by the seed
    with pytest.raises(ValueError, match=r"role 'in'.*\['input', 'output'\]"):
        swizzle_permutation(4, 0, 0, "in")
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        swizzle_permutation(4, 0, -1, "input")


def test_swizzled_mac_cell_hits_the_channels_mapped_onto_the_cell():
    p = Pattern(kind="mac_cell", array=[2, 3], input_channel=1, output_channel=2, swizzle="per_step", swizzle_seed=4)
    for step in range(5):
        perm_in = swizzle_permutation(5, 4, step, "input").tolist()
        perm_out = swizzle_permutation(7, 4, step, "output").tolist()
        # logical channel c meets the cell when its lane perm[c] is one of the cell's lanes
        ins = [c for c in range(5) if perm_in[c] in (1, 3)]
        outs = [c for c in range(7) if perm_out[c] in (2, 5)]
        assert len(ins) == 2 and len(outs) == 2  # swizzling moves the faulty products, never adds any
        assert ids(p, [7, 5], step=step) == sorted(o * 5 + i for o in outs for i in ins)
        assert ids(p, [2, 7, 1, 1], channel_dim=1, step=step) == sorted(n * 7 + o for n in (0, 1) for o in outs)
    plain = Pattern(kind="mac_cell", input_channel=1, output_channel=2, swizzle="per_step")
    seen = set()
    for step in range(40):
        i = swizzle_permutation(5, 0, step, "input").tolist().index(1)  # the logical input on lane 1
        o = swizzle_permutation(7, 0, step, "output").tolist().index(2)
        assert ids(plain, [7, 5], step=step) == [o * 5 + i]
        seen.add((o, i))
    assert len(seen) > 20  # the fault wanders over the channel pairs
    with pytest.raises(ValueError, match="needs step="):
        ids(plain, [7, 5])


def test_mac_cell_array_and_swizzle_validation():
    cases = [
        (dict(array=[0, 8]), ValueError, ["array[0]", ">= 1", "got 0"]),
        (dict(array=[8, 2.5]), TypeError, ["array[1]", "int", "2.5"]),
        (dict(array=[8]), TypeError, ["array", "two ints", "[8]"]),
        (dict(array=[8, 4], output_channel=4), ValueError, ["output_channel 4", "outside array [8, 4]", "0..3"]),
        (dict(array=[2, 4], input_channel=2), ValueError, ["input_channel 2", "outside array [2, 4]", "0..1"]),
        (dict(swizzle="per_epoch"), ValueError, ["'per_epoch'", "'none', 'per_step'"]),
        (dict(swizzle=True), TypeError, ["swizzle", "True", "'none', 'per_step'"]),
        (dict(swizzle_seed=3), ValueError, ["swizzle_seed 3", "per_step"]),
        (dict(swizzle="per_step", swizzle_seed=-1), ValueError, ["swizzle_seed", ">= 0", "-1"]),
    ]
    for kw, exc, needles in cases:
        with pytest.raises(exc) as info:
            Pattern(kind="mac_cell", **kw)
        for needle in needles:
            assert needle in str(info.value), (kw, str(info.value))
    with pytest.raises(ValueError, match="'row' does not take 'swizzle'"):
        Pattern(kind="row", swizzle="per_step")
    p = Pattern(kind="mac_cell", array=(8, 8), swizzle="per_step")
    assert (p.array, p.swizzle_seed, p.swizzled) == ((8, 8), 0, True)
    assert Pattern.from_dict(p.to_dict()) == p
    assert "swizzle" not in Pattern(kind="mac_cell").to_dict() and not Pattern(kind="mac_cell").swizzled


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
    elif pattern.array is None:  # mac_cell on a weight [out, in, ...]
        sel = (multi[0] == multi[0][got[0]]) & (multi[1] == multi[1][got[0]])
    else:  # mac_cell folded onto an array [R input rows, C output columns]
        (n_in, n_out), first = pattern.array, got[0]
        sel = (multi[0] % n_out == multi[0][first] % n_out) & (multi[1] % n_in == multi[1][first] % n_in)
    assert rows * cols == len(sel)
    return set(np.flatnonzero(sel).tolist())


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple),
    kind=st.sampled_from(["row", "column", "pe", "mac_cell", "mac_cell_array"]),
    array=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    seed=st.integers(0, 2**32),
)
def test_random_patterns_match_brute_force(shape, kind, array, seed):
    if kind == "mac_cell_array":
        pattern = Pattern(kind="mac_cell", array=array)
    else:
        pattern = Pattern(kind=kind, array=array) if kind == "pe" else Pattern(kind=kind)
    got = resolve_indices(pattern, shape, gen(seed))
    assert got.dtype == torch.long
    values = got.tolist()
    assert values == sorted(set(values))
    if kind in ("pe", "mac_cell_array") and not values:  # random PE / cell idle on this small tensor
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


BASE = dict(target="0", model="stuck_at_1", bits=[30], schedule={"kind": "transient", "step": 0})


@pytest.mark.parametrize(
    "pattern",
    [
        {"input_channel": 1},
        {"input_channel": 1, "output_channel": 2},
        {"array": [2, 2], "input_channel": 0, "output_channel": 1},
        {"array": [4, 4], "input_channel": 3, "swizzle": "per_step"},
    ],
    ids=str,
)
def test_mac_cell_input_channel_on_activation_is_refused(pattern):
    with pytest.raises(
        ValueError,
        match=r"pattern mac_cell input_channel \d+ has no meaning on site "
        r"'activation': a module output holds output channels only.*ignored",
    ):
        FaultSpec(site="activation", pattern={"kind": "mac_cell", **pattern}, **BASE)


@pytest.mark.parametrize(
    "pattern",
    [
        {"output_channel": 2},
        {"input_channel": 1, "output_channel": 2},
        {"array": [2, 2], "input_channel": 0, "output_channel": 1},
    ],
    ids=str,
)
def test_mac_cell_output_channel_on_grad_input_is_refused(pattern):
    with pytest.raises(
        ValueError,
        match=r"pattern mac_cell output_channel \d+ has no meaning on site "
        r"'gemm.grad_input': dX = dY W holds input channels only.*ignored",
    ):
        FaultSpec(site="gemm.grad_input", pattern={"kind": "mac_cell", **pattern}, **BASE)


def test_a_refused_mac_cell_channel_names_the_spec_in_a_fault_file(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_text(
        "- {site: gemm.forward, target: '0', model: zero, schedule: {kind: transient, step: 0},\n"
        "   pattern: {kind: mac_cell, input_channel: 1, output_channel: 2}}\n"
        "- {site: activation, target: '0', model: zero, schedule: {kind: transient, step: 0},\n"
        "   pattern: {kind: mac_cell, input_channel: 1, output_channel: 2}}\n"
    )
    with pytest.raises(ValueError, match=r"fault spec #1 in .*: pattern mac_cell input_channel 1 .*'activation'"):
        load_specs(path)


@pytest.mark.parametrize(
    "site,pattern",
    [
        ("activation", {"output_channel": 2}),
        ("activation", {"input_channel": "random", "output_channel": 2}),
        ("activation", {"array": [4, 4], "output_channel": 1, "swizzle": "per_step"}),
        ("gemm.grad_input", {"input_channel": 2}),
        ("gemm.grad_input", {"input_channel": 2, "output_channel": "random"}),
        ("gemm.forward", {"input_channel": 1, "output_channel": 2}),
        ("gemm.grad_weight", {"input_channel": 1, "output_channel": 2}),
        ("weight", {"input_channel": 1, "output_channel": 2}),
        ("param_grad", {"input_channel": 1, "output_channel": 2}),
        ("optimizer_state", {"input_channel": 1, "output_channel": 2}),
    ],
    ids=str,
)
def test_mac_cell_channels_that_have_a_meaning_are_accepted(site, pattern):
    spec = FaultSpec(site=site, pattern={"kind": "mac_cell", **pattern}, **BASE)
    check_site_pattern(site, spec.pattern)


def test_check_site_pattern_covers_a_prebuilt_pattern_object():
    pattern = Pattern(kind="mac_cell", input_channel=3, output_channel=1)
    with pytest.raises(ValueError, match="input_channel 3 has no meaning on site 'activation'"):
        FaultSpec(site="activation", pattern=pattern, **BASE)
    assert set(MAC_CELL_SINGLE_AXIS) == {"activation", "gemm.grad_input"}


def test_draws_on_matches_what_resolving_the_pattern_draws():
    def hits(pattern, shape, channel_dim):
        from sdcscope.faults import resolve_indices

        return {
            tuple(resolve_indices(pattern, shape, torch.Generator().manual_seed(s), channel_dim=channel_dim).tolist())
            for s in range(8)
        }

    fixed_cell = Pattern.from_dict({"kind": "mac_cell", "array": [4, 4], "input_channel": 1, "output_channel": 2})
    assert not fixed_cell.draws and len(hits(fixed_cell, (8, 6), None)) == 1
    out_only = Pattern.from_dict({"kind": "mac_cell", "output_channel": 2})
    assert out_only.draws and not out_only.draws_on("activation") and out_only.draws_on("weight")
    assert len(hits(out_only, (3, 8), -1)) == 1 and len(hits(out_only, (8, 6), None)) > 1
    assert Pattern.from_dict({"kind": "mac_cell", "array": [4, 4]}).draws_on("activation")
