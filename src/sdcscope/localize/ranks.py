"""Rank localization: which rank, which layer, transient or persistent -- and who keeps failing.

:class:`RankLocalizer` answers a cross-rank alarm the way Megatron's rerun state machine does,
but in-job and without a checkpoint/restart: the suspect rank re-computes its own local gradient
of the step, and healthy **peers** re-compute the suspect's micro-batches (a pure function of
seed, step and rank, see :mod:`sdcscope.engine.dist`). Each replay's per-parameter signatures are
compared with what the suspect sent before the reduction:

=====================  ===================  =====================================================
peers reproduce it      suspect reproduces   verdict
=====================  ===================  =====================================================
a peer does             --                   ``correct_result``: the data says so (not the device)
no (a majority)         yes                  ``persistent``: this device computes it wrong, again
no (a majority)         no                   ``transient``: a one-off fault on this device
no healthy peer         --                   ``unverified``
=====================  ===================  =====================================================

A peer is never a suspect while a healthy rank free of suspicion is left, and with **three or
more** healthy ranks two peers replay each suspect (:func:`~sdcscope.localize.verdicts.replay_peers`):
a faulty peer's replay is then one vote, not a verdict. A suspect is convicted (``persistent``,
``transient``) only by a majority -- two peers free of doubt whose replays agree with each other
and not with what it sent -- or by its own replay not reproducing what it sent; short of that a
clean peer's disagreement is ``unverified`` (a suspicion) and an accusation by peers in doubt
alone is ``cleared`` (:func:`~sdcscope.localize.verdicts.judge_replays`). When a finding about the
world makes every rank a candidate, every other rank is a suspect: the peers are the least
doubtful ones, the event says so (``peers_suspected``), and the majority rule is what keeps a
faulty peer from convicting a healthy rank.

With **two** healthy replicas each one's peer is the other, and a peer's replay is symmetric
evidence: a faulty replayer accuses its healthy peer just as a healthy one accuses a faulty peer.
There (:func:`settle_two_replicas`) rank-local, peer-free evidence decides first -- a finding of a
rank's own ABFT, state checksum or non-finite detector on its own computation
(:func:`own_evidence`), or its own replay not reproducing what it sent. A peer's disagreement
counts only when that peer holds no such evidence against itself; a suspect accused by a doubtful
peer alone is ``cleared`` (its own replay reproduces its gradient and nothing of its own speaks
against it), or ``unverified`` when it holds evidence against itself too. Two replicas whose own
evidence is clean and whose replays accuse each other are ``ambiguous``: which one is faulty
cannot be told, and :class:`~sdcscope.mitigate.quarantine.RankGuard` quarantines neither.

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

import logging
import math
from collections.abc import Callable, Mapping, Sequence
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
from sdcscope.localize.verdicts import (
    NOT_ACCUSED,
    SELF_EVIDENCE,
    VERDICTS,
    Replays,
    judge_replays,
    own_evidence,
    replay_peers,
    settle_two_replicas,
)

__all__ = [
    "LEDGER_FILE",
    "NOT_ACCUSED",
    "SELF_EVIDENCE",
    "SUSPICIONS",
    "VERDICTS",
    "LedgerConfig",
    "LocalizeConfig",
    "RankLedger",
    "RankLocalizer",
    "Replays",
    "device_id",
    "judge_replays",
    "own_evidence",
    "replay_peers",
    "settle_two_replicas",
]

log = logging.getLogger(__name__)


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
    """Replays a suspect rank's step on itself and on peers (a collective: call on every rank)."""

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
        self.plan: dict[int, list[int]] = {}
        """The peers that replay each suspect of the diagnosis under way (set before its first
        replay, the same on every rank): a replay that ships a suspect's batches reads it."""

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
        (e.g. the engine trainer's ``local_gradients``); ``against_self``: each rank's rank-local
        evidence against itself (:func:`own_evidence`): such a rank replays others last and its
        replay is no vote, and with two healthy replicas it decides first
        (:func:`settle_two_replicas`). Each rank replays only what it is a replayer of; the
        signatures travel in one gather."""
        own = {r: list(v) for r, v in (against_self or {}).items() if v}
        self.plan = {s: replay_peers(s, healthy, suspects, own) for s in suspects}
        suspected = sorted({s for s, peers in self.plan.items() if set(peers) & set(suspects)})
        if suspected:
            log.info(
                "rank replay at step %d: no rank free of suspicion is left to replay rank(s) %s; their "
                "peers are suspects too, so only a majority of peers without evidence against "
                "themselves convicts (replays: %s)",
                step,
                suspected,
                self.plan,
            )
        width = 2 * len(self.names)
        slots = 1 + max((len(v) for v in self.plan.values()), default=0)
        row = torch.full((len(suspects) * slots * width,), math.nan, dtype=torch.float64)
        saved = [q.grad for q in self.params]
        try:
            for i, s in enumerate(suspects):
                for j, who in enumerate([s, *self.plan[s]]):
                    if who == self.rank:
                        replay(s)
                        at = (i * slots + j) * width
                        row[at : at + width] = self._signatures(reported.buckets)
        finally:
            for q, g in zip(self.params, saved):
                q.grad = g
        rows = gather_rows(row.to(self.params[0].device), self.group).cpu()

        def replayed(i: int, j: int, who: int) -> torch.Tensor:
            at = (i * slots + j) * width
            return rows[who, at : at + width].view(2, width // 2)

        facts, signatures = [], []
        for i, s in enumerate(suspects):
            sent = torch.stack([reported.norm[s], reported.pre[s]])
            theirs = [replayed(i, 1 + j, p) for j, p in enumerate(self.plan[s])]
            facts.append(
                Replays(
                    s,
                    tuple(self.plan[s]),
                    tuple(not self._differs(sent, t) for t in theirs),
                    None if len(theirs) < 2 else not self._differs(theirs[0], theirs[1]),
                    not self._differs(sent, replayed(i, 0, s)),
                )
            )
            signatures.append((sent, theirs))
        doubt = {r: list(v) for r, v in own.items()}
        for f in facts:
            if not f.self_reproduces:
                doubt.setdefault(f.suspect, []).append("its own replay does not reproduce its gradient")
        results = [
            self._verdict(step, f, sent, theirs, reported, suspects, doubt)
            for f, (sent, theirs) in zip(facts, signatures)
        ]
        if len(healthy) == 2:
            settle_two_replicas(results, own)
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
        f: Replays,
        sent: torch.Tensor,
        theirs: list[torch.Tensor],
        reported: Gathered,
        suspects: Sequence[int],
        doubt: Mapping[int, Sequence[str]],
    ) -> Event:
        """The event of one suspect's verdict (:func:`judge_replays`), with the evidence it rests on."""
        verdict, reason = judge_replays(f, doubt)
        peers = list(f.peers)
        evidence: dict[str, Any] = {"peer": peers[0] if peers else None, "peers": peers, "reported_step": reported.step}
        if not peers:
            return Event(step, self.name, verdict, rank=f.suspect, evidence={**evidence, "reason": reason})
        evidence["self_reproduces"] = f.self_reproduces
        if len(peers) > 1:
            evidence.update(peers_reproduce=list(f.reproduces), peers_agree=f.peers_agree)
            in_doubt = {p: list(doubt[p]) for p in peers if doubt.get(p)}
            if in_doubt:
                evidence["peers_in_doubt"] = in_doubt
        suspected = [p for p in peers if p in suspects]
        if suspected:  # no rank free of suspicion was left to replay it
            evidence["peers_suspected"] = suspected
            evidence["note"] = (
                "too few healthy ranks free of suspicion: its peers are suspects too; a peer's replay "
                "is one vote, a conviction needs two peers without evidence against themselves that agree"
                if len(peers) > 1
                else "its only peer is a suspect too: rank-local evidence decides first"
            )
        if verdict == "correct_result":
            return Event(step, self.name, verdict, rank=f.suspect, evidence={**evidence, "reason": reason})
        witness = next((j for j, p in enumerate(peers) if not doubt.get(p)), 0)
        differ = self._differs(sent, theirs[witness])
        backward = [self.names[k] for k in reversed(differ)]
        if differ:
            k = differ[-1]
            evidence.update(
                params=backward[: self.config.max_listed],
                count=len(differ),
                sent_norm=sent[0, k].item(),
                peer_norm=theirs[witness][0, k].item(),
            )
        convicted = verdict in ("persistent", "transient")
        return Event(
            step,
            self.name,
            verdict,
            module=_module(backward[0]) if differ and convicted else None,
            rank=f.suspect,
            evidence={**evidence, "reason": reason},
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
