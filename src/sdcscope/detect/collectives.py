"""Online checks of the collectives of a step: FSDP2's parameter all-gathers exactly, its gradient
reduce-scatters against a rounding bound, and an expert-parallel MoE's all-to-alls exactly
(:mod:`sdcscope.detect.alltoall`, in the same one gather a step).

**All-gather (exact).** Right after each FSDP2 unit's forward all-gather, and after its backward
re-gather, every rank digests each row of what arrived (:mod:`sdcscope.detect.links`: integer
words of the stored bytes, row ``s`` from shard rank ``s``); each rank digests what it sent (its
padded shard) at the forward all-gather. At the check point (after backward) one small gather
of every rank's words lets every rank compare every link exactly -- no tolerance, so a clean run
cannot raise an event -- and localize a mismatch: a sender whose shard arrived corrupted at every
remote receiver, one receiver among several, or with two ranks the link itself. Each mismatch
is reported by the rank it arrived on (an event names the link ``src -> dst``, the collective,
the call, the parameter and the element range along its shard dim).

**Reduce-scatter (tolerance).** When a unit's unreduced gradient is accumulated (before FSDP2
reduces it), each rank sums each of its ``S`` chunks and their magnitudes in fp64; at the check,
rank ``d``'s reduced shard must sum to Σ over the ranks it reduces over of their chunk ``d``,
divided as FSDP2 divides, within ``(n + 3 + m)·u·Σ|g|`` (n summands, the pre/post division and
the cast, m accumulated micro-batches, u the unit roundoff of the coarser of the reduce and
gradient dtypes): a worst-case bound, so no clean step exceeds it.

**Send/recv (exact).** A pipeline stage's transfers to and from its neighbours, digested at the
stage boundary (:mod:`sdcscope.detect.p2p`).

The words travel in the same one gather, once per step: one host read, no other sync. A model
without FSDP2 units or a pipeline stage has nothing to check (:data:`~sdcscope.common.world.SUPPORT`
``guard.collectives``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from sdcscope.common.fsdp import PASSES, FSDPUnit, fsdp_units, on_gathered
from sdcscope.common.pipeline import boundary_of
from sdcscope.common.validate import check_bool
from sdcscope.common.world import World, local
from sdcscope.detect.alltoall import AllToAllCheck
from sdcscope.detect.events import Event
from sdcscope.detect.links import WORDS, Link, compare, digest_parts, localize
from sdcscope.detect.p2p import P2PCheck
from sdcscope.detect.protocol import CheckView, Registration, register
from sdcscope.detect.rounding import unit_roundoff

log = logging.getLogger("sdcscope.detect.collectives")

NAME = "collectives"


@dataclass
class CollectivesConfig:
    """Which collectives are checked each step (those the world runs)."""

    all_gather: bool = True
    """The parameter all-gathers (forward, and the backward re-gather), exactly."""
    reduce_scatter: bool = True
    """The gradient reduce-scatters, against their rounding bound."""
    all_to_all: bool = True
    """An expert-parallel MoE layer's all-to-alls (token dispatch, combine and their gradients),
    exactly (:mod:`sdcscope.detect.alltoall`)."""
    p2p: bool = True
    """A pipeline's send/recv of activations and their gradients, exactly."""

    def __post_init__(self) -> None:
        check_bool("collectives all_gather", self.all_gather)
        check_bool("collectives reduce_scatter", self.reduce_scatter)
        check_bool("collectives all_to_all", self.all_to_all)
        check_bool("collectives p2p", self.p2p)


