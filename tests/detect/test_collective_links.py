"""The exact link check (:mod:`sdcscope.detect.links`): a digest sees any flipped bit of any
dtype, rows are digested as the whole tensor is, a clean link never mismatches, and localization
tells a bad sender from a bad receiver when the topology allows."""

from __future__ import annotations

import pytest
import torch

from sdcscope.detect.links import Link, compare, digest, digest_parts, digest_rows, localize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_every_single_bit_flip_changes_the_digest(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, generator=g) * 10).to(dtype)  # 37 elements: not a whole block, odd bytes
    base = digest(x)
    raw = x.view(torch.uint8) if x.element_size() == 1 else x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
    for i in (0, 5, 36):
        for bit in range(8 * x.element_size()):
            y = raw.clone()
            y[i] ^= torch.tensor(1 << bit if bit < 8 * x.element_size() - 1 else -(1 << bit), dtype=y.dtype)
            assert not torch.equal(digest(y.view(dtype)), base), (i, bit)


def test_rows_are_digested_as_each_row_alone_and_padding_adds_nothing():
    rows = torch.randn(3, 300)
    assert torch.equal(digest_rows(rows), torch.stack([digest(r) for r in rows]))
    assert torch.equal(digest(torch.cat([rows[0], torch.zeros(212)])), digest(rows[0]))
    odd = torch.randn(2, 3).to(torch.bfloat16)  # 6 bytes a row: no whole words
    assert torch.equal(digest_rows(odd), torch.stack([digest(r) for r in odd]))
    parts = [torch.randn(2, 300), torch.randn(2, 4, 64).to(torch.bfloat16), torch.randn(2, 1)]
    assert torch.equal(digest_parts(parts), torch.stack([digest_rows(p.reshape(2, -1)) for p in parts], 1))
    assert torch.equal(
        digest_parts([*parts, odd]), torch.stack([digest_rows(p.reshape(2, -1)) for p in [*parts, odd]], 1)
    )


def _links(pairs, tensor="w"):
    return [Link("all_gather", s, d, tensor, "forward", (0, 4)) for s, d in pairs]


def test_compare_is_exact_and_names_only_the_bad_links():
    x = torch.randn(3, 64)
    sent = digest_rows(x)
    assert compare(_links([(0, 1), (1, 0), (2, 1)]), sent, digest_rows(x.clone())) == []
    y = x.clone()
    y[1, 10] = torch.nextafter(y[1, 10], torch.tensor(float("inf")))  # one ulp
    (m,) = compare(_links([(0, 1), (1, 0), (2, 1)]), sent, digest_rows(y))
    assert (m.link.src, m.link.dst, str(m.link)) == (1, 0, "1 -> 0") and m.sent != m.arrived


def test_localize_tells_sender_from_receiver_where_the_topology_allows():
    def suspects(bad, receivers):
        found = localize(
            [
                compare(_links([p]), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.int64))[0]
                for p in bad
            ],
            receivers,
        )
        return {(m.link.dst, m.suspect, tuple(m.suspects)) for m in found}

    key = ("all_gather", "forward", "w", 0)
    # four ranks gather rank 0's shard: every remote receiver got it corrupted -> the sender
    assert suspects([(0, 1), (0, 2), (0, 3)], {key: [0, 1, 2, 3]}) == {(d, "sender", (0,)) for d in (1, 2, 3)}
    # the sender's own copy is corrupted too -> the sender, whatever the others saw
    assert suspects([(0, 0), (0, 2)], {key: [0, 1, 2, 3]}) == {(0, "sender", (0,)), (2, "sender", (0,))}
    # one receiver of several -> that receiver (or its link)
    assert suspects([(0, 2)], {key: [0, 1, 2, 3]}) == {(2, "receiver", (2,))}
    # two ranks: one remote receiver, the two ends cannot be told apart
    assert suspects([(0, 1)], {key: [0, 1]}) == {(1, "link", (0, 1))}
