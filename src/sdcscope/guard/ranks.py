"""The Guard across data-parallel ranks: each rank checks its own computation, the world decides once.

Under DDP -- ``Guard(ddp_model, optimizer, config, run_dir=...)`` in a torchrun script, or
``sdcscope train --nproc N --guard`` -- each rank's Guard runs its own detectors on what that
rank computed: non-finite values, ABFT checksums of the GEMMs it ran, spikes of its own loss,
checksums of its own weights and optimizer state. A
:class:`~sdcscope.mitigate.quarantine.RankGuard` (settings: ``GuardConfig.ranks``) adds what only
the world sees: gradient signatures taken before the all-reduce, replica hashes, rank
localization by replay, the device ledger and quarantine.

In the one decision loop (:meth:`StepSession.decide <sdcscope.guard.session.StepSession.decide>`)
this side supplies, per step and on every rank (collectives: a rank must never skip one):

1. **begin** -- the signature stage of the DDP comm hook is armed for the step.
2. **share** -- this rank's findings are shared with every rank (one small all-reduce of a count,
   an object gather only when there is something to share); the cross-rank tests run on the
   signatures that travelled with the gradients. Any finding triggers a replica check and a replay
   of each suspect's micro-batches on the suspect and on peers free of suspicion (two from three
   ranks on, whose agreement alone convicts: a faulty peer is one vote;
   :class:`~sdcscope.localize.ranks.RankLocalizer`, :mod:`sdcscope.localize.verdicts`). A replay
   is local -- no collective -- so it runs only where it is needed, and its result travels in one
   gather. Each shared finding takes its verdict from that replay (``transient``; ``reproducible``
   when a peer reproduces it or the suspect repeats it; ``unverified`` without a replay), the
   Guard's policy turns verdicts into actions, and since every rank holds the same findings and
   verdicts, every rank takes the same actions. A finding that every rank made alike (in the
   all-reduced gradient) is one finding about the world: the replays of every rank decide whose it
   is, if anyone's. With two healthy ranks a rank's own findings decide before a peer's replay
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

from pathlib import Path
from typing import Any

from sdcscope.common.world import World
from sdcscope.detect import Event
from sdcscope.guard.world import WorldSide
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


class GuardRanks(WorldSide):
    """The Guard's data-parallel side: a :class:`RankGuard` shares, localizes and quarantines."""

    decided = RANK_DETECTORS

    def __init__(
        self,
        guard: Any,
        world: World,
        config: RankGuardConfig,
        *,
        run_dir: str | Path | None,
        ledger: str | Path | None,
    ) -> None:
        super().__init__(guard, world)
        self.rank_guard = RankGuard(
            world.ddp, guard.optimizer, config=config, run_dir=run_dir, ledger=ledger, write_events=False
        )
        self.rank, self.size = self.rank_guard.rank, self.rank_guard.world
        self.restored = False  # this step's replicas were restored by the rank guard
        self.quarantine_events: list[Event] = []  # this step's quarantines, recorded once acted on
        for e in self.rank_guard.events:  # devices the ledger already calls faulty
            guard.record(e, world=True)

    @property
    def quarantined(self) -> list[int]:
        return sorted(self.rank_guard.quarantined)

    @property
    def stop(self) -> str | None:
        """Why the rank guard stopped the run (two ranks it cannot tell apart), or None; the same
        on every rank."""
        return self.rank_guard.stop

    def begin(self, step: int) -> None:
        self.rank_guard.begin(step)

    def own_overflow(self, sq: Any) -> bool:
        return False  # the rank guard's pre-reduction signatures, overflow-safe, name the rank

    def share(self, session: Any, events: list[Event], rank_replay: Any) -> list[Event]:
        """Every rank's findings and the cross-rank tests, each suspect replayed on itself and on a
        healthy peer (``rank_replay(r)``: rank r's local gradient of this step, no collectives)."""
        g, step = self.guard, session.step
        replayed: list[int] = []
        own_buffers: list = []  # this rank's buffers after its own forward pass of the step

        def replay_here(r: int) -> Any:
            if not replayed:
                own_buffers.extend(session.buffer_values())
            replayed.append(r)
            session.restore_buffers()  # each replay starts from the step's buffers, as its rank did
            return rank_replay(r)

        shared = self.rank_guard.check(
            step,
            replay=replay_here if rank_replay is not None and g.config.replay else None,
            local_events=events,
            delegate=True,
        )
        if replayed:
            session.restore_buffers(own_buffers)
            if g.abft is not None:  # the replays' GEMM checks are no finding of this step
                g.safe(lambda: g.abft.check(step), "abft")
        self.restored = any(e.action == "rollback" for e in shared)
        return shared

    def replay(self, session: Any, events: list[Event], loss: Any, rerun: Any) -> Any:
        """The rank replays ran while sharing: each finding takes its rank's replay verdict."""
        for e in events:
            if e.detector not in RANK_DETECTORS and e.detector != "state_checksum":
                self._replay_verdict(e)
        return loss

    def translate(self, session: Any, e: Event, chosen: list[str]) -> list[str]:
        """``recompute`` is a ``veto`` (the clean re-execution is one rank's shard, not a world
        step), so is a ``rollback`` of replicas the rank guard restored; ``quarantine`` leaves the
        rank out of the average from the next step and vetoes this one."""
        out: list[str] = []
        for a in chosen:
            if a == "recompute" or (a == "rollback" and self.restored):
                a = "veto"
            elif a == "quarantine":
                self.quarantine_events += self._quarantine(session.step, e)
                out += [] if "quarantine" in out else ["quarantine"]
                a = "veto"
            out += [a] if a not in out else []
        return out

    def conclude(self, session: Any, actions: list[str], events: list[Event]) -> list[Event]:
        """The cross-rank findings' veto; the rank guard's own events keep their actions, the
        others default to what the step did."""
        if self.rank_guard.veto and "veto" not in actions:
            actions.append("veto")
        final = "veto" if "veto" in actions or "rollback" in actions else "report"
        for e in events:
            e.action = e.action or final
        extra, self.quarantine_events = self.quarantine_events, []
        return extra

    def stop_evidence(self) -> dict[str, Any]:
        path = self.rank_guard.ledger.path
        return {"ledger": None if path is None else str(path)}

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