class CollectiveCheck:
    """The checks of one rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: CollectivesConfig, rank: int | None = None) -> None:
        self.model, self.config = model, config
        self.units: list[FSDPUnit] = []
        self.handles: list = []
        self.rank = 0 if rank is None else rank
        self.topology: list | None = None  # every rank's (shard ranks, dp ranks, shard rank) per parameter
        self.step = 0
        self.links_compared = 0
        """All-gather links compared exactly so far (every rank's, as every rank compares them)."""
        self.scatter_margin = 0.0
        """The largest |reduced sum - expected| / bound of a reduce-scatter this rank judged clean."""
        self.moves = AllToAllCheck(model, NAME)
        """The all-to-alls of an expert-parallel model (none elsewhere)."""
        self.taps: list[AllToAllCheck | P2PCheck] = []
        """The attached exact checks of links outside FSDP2 (all-to-all, pipeline send/recv): each
        gives its words to the step's gather (``row``, ``numel``) and judges every rank's (``events``)."""
        self.stage = None  # a pipeline stage's StageInfo
        self.width: int | None = None

    # -- hooks -------------------------------------------------------------------------------
    def attach(self) -> CollectiveCheck:
        if self.handles or self.taps:
            return self
        import torch.distributed as dist

        self.units = fsdp_units(self.model)
        if self.moves.active and self.config.all_to_all:
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.taps.append(self.moves.attach(self.rank))
        boundary = boundary_of(self.model)
        self.stage = None if boundary is None else boundary.info
        if boundary is not None and self.config.p2p:
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.device = next(self.model.parameters()).device
            self.taps.append(P2PCheck(boundary, self.rank, boundary.info.rows, self.device).attach())
        if not self.units:
            return self
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.params = [(u, gp) for u in self.units for gp in u.params]
        self.index = {id(gp): i for i, (_, gp) in enumerate(self.params)}
        self.S = max(gp.size for _, gp in self.params)
        self.device = self.params[0][1].fp.sharded_param.device
        if self.config.all_gather or self.config.reduce_scatter:  # (the gradient hooks go on there)
            self.handles += on_gathered(self.units, self._gathered)
        self.grad_hooks: set[int] = set()
        self._reset()
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        for tap in self.taps:
            tap.detach()
        self.handles, self.taps = [], []
        for _, gp in getattr(self, "params", ()):
            handle = getattr(gp, "grad_hook", None)
            if handle is not None:
                handle.remove()
                gp.grad_hook = None
        self.grad_hooks = set()

    @property
    def active(self) -> bool:
        return bool(self.units) or bool(self.taps)

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.units:
            self._reset()
        for tap in self.taps:
            tap.reset()

    def _reset(self) -> None:
        P, S, dev = len(self.params), self.S, self.device
        self.sent = torch.zeros(P, WORDS, dtype=torch.int64, device=dev)
        self.arrived = torch.zeros(len(PASSES), P, S, WORDS, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(len(PASSES), P, dtype=torch.int64, device=dev)
        self.unreduced = torch.zeros(P, S, 2, dtype=torch.float64, device=dev)  # chunk sums, Σ|g|
        self.micro = [0] * P  # micro-batches accumulated
        self.pending: dict[int, tuple] = {}  # an unsharded gradient still accumulating: (ref, its sums)
        self.sent_done = False

    @torch.no_grad()
    def _gathered(self, unit: FSDPUnit, phase: str) -> None:
        k = PASSES.index(phase)
        got = [(self.index[id(gp)], gp, rows) for gp in unit.params if (rows := gp.gathered()) is not None]
        if not got:
            return
        idx = [i for i, _, _ in got]
        if self.config.all_gather:
            self._digest(k, idx, got)
        if not self.config.reduce_scatter:
            return
        for i, gp, _ in got:
            p = gp.unsharded()
            if i not in self.grad_hooks and p is not None and p.requires_grad:
                gp.grad_hook = p.register_post_accumulate_grad_hook(lambda p, i=i, gp=gp: self._unreduced(i, gp, p))
                self.grad_hooks.add(i)

    def _digest(self, k: int, idx: list[int], got: list) -> None:
        """The words of what arrived (and, at the step's first gather, of what this rank sends)."""
        if not self.sent_done:  # what this rank sends: its shards, as at the step's first gather (one pass)
            mine = [(i, gp) for i, (_, gp) in enumerate(self.params) if gp.plain]
            self.sent[[i for i, _ in mine]] = digest_parts([gp.sent().view(1, -1) for _, gp in mine])[0]
            self.sent_done = True
        S = got[0][2].shape[0]
        self.arrived[k, idx, :S] = digest_parts([rows for _, _, rows in got]).transpose(0, 1)
        self.seen[k, idx] = 1

    @torch.no_grad()
    def _unreduced(self, i: int, gp, p: torch.Tensor) -> None:
        """The unreduced gradient's chunk sums (fp64), before FSDP2 reduce-scatters it."""
        g = local(p.grad)
        S = gp.size
        if gp.shard_dim == 0:
            flat = g.reshape(-1)
            pad = S * gp.padded_numel() - flat.numel()
            rows = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(S, -1)
            both = torch.stack([rows, rows.abs()], 1)  # [S, 2, n]: one reduction for both sums
            sums = both.sum(2, dtype=torch.float64)
        else:
            chunks = g.chunk(S, gp.shard_dim)
            sums = torch.stack(
                [torch.stack([c.sum(dtype=torch.float64), c.abs().sum(dtype=torch.float64)]) for c in chunks]
            )
        held = self.pending.get(i)
        if held is not None and held[0]() is g:  # accumulated in place, not reduced in between (a
            self.unreduced[i, :S, :2] -= held[1]  # pipeline schedule reduces at the last micro-batch)
        self.pending[i] = (weakref.ref(g), sums)
        self.unreduced[i, :S, :2] += sums
        self.micro[i] += 1

    # -- the check ---------------------------------------------------------------------------
    @torch.no_grad()
    def check(self, view: CheckView) -> list[Event]:
        if not self.active:
            return []
        parts = [tap.row() for tap in self.taps]
        if self.units:
            if self.topology is None:
                self._learn_topology()
            parts += [
                self.sent.flatten(),
                self.arrived.flatten(),
                self.seen.flatten(),
                self.unreduced.flatten().view(torch.int64),
            ]
        row = torch.cat([p.to(parts[0].device) for p in parts])
        if self.stage is not None:  # pipeline stages hold different units: rows padded to the longest
            width = self._width(row.numel())
            row = torch.cat([row, row.new_zeros(width - row.numel())])
        table = torch.stack(World("sharded", self.rank, self.size).gather(row)).cpu()  # the step's one host read
        events = []
        for tap in self.taps:
            words, table = table.split([tap.numel, table.shape[1] - tap.numel], 1)
            events += tap.events(view.step, words)
        if not self.units:
            return events
        W, P, S = self.size, len(self.params), self.S
        sizes = [P * WORDS, len(PASSES) * P * S * WORDS, len(PASSES) * P, P * S * 2]
        table = table[:, : sum(sizes)].clone()
        table[[r for r in range(W) if r not in self.peers]] = 0  # another stage's units: not compared
        sent, arrived, seen, unreduced = table.split(sizes, 1)
        if self.config.all_gather:
            shapes = (W, len(PASSES), P, S, WORDS)
            events += self._all_gather_events(
                view.step, sent.view(W, P, WORDS), arrived.view(shapes), seen.view(W, -1, P)
            )
        if self.config.reduce_scatter:
            events += self._reduce_scatter_events(
                view.step, unreduced.contiguous().view(torch.float64).view(W, P, S, 2)
            )
        return events

    def _width(self, n: int) -> int:
        """The longest row of any rank (once: a collective)."""
        if self.width is None:
            import torch.distributed as dist

            longest = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            self.width = int(longest)
        return self.width

    def _learn_topology(self) -> None:
        """Every rank's shard group and reduction group of each parameter (once: a collective).
        In a pipeline only the ranks of this rank's stage hold the same units (``peers``)."""
        import torch.distributed as dist

        mine = [(u.shard_ranks, u.dp_ranks, u.shard_rank) for u, _ in self.params]
        self.topology = [None] * self.size
        dist.all_gather_object(self.topology, mine)
        info = self.stage
        self.peers = list(range(self.size)) if info is None else [info.rank_of(info.stage, d) for d in range(info.dp)]
        W, P, S = self.size, len(self.params), self.S
        self.src = torch.full((W, P, S), -1, dtype=torch.int64)  # the sender of each slot of what arrived
        for r in self.peers:
            for i, (shard_ranks, _, _) in enumerate(self.topology[r]):
                self.src[r, i, : len(shard_ranks)] = torch.tensor(shard_ranks)
        self.valid = self.src >= 0
        self.slot = (self.src.clamp(min=0), torch.arange(P).view(1, P, 1).expand(W, P, S))
        # this rank's reduced shards: chunk k of every rank it reduces over, divided as FSDP2 divides
        own = self.topology[self.rank]
        self.chunk = torch.tensor([k for _, _, k in own])
        self.over = torch.zeros(W, P, dtype=torch.float64)
        for i, (_, dp_ranks, _) in enumerate(own):
            self.over[dp_ranks, i] = 1.0
        self.factor = torch.tensor([u.divide_factor() for u, _ in self.params], dtype=torch.float64)
        sharded = [gp.fp.sharded_param for _, gp in self.params]
        us = [
            max(unit_roundoff(d) for d in (p.dtype, gp.fp.reduce_dtype or p.dtype))
            for p, (_, gp) in zip(sharded, self.params)
        ]
        self.units_u = torch.tensor(us, dtype=torch.float64)
        self.summands = self.over.sum(0)
        self.floor = torch.tensor([local(p).numel() * torch.finfo(p.dtype).tiny for p in sharded], dtype=torch.float64)

    def _all_gather_events(self, step, sent, arrived, seen) -> list[Event]:
        expected = sent[self.slot]  # [W, P, S, 2]: the sender's words of each slot
        links, got, want = [], [], []
        for k, phase in enumerate(PASSES):
            mask = self.valid & seen[:, k].bool().unsqueeze(-1)
            self.links_compared += int(mask.sum())
            bad = mask & (arrived[:, k] != expected).any(-1)
            for r, i, s in bad.nonzero().tolist():
                links.append(self._link(phase, int(self.src[r, i, s]), r, i, s))
                got.append(arrived[r, k, i, s])
                want.append(expected[r, i, s])
        if not links:
            return []
        found = compare(links, torch.stack(want), torch.stack(got))
        names = {gp.name: i for i, (_, gp) in enumerate(self.params)}
        receivers = {}
        for m in found:
            i, k = names[m.link.tensor], PASSES.index(m.link.phase)
            receivers[(m.link.collective, m.link.phase, m.link.tensor, m.link.src)] = [
                r for r in range(self.size) if seen[r, k, i] and m.link.src in self.topology[r][i][0]
            ]
        localize(found, receivers)
        events = []
        for m in found:
            if m.link.dst != self.rank:
                continue  # every rank found it; the rank it arrived on reports it
            link = m.link
            suspect = m.suspects[0] if m.suspect == "sender" else link.dst
            log.warning("all-gather link %s corrupted: %s (%s, suspect %s)", link, link.tensor, link.phase, m.suspect)
            events.append(Event(step, NAME, "mismatch", module=link.tensor, rank=suspect, evidence=m.evidence()))
        return events

    def _link(self, phase: str, src: int, dst: int, i: int, s: int) -> Link:
        _, gp = self.params[i]
        return Link("all_gather", src, dst, gp.name, phase, gp.source_range(s), gp.shard_dim)

    def _reduce_scatter_events(self, step, unreduced) -> list[Event]:
        """Each rank judges the reduced shards that arrived on it (see the module docstring)."""
        grads = [(i, gp.fp.sharded_param.grad) for i, (_, gp) in enumerate(self.params)]
        grads = [(i, local(g)) for i, g in grads if g is not None]
        if not grads:
            return []
        idx = torch.tensor([i for i, _ in grads])
        got = torch.stack([g.sum(dtype=torch.float64) for _, g in grads]).cpu()
        P = len(self.params)
        chunks = unreduced[:, torch.arange(P), self.chunk]  # [W, P, 2]: every rank's chunk of ours
        totals = (chunks * self.over.unsqueeze(-1)).sum(0) / self.factor.unsqueeze(-1)
        expected, magnitude = totals[idx, 0], totals[idx, 1]
        micro = torch.tensor([self.micro[i] for i in idx.tolist()], dtype=torch.float64)
        tol = (self.summands[idx] + 3 + micro) * self.units_u[idx] * magnitude + self.floor[idx]
        residual = (got - expected).abs()
        judged = torch.isfinite(expected + magnitude)  # a non-finite gradient before the reduction: not ours
        ok = judged & (residual <= tol)
        if ok.any():
            self.scatter_margin = max(self.scatter_margin, float((residual[ok] / tol[ok]).max()))
        events = []
        for j in (judged & ~ok).nonzero().flatten().tolist():  # a non-finite reduced shard too
            i = int(idx[j])
            unit, gp = self.params[i]
            start, stop = gp.source_range(int(self.chunk[i]))
            log.warning(
                "reduce-scatter of %s on rank %d off by %.3g (bound %.3g)", gp.name, self.rank, residual[j], tol[j]
            )
            evidence = {
                "collective": "reduce_scatter",
                "dst": self.rank,
                "src": None,
                "sources": self.topology[self.rank][i][1],
                "tensor": gp.name,
                "elements": [start, stop],
                "dim": gp.shard_dim,
                "sum": float(got[j]),
                "expected": float(expected[j]),
                "residual": float(residual[j]),
                "tolerance": float(tol[j]),
            }
            events.append(Event(step, NAME, "mismatch", module=gp.name, rank=self.rank, evidence=evidence))
        return events


register(
    Registration(
        NAME,
        CollectivesConfig,
        lambda model, optimizer, config, rank: CollectiveCheck(model, config, rank=rank),
        recheck=True,
        drain=True,
    )
)
