"""The exact check of a pipeline's send/recv: what arrived at a stage must carry the digest of what
left its neighbour, bit for bit.

At the stage boundary (:class:`~sdcscope.common.pipeline.StageBoundary`) each rank digests every
activation it sends on and every one that arrived, and every gradient it sends back and every one
that arrived (:mod:`sdcscope.detect.links`: two integer words of the stored bytes, one digest per
row along dim 0 -- a sample of the micro-batch --, so a mismatch names its element range). The
words ride in the collective checks' one gather per step (:mod:`sdcscope.detect.collectives`), and
every rank compares every link: stage ``s``'s sent activation against stage ``s + 1``'s arrived
one, and back for the gradient. There is no tolerance: a clean link gives the same words, always.
A mismatch names the link (``src -> dst``), the collective (``send_recv``), the tensor (the
activation leaving the sender's last block), the phase (``forward``: the activation,
``backward``: its gradient), the micro-batch and the element range; with one receiver per send
both ends are suspects (:func:`~sdcscope.detect.links.localize`).
"""

from __future__ import annotations

import logging

import torch

from sdcscope.common.pipeline import StageBoundary
from sdcscope.detect.events import Event
from sdcscope.detect.links import WORDS, Link, compare, digest_rows, localize

log = logging.getLogger("sdcscope.detect.p2p")

COLLECTIVE = "send_recv"
SLOTS = ("forward_sent", "forward_arrived", "backward_sent", "backward_arrived")
"""What each rank digests, per micro-batch: the activation it sends on and the one that arrived,
the gradient it sends back and the one that arrived."""


class P2PCheck:
    """One rank's digests of its stage boundary's transfers (a tap: see the module docstring)."""

    def __init__(self, boundary: StageBoundary, rank: int, rows: int, device: torch.device) -> None:
        self.boundary, self.info, self.rank = boundary, boundary.info, rank
        self.rows, self.device = rows, device
        self.links_compared = 0
        """Links (one micro-batch's transfer) compared exactly so far, every rank's."""
        self.reset()

    def attach(self) -> P2PCheck:
        self.boundary.add_tap(self)
        return self

    def detach(self) -> None:
        self.boundary.remove_tap(self)

    def reset(self) -> None:
        M, R = self.info.micro_batches, self.rows
        self.words = torch.zeros(len(SLOTS), M, R, WORDS, dtype=torch.int64, device=self.device)
        self.seen = torch.zeros(len(SLOTS), M, dtype=torch.int64, device=self.device)
        self.shape: dict[int, list[int]] = {}

    # -- the tap -----------------------------------------------------------------------------
    @torch.no_grad()
    def _record(self, slot: str, m: int, t: torch.Tensor) -> None:
        k = SLOTS.index(slot)
        rows = t.reshape(t.shape[0], -1)[: self.rows] if t.dim() else t.reshape(1, 1)
        self.words[k, m, : rows.shape[0]] = digest_rows(rows.contiguous())  # on the device: no sync
        self.seen[k, m] = 1
        self.shape[m] = list(t.shape)

    def arrived(self, phase: str, m: int, t: torch.Tensor) -> None:
        self._record(f"{phase}_arrived", m, t)

    def sent(self, phase: str, m: int, t: torch.Tensor) -> None:
        self._record(f"{phase}_sent", m, t)

    # -- the check ---------------------------------------------------------------------------
    def row(self) -> torch.Tensor:
        """This rank's words for the step's gather."""
        return torch.cat([self.words.flatten(), self.seen.flatten()])

    @property
    def numel(self) -> int:
        """The length of :meth:`row`."""
        return len(SLOTS) * self.info.micro_batches * (self.rows * WORDS + 1)

    def events(self, step: int, table: torch.Tensor) -> list[Event]:
        """The mismatches of every link, from every rank's :meth:`row` (``table``: ``[W, size]``);
        the events of those that arrived on this rank."""
        info, M, R = self.info, self.info.micro_batches, self.rows
        W = table.shape[0]
        words, seen = table.split([len(SLOTS) * M * R * WORDS, len(SLOTS) * M], 1)
        words, seen = words.reshape(W, len(SLOTS), M, R, WORDS), seen.reshape(W, len(SLOTS), M).bool()
        links, want, got = [], [], []
        for src in range(W):
            s, d = divmod(src, info.dp)
            if s == info.stages - 1:
                continue
            dst = info.rank_of(s + 1, d)
            for phase, a, b, frm, to in (("forward", 0, 1, src, dst), ("backward", 2, 3, dst, src)):
                for m in range(M):
                    if not (seen[frm, a, m] and seen[to, b, m]):
                        continue
                    self.links_compared += 1
                    bad = (words[frm, a, m] != words[to, b, m]).any(-1).nonzero().flatten().tolist()
                    for lo, hi in _runs(bad):
                        links.append((Link(COLLECTIVE, frm, to, info.boundaries[s], phase, (lo, hi), 0), m))
                        want.append(words[frm, a, m, lo:hi].sum(0))
                        got.append(words[to, b, m, lo:hi].sum(0))
        if not links:
            return []
        found = compare([lk for lk, _ in links], torch.stack(want), torch.stack(got))
        micro = {id(lk): m for lk, m in links}
        localize(found, {})
        events = []
        for mm in found:
            link = mm.link
            if link.dst != self.rank:
                continue  # every rank found it; the rank it arrived on reports it
            m = micro[id(link)]
            ev = {**mm.evidence(), "micro_batch": m, "shape": self.shape.get(m)}
            log.warning("pipeline %s link %s corrupted: %s micro-batch %d", link.phase, link, link.tensor, m)
            events.append(Event(step, "collectives", "mismatch", module=link.tensor, rank=link.dst, evidence=ev))
        return events


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive indices as ``[start, stop)`` runs."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


__all__ = ["COLLECTIVE", "P2PCheck"]
