"""The exact check of an expert-parallel MoE layer's all-to-alls: what arrived on rank ``dst``
from rank ``src`` must carry the digest of what left ``src`` for ``dst``, bit for bit.

Every call (:data:`~sdcscope.common.alltoall.CALLS`: the token rows' ``dispatch``, the expert
outputs' ``combine``, and both gradients' moves back in backward) moves bits unchanged, so each
is checked exactly, without a tolerance. The combine's weighted sum of a token's k expert
outputs is local arithmetic after the move: the exact check covers the move and the experts'
GEMMs stay ABFT's, the dispatch permutation the ``dispatch`` detector's. Before a transfer the
sender digests each chunk it sends (:func:`sdcscope.detect.links.digest_parts`: two integer words
per chunk); after it the receiver digests each chunk that arrived. The words of a step (summed
over micro-batches) are a few per layer and call; they travel in the collective check's one
gather per step (:mod:`sdcscope.detect.collectives`), where every rank compares every link and
the rank a corrupted chunk arrived on reports it: the link ``src -> dst``, the layer, the call,
the rows of the chunk in the receiver's buffer, and whom the topology suspects
(:func:`sdcscope.detect.links.localize`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sdcscope.common.alltoall import CALLS, Exchange, exchanges
from sdcscope.detect.events import Event
from sdcscope.detect.links import WORDS, Link, compare, digest_parts, localize

log = logging.getLogger("sdcscope.detect.alltoall")


class AllToAllCheck:
    """The digests of one rank's all-to-alls and their comparison (see the module docstring)."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.name = name
        """The detector's name on the events."""
        self.exchanges: list[Exchange] = exchanges(model)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.index = {id(ex): i for i, ex in enumerate(self.exchanges)}
        self._removers: list = []
        self.groups: list | None = None  # every rank's exchanges' ranks (learnt at the first check)
        self.rank: int | None = None  # set at attach
        self.links_compared = 0

    @property
    def active(self) -> bool:
        return bool(self.exchanges)

    def attach(self, rank: int) -> AllToAllCheck:
        """Tap every exchange as ``rank`` (whose arrived chunks its events report)."""
        self.rank = rank
        if not self._removers:
            self._removers = [ex.add("before_send", self._sent) for ex in self.exchanges]
            self._removers += [ex.add("after_recv", self._arrived) for ex in self.exchanges]
        self.reset()
        return self

    def detach(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []

    def reset(self) -> None:
        L, W = len(self.exchanges), max((ex.size for ex in self.exchanges), default=0)
        # [2 (sent, arrived), L, calls, W peers, 2 words], then the rows of each arrived chunk
        self.words = torch.zeros(2, L, len(CALLS), W, WORDS, dtype=torch.int64, device=self.device)
        self.rows: dict[tuple[int, int], list[int]] = {}

    @property
    def numel(self) -> int:
        return self.words.numel()

    @torch.no_grad()
    def _sent(self, ex: Exchange, call: str, buf: torch.Tensor, splits: list[int]) -> None:
        if ex.training:  # an evaluation's moves are no step's
            self._digest(0, ex, call, buf, splits)

    @torch.no_grad()
    def _arrived(self, ex: Exchange, call: str, buf: torch.Tensor, splits: list[int]) -> None:
        if ex.training:
            self.rows.setdefault((self.index[id(ex)], CALLS.index(call)), list(splits))
            self._digest(1, ex, call, buf, splits)

    def _digest(self, side: int, ex: Exchange, call: str, buf: torch.Tensor, splits: list[int]) -> None:
        chunks = [c.reshape(1, -1) for c in buf.split(splits)]
        words = digest_parts(chunks)[0]  # [W, 2], on the device: no sync
        self.words[side, self.index[id(ex)], CALLS.index(call), : len(splits)] += words

    def row(self) -> torch.Tensor:
        """This rank's words of the step, flat (its part of the collective check's gather)."""
        return self.words.flatten()

    def events(self, step: int, table: torch.Tensor) -> list[Event]:
        """Compare every link of every rank's words (``table``: each rank's :meth:`row`, in rank
        order), in one comparison; the events of the corrupted chunks that arrived on this rank."""
        rank = self.rank
        if self.groups is None:
            self._learn_groups()
        words = table.view(len(self.groups), *self.words.shape)
        arrived = words[:, 1].permute(0, 1, 3, 2, 4)  # [dst, L, j (source slot), calls, 2]
        sent = words[:, 0].permute(0, 1, 3, 2, 4)[self.source]  # the sender's words for each slot
        bad = self.valid & (arrived != sent).any(-1).any(-1)  # [dst, L, j]
        self.links_compared += int(self.valid.sum()) * len(CALLS)
        links, want, got, receivers = [], [], [], {}
        for dst, li, j in bad.nonzero().tolist():
            src = self.groups[dst][li][j]
            for ci, call in enumerate(CALLS):
                if torch.equal(sent[dst, li, j, ci], arrived[dst, li, j, ci]):
                    continue
                name = self.exchanges[li].name
                links.append(self._link(name, call, src, dst, li, ci, j if dst == rank else None))
                want.append(sent[dst, li, j, ci])
                got.append(arrived[dst, li, j, ci])
                receivers[("all_to_all", call, name, src)] = list(self.groups[dst][li])
        if not links:
            return []
        found = localize(compare(links, torch.stack(want), torch.stack(got)), receivers)
        events = []
        for m in found:
            if m.link.dst != rank:
                continue  # every rank found it; the rank it arrived on reports it
            link = m.link
            suspect = m.suspects[0] if m.suspect == "sender" else link.dst
            log.warning("all-to-all link %s corrupted: %s (%s, suspect %s)", link, link.tensor, link.phase, m.suspect)
            events.append(Event(step, self.name, "mismatch", module=link.tensor, rank=suspect, evidence=m.evidence()))
        return events

    def _learn_groups(self) -> None:
        """Every rank's exchange groups (once: a collective), and for each slot ``j`` that arrived
        on ``dst`` in layer ``l`` where its sender keeps the words it sent: ``(src, l, i)``."""
        import torch.distributed as dist

        self.groups = [None] * dist.get_world_size()
        dist.all_gather_object(self.groups, [ex.ranks for ex in self.exchanges])
        R, L, W = len(self.groups), len(self.exchanges), self.words.shape[3]
        src, layer, slot = (torch.zeros(R, L, W, dtype=torch.int64) for _ in range(3))
        self.valid = torch.zeros(R, L, W, dtype=torch.bool)
        for dst, groups in enumerate(self.groups):
            for li, ranks in enumerate(groups):
                for j, s in enumerate(ranks):
                    src[dst, li, j], layer[dst, li, j], slot[dst, li, j] = s, li, self.groups[s][li].index(dst)
                    self.valid[dst, li, j] = True
        self.source = (src, layer, slot)

    def _link(self, name: str, call: str, src: int, dst: int, li: int, ci: int, j: int | None) -> Link:
        """The link; on the receiving rank with the rows the chunk took in its buffer."""
        elements = None
        splits = self.rows.get((li, ci)) if j is not None else None
        if splits is not None:
            start = sum(splits[:j])
            elements = (start, start + splits[j])
        return Link("all_to_all", src, dst, name, call, elements, 0)


__all__ = ["AllToAllCheck"]
