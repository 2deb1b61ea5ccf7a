"""Online checks of FSDP2's collectives: the parameter all-gathers exactly, the gradient
reduce-scatters against a rounding bound.

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

The words travel in the same one gather, once per step: one host read, no other sync. A model
without FSDP2 units has nothing to check (:data:`~sdcscope.common.world.SUPPORT`
``guard.collectives``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from sdcscope.common.fsdp import PASSES, FSDPUnit, fsdp_units, on_gathered
from sdcscope.common.validate import check_bool
from sdcscope.common.world import local
from sdcscope.detect.events import Event
from sdcscope.detect.links import WORDS, Link, compare, digest, digest_rows, localize
from sdcscope.detect.protocol import CheckView, Registration, register
from sdcscope.detect.rounding import unit_roundoff

log = logging.getLogger("sdcscope.detect.collectives")

NAME = "collectives"


@dataclass
class CollectivesConfig:
    """Which of FSDP2's collectives are checked each step."""

    all_gather: bool = True
    """The parameter all-gathers (forward, and the backward re-gather), exactly."""
    reduce_scatter: bool = True
    """The gradient reduce-scatters, against their rounding bound."""

    def __post_init__(self) -> None:
        check_bool("collectives all_gather", self.all_gather)
        check_bool("collectives reduce_scatter", self.reduce_scatter)


