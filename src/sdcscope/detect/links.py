"""The exact check of one link of a collective that moves bits unchanged (all-gather, broadcast,
all-to-all, send/recv): what arrived on rank ``dst`` from rank ``src`` must carry the digest of
what left ``src``, bit for bit.

A digest is two integer words of the stored bytes -- the state checksums' two sums
(:func:`sdcscope.detect.state.block_sums`: the plain sum of the 32-bit words and a mixed sum with
fixed odd multipliers, so a flip of any bit changes it), summed over the blocks. Zero padding
adds nothing to either sum, so rows of one buffer are digested in one pass whatever their
length. There is no tolerance: a clean link gives the same words, always; a mismatch is a
corrupted link (two flips cancel only if random multipliers do).

A collective's check is: the sender's words (a few per tensor, carried once per step), the
receivers' words of what arrived, :func:`compare` -> :class:`Mismatch` per bad link, and
:func:`localize`, which tells a bad sender from a bad receiver where the topology allows:
a sender whose shard arrived corrupted at every remote receiver (two or more), or whose own
copy is corrupted too, is the suspect; one receiver among two or more is; with a single remote
receiver the link is named and both ends are suspects. Pipeline send/recv and the MoE
all-to-all reuse the same three calls with their own sources and receivers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sdcscope.detect.state import BLOCK, _lanes, _mult, words_of

WORDS = 2
"""Integer words per digest."""


def digest(t: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64: the digest of ``t``'s stored bytes (its integer view)."""
    return digest_rows(words_of(t).view(1, -1))[0]


def digest_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` int64: the digest of each row of ``rows`` (``[R, n]``, any dtype whose rows are
    whole 32-bit words; else each row is digested on its own)."""
    r = rows.shape[0]
    if rows.dtype != torch.int32:
        flat = rows.reshape(r, -1)
        if (flat.shape[1] * flat.element_size()) % 4:
            return torch.stack([digest(row) for row in flat]) if r else _empty(rows.device)
        rows = words_of(flat).view(r, -1)
    n = rows.shape[1]
    pad = -n % BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(r, pad)], 1)
    blocks = rows.reshape(-1, BLOCK)
    m = _mult(rows.device)
    lanes = _lanes(blocks, m[0], m[1], None)  # [blocks, 2] int32, mod 2^32
    return lanes.view(r, -1, WORDS).sum(1, dtype=torch.int64)


def digest_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[R, len(parts), 2]`` int64: :func:`digest_rows` of each ``[R, n_j]`` part, in one pass
    over all of them (each part's rows zero-padded to whole blocks side by side, the blocks'
    sums added up per part): a handful of operations for a whole FSDP2 unit, not per tensor."""
    r = parts[0].shape[0]
    words = [words_of(p.reshape(r, -1)).view(r, -1) if _whole_words(p) else None for p in parts]
    if any(w is None for w in words):
        return torch.stack([digest_rows(p) for p in parts], 1)
    key = (r, words[0].device, tuple(w.shape[1] for w in words))
    layout = _LAYOUTS.get(key)
    if layout is None:
        blocks = [-(-w.shape[1] // BLOCK) for w in words]
        starts = [BLOCK * sum(blocks[:j]) for j in range(len(blocks))]
        seg = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(blocks)).to(words[0].device)
        layout = _LAYOUTS[key] = (sum(blocks), starts, seg)
        if len(_LAYOUTS) > 256:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
    nblocks, starts, seg = layout
    buf = words[0].new_zeros(r, nblocks * BLOCK)
    for w, at in zip(words, starts):
        buf[:, at : at + w.shape[1]] = w
    m = _mult(buf.device)
    lanes = _lanes(buf.view(-1, BLOCK), m[0], m[1], None).view(r, -1, WORDS).to(torch.int64)
    return lanes.new_zeros(r, len(parts), WORDS).index_add_(1, seg, lanes)


_LAYOUTS: dict[tuple, tuple[int, list[int], torch.Tensor]] = {}
"""digest_parts' block layout per shape of its parts (the units of a model repeat every step)."""


def _whole_words(p: torch.Tensor) -> bool:
    return p.numel() == 0 or (p[0].numel() * p.element_size()) % 4 == 0


def _empty(device: torch.device) -> torch.Tensor:
    return torch.zeros(0, WORDS, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Link:
    """One transfer of a collective: ``tensor``'s part ``elements`` (``[start, stop)`` along
    ``dim``) sent by rank ``src``, arrived on rank ``dst``; ``phase``: which of the step's calls
    (an FSDP2 unit's ``forward`` all-gather or ``backward`` re-gather)."""

    collective: str
    src: int
    dst: int
    tensor: str
    phase: str | None = None
    elements: tuple[int, int] | None = None
    dim: int = 0

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}"


@dataclass
class Mismatch:
    """A link whose arrived words differ from the sender's, and who is suspected."""

    link: Link
    sent: list[int]
    arrived: list[int]
    suspect: str = "link"
    """``sender`` (every remote receiver, or the sender's own copy, saw it), ``receiver`` (one
    receiver of several) or ``link`` (one remote receiver only: either end)."""
    suspects: list[int] = field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        link = asdict(self.link)
        return {
            **link,
            "elements": None if link["elements"] is None else list(link["elements"]),
            "link": str(self.link),
            "sent": self.sent,
            "arrived": self.arrived,
            "suspect": self.suspect,
            "suspects": self.suspects,
        }


def compare(links: list[Link], sent: torch.Tensor, arrived: torch.Tensor) -> list[Mismatch]:
    """The links whose ``arrived`` words (``[L, 2]``) differ from ``sent`` (``[L, 2]``, the
    sender's words of each link's part), exactly; one comparison on the device, one host read."""
    assert sent.shape == arrived.shape == (len(links), WORDS), (sent.shape, arrived.shape, len(links))
    bad = (sent != arrived).any(1).nonzero().flatten().tolist()
    if not bad:
        return []
    s, a = sent[bad].tolist(), arrived[bad].tolist()
    return [Mismatch(links[i], s[k], a[k]) for k, i in enumerate(bad)]


def localize(mismatches: list[Mismatch], receivers: dict[tuple, list[int]]) -> list[Mismatch]:
    """Set each mismatch's suspect from every mismatch of the same send: ``receivers[key]`` lists
    the ranks that received it, ``key`` = ``(collective, phase, tensor, src)``."""
    bad: dict[tuple, set[int]] = {}
    for m in mismatches:
        bad.setdefault(_key(m.link), set()).add(m.link.dst)
    for m in mismatches:
        key, src, dst = _key(m.link), m.link.src, m.link.dst
        remote = [r for r in receivers.get(key, [dst]) if r != src]
        remote_bad = [r for r in remote if r in bad[key]]
        if src in bad[key] or (len(remote) >= 2 and len(remote_bad) == len(remote)):
            m.suspect, m.suspects = "sender", [src]
        elif len(remote) >= 2:
            m.suspect, m.suspects = "receiver", [dst]
        else:
            m.suspect, m.suspects = "link", [src, dst]
    return mismatches


def _key(link: Link) -> tuple:
    return (link.collective, link.phase, link.tensor, link.src)
