"""The Guard across data-parallel ranks: each rank checks its own computation, the world decides once.

Under DDP -- ``Guard(ddp_model, optimizer, config, run_dir=...)`` in a torchrun script, or
``sdcscope train --nproc N --guard`` -- each rank's Guard runs its own detectors on what that
rank computed: non-finite values, ABFT checksums of the GEMMs it ran, spikes of its own loss,
checksums of its own weights and optimizer state. A
:class:`~sdcscope.mitigate.quarantine.RankGuard` (settings: ``GuardConfig.ranks``) adds what only
the world sees: gradient signatures taken before the all-reduce, replica hashes, rank
localization by replay, the device ledger and quarantine.

Per step, on every rank (collectives: a rank must never skip one):

1. **begin** -- the signature stage of the DDP comm hook is armed for the step.
2. **decide** -- this rank's findings are shared with every rank (one small all-reduce of a count,
   an object gather only when there is something to share); the cross-rank tests run on the
   signatures that travelled with the gradients. Any finding triggers a replica check and a
   replay of each suspect's micro-batches on the suspect and on a healthy peer
   (:class:`~sdcscope.localize.ranks.RankLocalizer`). A replay is local -- no collective -- so it
   runs only where it is needed, and its result travels in one gather. Each shared finding takes
   its verdict from that replay (``transient``; ``reproducible`` when the peer reproduces it or
   the suspect repeats it; ``unverified`` without a replay), the Guard's policy turns verdicts
   into actions, and since every rank holds the same findings and verdicts, every rank takes the
   same actions. A finding that every rank made alike (in the all-reduced gradient) is one
   finding about the world: the replays of every rank decide whose it is, if anyone's. With two
   healthy ranks a rank's own findings decide before a peer's replay
   (:func:`~sdcscope.localize.ranks.settle_two_replicas`); two ranks that accuse each other
   (``ambiguous``) are both left in the average, and the guard stops the run cleanly
   (:attr:`Guard.stop_reason <sdcscope.guard.Guard.stop_reason>`, a ``guard: stopped`` event)
   rather than quarantine a rank that may be the healthy one.
3. **end** -- after the update (or the veto): the replica hash check when due, and at once after
   the Guard rolled back.

Actions behave as in one process -- ``veto``, ``skip_batch``, ``lr_backoff``, ``rollback`` (the
snapshot ring, restored on every rank and then verified by a replica check), and ``quarantine``
(the finding's rank leaves the gradient average from the next step) -- except ``recompute``,
which becomes ``veto``: the clean re-execution is a local replay of one rank's shard, not a
world step; and a ``rollback`` on a step whose replicas the rank guard already restored is a
``veto`` too. Every event names the rank it is about; rank 0 writes the world's events to
``events.jsonl``; a rank's own reports outside the world verdict (the guard's internal errors)
go to ``events.rank{r}.jsonl``, written by that rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.detect import Event
from sdcscope.guard.actions import PRIORITY
from sdcscope.guard.config import GuardConfig
from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig

RANK_DETECTORS = ("crossrank", "rank_replay", "replica_hash", "quarantine")
"""Detectors of the rank guard itself: it has decided about their findings already."""
TO_GUARD = {
    "transient": "transient",
    "persistent": "reproducible",
    "correct_result": "reproducible",
    "unverified": "unverified",
    "cleared": "unverified",
    "ambiguous": "unverified",
}
"""A rank replay verdict as the Guard's policy knows replay verdicts."""
WHY = {
    "persistent": "the fault acted again on re-execution: a persistent fault",
    "correct_result": "a peer reproduces it: the data or the optimization, not the hardware",
    "ambiguous": "two replicas accuse each other and neither holds evidence against itself: "
    "which one is faulty cannot be told",
}


def check_distributed(config: GuardConfig, model: nn.Module, ddp: DDP, rank: int | None) -> int:
    """Validate a Guard for a DDP model; return this process's rank in the DDP's group."""
    if not isinstance(ddp, DDP):
        raise TypeError(f"ddp must be a torch DistributedDataParallel module, got {type(ddp).__name__}")
    if model is not ddp.module:
        raise ValueError(
            "under DDP the guard watches the wrapped module: pass ddp.module as model (or the "
            "DDP module itself as model and leave ddp out)"
        )
    check_config(config)
    own = dist.get_rank(ddp.process_group)
    if rank is not None and rank != own:
        raise ValueError(f"rank={rank!r} is not this process's rank {own} in the DDP process group")
    return own


def check_config(config: GuardConfig) -> None:
    """Raise ValueError for guard settings that cannot run under DDP (before a world exists)."""
    if config.ranks is None:
        raise ValueError(
            "guard ranks: null cannot watch a data-parallel run: every rank must take the same "
            "decision, which the ranks section provides; give ranks: {} for the defaults"
        )
    if config.invariants is not None:
        raise ValueError(
            "guard invariants are not supported in data-parallel runs yet; drop --invariants "
            "(or invariants:) or train with --nproc 1"
        )
    if config.qk_clip is not None:
        raise ValueError(
            "guard qk_clip is not supported in data-parallel runs: each rank sees only its own "
            "attention logits, and rescaling on some ranks would split the replicas; set qk_clip: null"
        )


