"""The state checksum's two sums are the same numbers whichever way they are computed: the CPU's
integer GEMVs (which wrap mod 2^32) and the elementwise form accelerators use."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.detect.state import BLOCK, _lanes, _mixed_terms, _mult, block_sums


def elementwise(words: torch.Tensor) -> torch.Tensor:
    """The sums written out as the docstring defines them, one block at a time."""
    m = _mult(words.device)
    rows = []
    for lo in range(0, words.numel(), BLOCK):
        w = words[lo : lo + BLOCK]
        a, b = m[0, : w.numel()], m[1, : w.numel()]
        rows.append(torch.stack([w.sum(dtype=torch.int32), _mixed_terms(w, a, b).sum(dtype=torch.int32)]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int32)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 * BLOCK + 7), seed=st.integers(0, 2**31 - 1), extreme=st.booleans())
def test_gemv_sums_equal_the_elementwise_sums_mod_2_32(n, seed, extreme):
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    if extreme and n:  # every product and partial sum overflows int32
        words[::2] = -(2**31)
        words[1::2] = 2**31 - 1
    assert torch.equal(block_sums(words, torch.empty(max(n, 1), dtype=torch.int32)), elementwise(words))
    assert torch.equal(block_sums(words), elementwise(words))


def test_a_flip_of_any_bit_changes_the_gemv_mixed_sum():
    words = torch.randint(-(2**31), 2**31 - 1, (BLOCK,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    m = _mult(words.device)
    before = _lanes(words.view(1, BLOCK), m[0], m[1], None)
    for bit in range(32):
        flipped = words.clone()
        flipped[17] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
        assert not torch.equal(_lanes(flipped.view(1, BLOCK), m[0], m[1], None)[:, 1], before[:, 1]), bit


def test_the_guard_docs_give_the_block_size_the_code_uses():
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "guard.md").read_text().split())
    assert f"Every block of {BLOCK} stored 32-bit words" in text