class CollectiveCheck:
    """The checks of one rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: CollectivesConfig, rank: int | None = None) -> None:
        self.model, self.config = model, config
        self.units: list[FSDPUnit] = []
        self.handles: list = []
        self.rank = 0 if rank is None else rank
        self.topology: list | None = None  # every rank's (shard ranks, dp ranks, shard rank) per parameter
        self.step = 0

    # -- hooks -------------------------------------------------------------------------------
    def attach(self) -> CollectiveCheck:
        if self.handles:
            return self
        import torch.distributed as dist

        self.units = fsdp_units(self.model)
        if not self.units:
            return self
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [(u, gp) for u in self.units for gp in u.params]
        self.index = {id(gp): i for i, (_, gp) in enumerate(self.params)}
        self.S = max(gp.size for _, gp in self.params)
        self.device = self.params[0][1].fp.sharded_param.device
        if self.config.all_gather:
            self.handles += on_gathered(self.units, self._gathered)
        self.grad_hooks: set[int] = set()
        self._reset()
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for _, gp in getattr(self, "params", ()):
            handle = getattr(gp, "grad_hook", None)
            if handle is not None:
                handle.remove()
                gp.grad_hook = None
        self.grad_hooks = set()

    @property
    def active(self) -> bool:
        return bool(self.units)

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.active:
            self._reset()

    def _reset(self) -> None:
        P, S, dev = len(self.params), self.S, self.device
        self.sent = torch.zeros(P, WORDS, dtype=torch.int64, device=dev)
        self.arrived = torch.zeros(len(PASSES), P, S, WORDS, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(len(PASSES), P, dtype=torch.int64, device=dev)
        self.unreduced = torch.zeros(P, S, 3, dtype=torch.float64, device=dev)  # sum, Σ|g|, micro-batches
        self.sent_done: set[int] = set()

    @torch.no_grad()
    def _gathered(self, unit: FSDPUnit, phase: str) -> None:
        k = PASSES.index(phase)
        for gp in unit.params:
            i = self.index[id(gp)]
            rows = gp.gathered()
            if rows is None:
                continue
            if i not in self.sent_done:
                self.sent[i] = digest(gp.sent())
                self.sent_done.add(i)
            self.arrived[k, i, : rows.shape[0]] = digest_rows(rows)
            self.seen[k, i] = 1
            if self.config.reduce_scatter and i not in self.grad_hooks:
                p = gp.unsharded()
                if p is not None and p.requires_grad:
                    gp.grad_hook = p.register_post_accumulate_grad_hook(lambda p, i=i, gp=gp: self._unreduced(i, gp, p))
                    self.grad_hooks.add(i)

    @torch.no_grad()
    def _unreduced(self, i: int, gp, p: torch.Tensor) -> None:
        """The unreduced gradient's chunk sums (fp64), before FSDP2 reduce-scatters it."""
        g = local(p.grad)
        S = gp.size
        if gp.shard_dim == 0:
            flat = g.reshape(-1)
            pad = S * gp.padded_numel() - flat.numel()
            rows = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(S, -1)
            sums, mags = rows.sum(1, dtype=torch.float64), rows.abs().sum(1, dtype=torch.float64)
        else:
            chunks = g.chunk(S, gp.shard_dim)
            sums = torch.stack([c.sum(dtype=torch.float64) for c in chunks])
            mags = torch.stack([c.abs().sum(dtype=torch.float64) for c in chunks])
        self.unreduced[i, :S, 0] += sums
        self.unreduced[i, :S, 1] += mags
        self.unreduced[i, :S, 2] += 1

    # -- the check ---------------------------------------------------------------------------
    @torch.no_grad()
    def check(self, view: CheckView) -> list[Event]:
        if not self.active:
            return []
        import torch.distributed as dist

        if self.topology is None:
            mine = [(u.shard_ranks, u.dp_ranks, u.shard_rank) for u, _ in self.params]
            self.topology = [None] * self.world
            dist.all_gather_object(self.topology, mine)
        P = len(self.params)
        reduced = torch.zeros(P, 2, dtype=torch.float64, device=self.device)  # sum, has a gradient
        if self.config.reduce_scatter:
            grads = [(i, local(gp.fp.sharded_param.grad)) for i, (_, gp) in enumerate(self.params)]
            for i, g in grads:
                if g is not None:
                    reduced[i, 0] = g.sum(dtype=torch.float64)
                    reduced[i, 1] = 1
        ints = [self.sent.flatten(), self.arrived.flatten(), self.seen.flatten()]
        floats = torch.cat([self.unreduced.flatten(), reduced.flatten()])
        row = torch.cat([*ints, floats.view(torch.int64)])
        from sdcscope.common.world import World

        rows = World("sharded", self.rank, self.world).gather(row)
        table = torch.stack(rows).cpu()  # the one host read of the step
        W, S = self.world, self.S
        n_sent, n_arr, n_seen = P * WORDS, len(PASSES) * P * S * WORDS, len(PASSES) * P
        sent = table[:, :n_sent].view(W, P, WORDS)
        arrived = table[:, n_sent : n_sent + n_arr].view(W, len(PASSES), P, S, WORDS)
        seen = table[:, n_sent + n_arr : n_sent + n_arr + n_seen].view(W, len(PASSES), P)
        f = table[:, n_sent + n_arr + n_seen :].contiguous().view(torch.float64)
        unreduced, red = f[:, : P * S * 3].view(W, P, S, 3), f[:, P * S * 3 :].view(W, P, 2)
        events = self._all_gather_events(view.step, sent, arrived, seen) if self.config.all_gather else []
        if self.config.reduce_scatter:
            events += self._reduce_scatter_events(view.step, unreduced, red)
        return events

    def _all_gather_events(self, step, sent, arrived, seen) -> list[Event]:
        W, P, S = self.world, len(self.params), self.S
        src = torch.full((W, P, S), -1, dtype=torch.int64)
        for r in range(W):
            for i, (shard_ranks, _, _) in enumerate(self.topology[r]):
                src[r, i, : len(shard_ranks)] = torch.tensor(shard_ranks)
        valid = src >= 0
        expected = sent[src.clamp(min=0), torch.arange(P).view(1, P, 1).expand(W, P, S)]  # [W, P, S, 2]
        links, got, want = [], [], []
        for k, phase in enumerate(PASSES):
            mask = valid & seen[:, k].bool().unsqueeze(-1)
            bad = mask & (arrived[:, k] != expected).any(-1)
            for r, i, s in bad.nonzero().tolist():
                links.append(self._link(phase, int(src[r, i, s]), r, i, s))
                got.append(arrived[r, k, i, s])
                want.append(expected[r, i, s])
        if not links:
            return []
        found = compare(links, torch.stack(want), torch.stack(got))
        receivers = {}
        for m in found:
            i = next(j for j, (_, gp) in enumerate(self.params) if gp.name == m.link.tensor)
            k = PASSES.index(m.link.phase)
            receivers[(m.link.collective, m.link.phase, m.link.tensor, m.link.src)] = [
                r for r in range(W) if seen[r, k, i] and m.link.src in self.topology[r][i][0]
            ]
        localize(found, receivers)
        events = []
        for m in found:
            if m.link.dst != self.rank:
                continue  # every rank found it; the rank it arrived on reports it
            suspect = m.suspects[0] if m.suspect == "sender" else m.link.dst
            link = m.link
            log.warning("all-gather link %s corrupted: %s (%s, suspect %s)", link, link.tensor, link.phase, m.suspect)
            events.append(Event(step, NAME, "mismatch", module=m.link.tensor, rank=suspect, evidence=m.evidence()))
        return events

    def _link(self, phase: str, src: int, dst: int, i: int, s: int) -> Link:
        _, gp = self.params[i]
        return Link("all_gather", src, dst, gp.name, phase, gp.source_range(s), gp.shard_dim)

    def _reduce_scatter_events(self, step, unreduced, red) -> list[Event]:
        events = []
        r = self.rank  # each rank judges what arrived on it
        for i, (unit, gp) in enumerate(self.params):
            if not red[r, i, 1]:
                continue
            shard_ranks, dp_ranks, k = self.topology[r][i]
            g = gp.fp.sharded_param.grad
            dtypes = [g.dtype] + [d for d in (gp.fp.reduce_dtype,) if d is not None]
            u = max(unit_roundoff(d) for d in dtypes)
            factor = unit.divide_factor()
            rows = unreduced[dp_ranks, i, k]  # [n, 3]
            expected = float(rows[:, 0].sum()) / factor
            magnitude = float(rows[:, 1].sum()) / factor
            micro = float(rows[:, 2].max())
            tol = (len(dp_ranks) + 3 + micro) * u * magnitude + g.numel() * torch.finfo(g.dtype).tiny
            got = float(red[r, i, 0])
            residual = abs(got - expected)
            if not math.isfinite(expected + magnitude):
                continue  # a non-finite gradient before the reduction: the non-finite detector's finding
            if not residual <= tol:  # a non-finite reduced shard fails too
                start, stop = gp.source_range(k)
                log.warning("reduce-scatter of %s on rank %d off by %.3g (bound %.3g)", gp.name, r, residual, tol)
                events.append(
                    Event(
                        step,
                        NAME,
                        "mismatch",
                        module=gp.name,
                        rank=r,
                        evidence={
                            "collective": "reduce_scatter",
                            "dst": r,
                            "src": None,
                            "sources": dp_ranks,
                            "tensor": gp.name,
                            "elements": [start, stop],
                            "dim": gp.shard_dim,
                            "sum": got,
                            "expected": expected,
                            "residual": residual,
                            "tolerance": tol,
                        },
                    )
                )
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