class GuardRanks:
    """The Guard's rank section: a :class:`RankGuard` plus the shared, identical decision."""

    def __init__(
        self, guard: Any, ddp: DDP, config: RankGuardConfig, *, run_dir: str | Path | None, ledger: str | Path | None
    ) -> None:
        self.guard = guard
        self.rank_guard = RankGuard(
            ddp, guard.optimizer, config=config, run_dir=run_dir, ledger=ledger, write_events=False
        )
        self.rank, self.world = self.rank_guard.rank, self.rank_guard.world
        for e in self.rank_guard.events:  # devices the ledger already calls faulty
            guard.record(e, world=True)

    @property
    def quarantined(self) -> list[int]:
        return sorted(self.rank_guard.quarantined)

    @property
    def stop(self) -> str | None:
        """Why the rank guard stopped the run (two ranks it cannot tell apart), or None; the same
        on every rank (:attr:`Guard.stop_reason <sdcscope.guard.Guard.stop_reason>` reads it)."""
        return self.rank_guard.stop

    def begin(self, step: int) -> None:
        self.rank_guard.begin(step)

    def decide(
        self, step: int, local: list[Event], replay: Callable[[int], Any] | None
    ) -> tuple[list[str], list[Event], list[Event]]:
        """The world's decision for ``step`` (the same on every rank): ``(actions, most decisive
        first; the world's findings; the events of the quarantines taken)``, recorded by the
        session once it has acted. ``local``: this rank's findings; ``replay(r)``: recompute rank
        r's local gradient of this step into ``.grad``, without collectives."""
        g, s = self.guard, self.guard.session
        stopped = self.stop
        replayed: list[int] = []
        own_buffers: list = []  # this rank's buffers after its own forward pass of the step

        def replay_here(r: int) -> Any:
            if not replayed:
                own_buffers.extend(s.buffer_values())
            replayed.append(r)
            s.restore_buffers()  # each replay starts from the step's buffers, as its rank did
            return replay(r)

        events = self.rank_guard.check(
            step,
            replay=replay_here if replay is not None and g.config.replay else None,
            local_events=local,
            delegate=True,
        )
        if replayed:
            s.restore_buffers(own_buffers)
            if g.abft is not None:  # the replays' GEMM checks are no finding of this step
                g.safe(lambda: g.abft.check(step), "abft")
        restored = any(e.action == "rollback" for e in events)
        actions = ["veto"] if self.rank_guard.veto else []
        extra: list[Event] = []
        for e in events:
            if e.detector in RANK_DETECTORS:
                continue
            if e.detector != "state_checksum":
                self._replay_verdict(e)
            chosen = []
            for a in g.config.policy.actions_for(e.detector, e.verdict):
                if a == "recompute" or (a == "rollback" and restored):
                    a = "veto"
                elif a == "quarantine":  # the rank leaves the average from the next step; this one is void
                    extra += self._quarantine(step, e)
                    chosen += [] if "quarantine" in chosen else ["quarantine"]
                    a = "veto"
                chosen += [a] if a not in chosen else []
            e.action = ", ".join(chosen)
            actions += [a for a in chosen if a not in actions and a in PRIORITY]
        if self.stop and not stopped:  # neither rank quarantined: the step is void, the run ends
            actions += [] if "veto" in actions or "rollback" in actions else ["veto"]
            ledger = self.rank_guard.ledger.path
            evidence = {"reason": self.stop, "ledger": None if ledger is None else str(ledger)}
            extra.append(Event(step, "guard", "stopped", rank=None, evidence=evidence, action="stop"))
        if "rollback" in actions and g.ring.latest() is None:
            actions.remove("rollback")
            actions += [] if "veto" in actions else ["veto"]
        final = "veto" if "veto" in actions or "rollback" in actions else "report"
        for e in events:
            e.action = e.action or final
        return sorted(actions, key=PRIORITY.index), events, extra

    def _replay_verdict(self, e: Event) -> None:
        """Replace a shared finding's verdict with its replay verdict (the finding moves to the
        evidence); a world finding takes the rank its replays blame, when exactly one."""
        ranks = [e.rank] if e.rank is not None else list(e.evidence.get("candidates", []))
        got = {r: self.rank_guard.verdicts[r].verdict for r in ranks if r in self.rank_guard.verdicts}
        for kind in ("transient", "persistent", "ambiguous"):
            blamed = [r for r, v in got.items() if v == kind]
            if blamed:
                break
        else:
            kind = (
                "correct_result"
                if ranks and len(got) == len(ranks) and all(v == "correct_result" for v in got.values())
                else "unverified"
            )
            blamed = []
        replay: dict[str, Any] = {"verdict": TO_GUARD[kind], "ranks": got}
        if kind in WHY:
            replay["evidence"] = WHY[kind]
        e.evidence = {**e.evidence, "finding": e.verdict, "replay": replay}
        e.verdict = TO_GUARD[kind]
        if e.rank is None and len(blamed) == 1 and kind != "ambiguous":
            e.rank = blamed[0]

    def _quarantine(self, step: int, e: Event) -> list[Event]:
        if e.rank is None or e.rank in self.rank_guard.quarantined:
            return []
        return [self.rank_guard.quarantine(step, e.rank, f"policy: {e.detector}: {e.verdict}")]

    def end(self, step: int, *, verify: bool = False) -> None:
        """After the update of ``step``: the replica hash check when due; ``verify``: now (after a
        rollback of the Guard's own)."""
        events = self.rank_guard.verify(step) if verify else self.rank_guard.end(step)
        for e in events:
            self.guard.record(e, world=True)

    def close(self) -> None:
        self.rank_guard.close()
