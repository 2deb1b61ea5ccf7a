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

With **two** healthy replicas each one's peer is the other, and a peer's replay is symmetric
evidence: a faulty replayer accuses its healthy peer just as a healthy one accuses a faulty peer.
There (:func:`settle_two_replicas`) rank-local, peer-free evidence decides first -- a finding of a
rank's own ABFT, state checksum or non-finite detector on its own computation
(:func:`own_evidence`), or its own replay not reproducing what it sent. A peer's disagreement
counts only when that peer holds no such evidence against itself; a suspect accused by a doubtful
peer alone is ``cleared`` (its own replay reproduces its gradient and nothing of its own speaks
against it), or ``unverified`` when it holds evidence against itself too. Two replicas whose own
evidence is clean and whose replays accuse each other are ``ambiguous``: which one is faulty
cannot be told, and :class:`~sdcscope.mitigate.quarantine.RankGuard` quarantines neither. With
three or more replicas the peer is not the only witness and the table stands as it is.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    "own_evidence",
    "settle_two_replicas",
]

VERDICTS = ("correct_result", "transient", "persistent", "unverified", "cleared", "ambiguous")
"""What :meth:`RankLocalizer.diagnose` can say about a suspect (``cleared`` and ``ambiguous`` only
with two healthy replicas: :func:`settle_two_replicas`)."""
NOT_ACCUSED = ("correct_result", "cleared")
"""Verdicts that accuse nobody: the suspect is no suspicion of its device."""
SELF_EVIDENCE = ("abft", "state_checksum", "nonfinite")
"""Detectors whose finding a rank makes on its own computation, without a peer."""


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
        against_self: Mapping[int, Sequence[str]] | None = None,
    ) -> list[Event]:
        """Verdicts for ``suspects`` at ``step``. ``reported``: the signatures every rank sent;
        ``replay(r)``: recompute rank r's local gradient of this step into ``.grad`` on this rank
        (e.g. :meth:`sdcscope.engine.ddp.DDPTrainer.local_gradients`); ``against_self``: each rank's
        rank-local evidence against itself (:func:`own_evidence`), which decides first when two
        healthy replicas are each other's only peer (:func:`settle_two_replicas`)."""
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
        if len(healthy) == 2:
            settle_two_replicas(results, against_self or {})
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
        reproduces = not self._differs(sent, own)
        evidence["self_reproduces"] = reproduces
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
        k = differ[-1]
        evidence.update(
            params=backward[: self.config.max_listed],
            count=len(differ),
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


def own_evidence(events: Iterable[Event], crossrank: str = "crossrank") -> dict[int, list[str]]:
    """Per rank, the rank-local, peer-free findings among ``events`` that speak against its own
    computation: a shared finding of its own ABFT, state checksum or non-finite detector
    (:data:`SELF_EVIDENCE`), or a non-finite gradient of its own before the reduction
    (``crossrank: nonfinite``). A finding about the world (``rank`` None) is no one's."""
    found: dict[int, list[str]] = {}
    for e in events:
        if e.rank is None:
            continue
        if e.detector in SELF_EVIDENCE or (e.detector == crossrank and e.verdict == "nonfinite"):
            where = f" in {e.module}" if e.module else ""
            found.setdefault(e.rank, []).append(f"{e.detector}: {e.verdict}{where}")
    return found


def _settle(e: Event, verdict: str, reason: str) -> None:
    e.evidence = {**e.evidence, "replay_verdict": e.verdict, "reason": reason}
    e.verdict = verdict


def settle_two_replicas(verdicts: Sequence[Event], own: Mapping[int, Sequence[str]]) -> list[Event]:
    """Re-judge ``verdicts`` (:meth:`RankLocalizer.diagnose`'s, one per suspect) of a world of two
    healthy replicas, each the other's peer, in place; ``own``: :func:`own_evidence` of the step.

    A replica is in doubt when it holds rank-local evidence against itself (``own``) or its own
    replay does not reproduce what it sent. A peer's agreement still clears a suspect
    (``correct_result``: two devices computed the same bits), but its disagreement -- an
    accusation -- counts only when the peer is not in doubt; else the suspect's own evidence
    decides: ``transient`` stays (it disagrees with itself), ``unverified`` when it is in doubt by
    its own findings, ``cleared`` when nothing of its own speaks against it. Two ``persistent``
    verdicts left standing mean two clean replicas accusing each other: both ``ambiguous``."""
    doubt = {r: list(v) for r, v in own.items() if v}
    for e in verdicts:
        if e.rank is not None and e.evidence.get("self_reproduces") is False:
            doubt.setdefault(e.rank, []).append("its own replay does not reproduce its gradient")
    for e in verdicts:
        peer = e.evidence.get("peer")
        if e.verdict not in ("persistent", "transient") or peer is None or not doubt.get(peer):
            continue
        e.evidence = {**e.evidence, "peer_in_doubt": list(doubt[peer])}
        if e.evidence.get("self_reproduces") is False:
            continue  # transient: its own replay disagrees with what it sent, no peer needed
        if own.get(e.rank):
            _settle(e, "unverified", "its only peer holds evidence against itself: no trusted replay")
        else:
            _settle(
                e,
                "cleared",
                "accused only by a peer in doubt; its own replay reproduces its gradient and no "
                "detector of its own found anything",
            )
    accused = [e for e in verdicts if e.verdict == "persistent"]
    if len(accused) == 2 and {e.evidence.get("peer") for e in accused} == {e.rank for e in accused}:
        for e in accused:
            _settle(
                e,
                "ambiguous",
                "two replicas accuse each other: each one's replay of the other disagrees, each "
                "reproduces its own gradient and neither holds evidence against itself",
            )
    for e in verdicts:
        if own.get(e.rank):
            e.evidence = {**e.evidence, "own_evidence": list(own[e.rank])}
    return list(verdicts)


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
