"""Rank localization: which rank, which layer, transient or persistent -- and who keeps failing.

:class:`RankLocalizer` answers a cross-rank alarm the way Megatron's rerun state machine does,
but in-job and without a checkpoint/restart: the suspect rank re-computes its own local gradient
of the step, and a healthy **peer** re-computes the suspect's micro-batches (a pure function of
seed, step and rank, see :mod:`sdcscope.engine.dist`). Each
replay's per-parameter signatures are compared with what the suspect sent before the reduction:

=====================  ===================  =====================================================
peer reproduces it      suspect reproduces   verdict
=====================  ===================  =====================================================
yes                     --                   ``correct_result``: the data says so (not the device)
no                      yes                  ``persistent``: this device computes it wrong, again
no                      no                   ``transient``: a one-off fault on this device
no healthy peer         --                   ``unverified``
=====================  ===================  =====================================================

By default the bits decide (each bucket's bit checksum must match: CPU training is
deterministic) and the per-parameter norms name the parameters inside a differing bucket;
``rtol > 0`` compares the norms within a relative tolerance instead (non-deterministic GPU
kernels). The layer is the parameter whose gradient differs first in backward order (the last in
forward order): for a fault in the backward pass, the earliest wrong value; a forward fault shows
up everywhere. A replay assumes a deterministic forward (no dropout, or dropout seeded by step
and rank) and equal replicas (:class:`sdcscope.mitigate.quarantine.RankGuard` checks first).

One replay is not a diagnosis: real SDC devices fail intermittently, and a fault that does not
recur in a single replay is not proof of health. :class:`RankLedger` keeps every
suspicion per **device** (host and device index, not rank) and site in ``ledger.json`` in the
run directory (:mod:`sdcscope.localize.ledger`); a device with one ``persistent`` verdict or
site, or ``max_suspicions`` suspicions within ``window`` steps, is ``faulty``, and a ledger
carried into a later job keeps it so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdcscope.common.validate import check_positive
from sdcscope.detect.events import Event
from sdcscope.detect.signatures import MOD32, Gathered, grad_signatures
from sdcscope.engine.dist import gather_rows
from sdcscope.localize.ledger import LEDGER_FILE, SUSPICIONS, Ledger, LedgerConfig, device_id

__all__ = [
    "LEDGER_FILE",
    "SUSPICIONS",
    "VERDICTS",
    "LedgerConfig",
    "LocalizeConfig",
    "RankLedger",
    "RankLocalizer",
    "device_id",
]

VERDICTS = ("correct_result", "transient", "persistent", "unverified")
"""What :meth:`RankLocalizer.diagnose` can say about a suspect."""


@dataclass(kw_only=True)
class LocalizeConfig:
    rtol: float = 0.0
    """0: a replay must reproduce the gradient bits; > 0: the norms within this relative tolerance."""
    max_listed: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, (int, float)) or not 0 <= self.rtol < 1:
            raise ValueError(f"rtol={self.rtol!r} must be a number in [0, 1)")
        check_positive("max_listed", self.max_listed)


def _module(param: str) -> str:
    return param.rpartition(".")[0] or param


class RankLocalizer:
    """Replays a suspect rank's step on itself and on a peer (a collective: call on every rank)."""

    name = "rank_replay"

    def __init__(
        self, model: nn.Module, config: LocalizeConfig | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.config = config or LocalizeConfig()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    @staticmethod
    def peer(rank: int, healthy: Sequence[int]) -> int | None:
        """The next healthy rank after ``rank`` (cyclically), ``None`` when there is none."""
        others = sorted(r for r in healthy if r != rank)
        after = [r for r in others if r > rank]
        return (after or others)[0] if others else None

    def _signatures(self, buckets: list[list[int]]) -> torch.Tensor:
        """``[norms, bucket checksums]`` of ``.grad``, laid out as the detector sent them."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]  # as in a bucket
        norms, sums = grad_signatures(grads, buckets)
        pre = torch.zeros_like(sums)
        for slots in buckets:
            pre[slots] = sums[slots].sum() % MOD32  # exact: a bucket's checksum is the sum of its parts'
        return torch.cat([norms, pre])

    def diagnose(
        self,
        step: int,
        reported: Gathered,
        suspects: Sequence[int],
        healthy: Sequence[int],
        replay: Callable[[int], None],
    ) -> list[Event]:
        """Verdicts for ``suspects`` at ``step``. ``reported``: the signatures every rank sent;
        ``replay(r)``: recompute rank r's local gradient of this step into ``.grad`` on this rank
        (e.g. :meth:`sdcscope.engine.ddp.DDPTrainer.local_gradients`)."""
        p = len(self.names)
        peers = {s: self.peer(s, healthy) for s in suspects}
        row = torch.full((2 * len(suspects) * 2 * p,), math.nan, dtype=torch.float64)
        saved = [q.grad for q in self.params]
        try:
            for i, s in enumerate(suspects):
                for slot, who in ((2 * i, s), (2 * i + 1, peers[s])):
                    if who == self.rank:
                        replay(s)
                        row[slot * 2 * p : (slot + 1) * 2 * p] = self._signatures(reported.buckets)
        finally:
            for q, g in zip(self.params, saved):
                q.grad = g
        rows = gather_rows(row.to(self.params[0].device), self.group).cpu()
        results = []
        for i, s in enumerate(suspects):
            own = rows[s, 2 * i * 2 * p : (2 * i + 1) * 2 * p].view(2, p)
            peer = None if peers[s] is None else rows[peers[s], (2 * i + 1) * 2 * p : (2 * i + 2) * 2 * p].view(2, p)
            results.append(self._verdict(step, s, peers[s], reported, own, peer))
        return results

    def _differs(self, a: torch.Tensor, b: torch.Tensor) -> list[int]:
        """Parameters whose gradient differs between signatures ``a`` and ``b`` (``[2, P]``)."""
        if self.config.rtol > 0:
            scale = torch.maximum(a[0].abs(), b[0].abs()).clamp_min(1e-300)
            return (~((a[0] - b[0]).abs() <= self.config.rtol * scale)).nonzero().flatten().tolist()
        buckets = a[1] != b[1]  # the bits decide; the norms name the parameters inside the bucket
        if not buckets.any():
            return []
        named = a[0] != b[0]
        return (named if named.any() else buckets).nonzero().flatten().tolist()

    def _verdict(
        self,
        step: int,
        suspect: int,
        peer: int | None,
        reported: Gathered,
        own: torch.Tensor,
        theirs: torch.Tensor | None,
    ) -> Event:
        sent = torch.stack([reported.norm[suspect], reported.pre[suspect]])
        evidence: dict[str, Any] = {"peer": peer, "reported_step": reported.step}
        if theirs is None:
            return Event(
                step,
                self.name,
                "unverified",
                rank=suspect,
                evidence={**evidence, "reason": "no healthy peer to replay on"},
            )
        differ = self._differs(sent, theirs)
        if not differ:
            return Event(
                step,
                self.name,
                "correct_result",
                rank=suspect,
                evidence={**evidence, "reason": "a peer reproduces the gradient: data, not device"},
            )
        backward = [self.names[k] for k in reversed(differ)]
        reproduces = not self._differs(sent, own)
        k = differ[-1]
        evidence.update(
            params=backward[: self.config.max_listed],
            count=len(differ),
            self_reproduces=reproduces,
            sent_norm=sent[0, k].item(),
            peer_norm=theirs[0, k].item(),
        )
        return Event(
            step,
            self.name,
            "persistent" if reproduces else "transient",
            module=_module(backward[0]),
            rank=suspect,
            evidence=evidence,
        )


class RankLedger(Ledger):
    """The :class:`~sdcscope.localize.ledger.Ledger` of a data-parallel job: ranks map to devices
    (``devices[rank]``), written by one rank (``writer``). See :mod:`sdcscope.localize.ledger`
    for the format; ``entries`` carries an earlier job's record over."""

    def __init__(
        self,
        devices: Sequence[str],
        path: str | Path | None = None,
        config: LedgerConfig | None = None,
        *,
        writer: bool = True,
        entries: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(path, config, writer=writer, entries=entries)
        self.devices = list(devices)
        for rank, dev in enumerate(self.devices):
            self.entry(dev, rank)["rank"] = rank

    def record(self, event: Event) -> bool:
        """Note a suspicion of ``event.rank``; True when this made its device faulty."""
        if event.rank is None:
            return False
        return self.note(self.devices[event.rank], event, rank=event.rank).became_faulty

    def faulty(self, rank: int) -> bool:  # type: ignore[override]
        return bool(self.entries[self.devices[rank]]["faulty"])

    def suspicions(self, rank: int) -> list[dict[str, Any]]:
        return list(self.entries[self.devices[rank]]["suspicions"])
