"""In-job mitigation for data-parallel training: veto everywhere, quarantine a rank, roll back.

:class:`RankGuard` composes the cross-rank detectors (:mod:`sdcscope.detect.crossrank`), rank
localization and the device ledger (:mod:`sdcscope.localize.ranks`) on the DDP bucket hook
(:class:`sdcscope.engine.buckets.BucketHook`), and acts without stopping the job:

- **veto** -- a step with any finding is not applied, on *every* rank: each rank computes the
  verdict from the same gathered numbers, so the decision is identical without another message.
  The exception: a gradient outlier that a replay on a peer reproduces for every suspect is the
  data's doing (``correct_result``): it is reported, applied, and its spread is learned.
- **localize first** -- a finding first compares the replicas (a replay on a peer means something
  only on equal replicas; see rollback), then replays the suspects (:class:`RankLocalizer`: on
  themselves and on peers that are no suspects while such ranks are left; with three or more
  healthy ranks a suspect is convicted only by two agreeing peers free of doubt, so a faulty
  replayer cannot convict a healthy rank) and writes the verdicts into the device ledger.
- **quarantine** -- a device the ledger calls faulty (a ``persistent`` verdict, or repeated
  suspicions) is excluded from the gradient average from the next step on: the hook zeroes its
  bucket and every rank divides by the number of healthy ranks. The excluded rank keeps running
  its forward/backward (collectives stay in step; its shard of the data is not learned from) and
  receives the healthy average, so its replica stays bitwise equal to the others. It is left out
  of every test from then on. The last healthy rank is never quarantined, and with three or more
  healthy ranks no step quarantines half of them or more at once (that many convictions leave no
  majority to trust): none is quarantined, they stay faulty in the ledger, and the run stops
  cleanly as with two replicas below.
- **two replicas** -- each is the other's only peer, so a replay accuses symmetrically; rank-local
  evidence decides first (:func:`~sdcscope.localize.ranks.settle_two_replicas`). When it cannot
  -- the two accuse each other (``ambiguous``), or the ledger calls both faulty -- neither is
  quarantined (either may be the healthy one): the step is vetoed, both stay suspects in the
  ledger, and the guard stops the run cleanly (:attr:`RankGuard.stop`, one
  ``quarantine: not_quarantined`` event naming both).
- **rollback** -- when the replica hash check (every ``hash_every`` steps, and on any finding)
  finds replicas that differ (a flipped optimizer moment, a weight, a corrupted post-reduction
  bucket), every rank restores the last state the check verified as identical; the step counter
  and data position move on (the updates since then are lost, not replayed, so a transient fault
  is not met twice). The verified state is one in-memory copy of parameters and optimizer state.

Events go to ``events.jsonl`` in the run directory, written by rank 0 only: every event is a
world verdict (identical on every rank) and names the rank it is about in ``rank``.

The Guard (:class:`sdcscope.guard.Guard` given a DDP model, see :mod:`sdcscope.guard.ranks`)
embeds a RankGuard: it shares its per-rank detectors' findings through :meth:`RankGuard.check`
(``delegate=True``: localized and ledgered here, acted on by the Guard's policy) and writes the
events itself.

Use as an engine callback (``trainer.add_callback(RankGuard(trainer.ddp, trainer.optimizer,
run_dir=...))`` with :class:`~sdcscope.engine.distributed.DistTrainer`) or in a plain loop::

    guard = RankGuard(ddp_model, optimizer, run_dir="run")
    for step in ...:
        guard.begin(step)
        loss = loss_fn(ddp_model, batch); loss.backward()
        guard.check(step, replay=lambda r: my_local_gradients(r))   # on every rank
        if not guard.veto:
            optimizer.step()
        guard.end(step)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.common.io import JsonlWriter
from sdcscope.common.validate import build_config, check_bool
from sdcscope.detect.crossrank import CrossRankConfig, CrossRankDetector, ReplicaHashCheck
from sdcscope.detect.events import Event
from sdcscope.engine.buckets import bucket_hook
from sdcscope.engine.state import TrainState, capture, clone_tree
from sdcscope.localize.ranks import (
    LEDGER_FILE,
    NOT_ACCUSED,
    LedgerConfig,
    LocalizeConfig,
    RankLedger,
    RankLocalizer,
    device_id,
    own_evidence,
)
from sdcscope.observe.eventlog import event_line

log = logging.getLogger(__name__)

LOCALIZABLE = ("nonfinite", "grad_outlier")
"""Cross-rank verdicts about a rank's own computation, which a replay can re-check (a rank's
shared local verdicts -- ABFT and the like -- are re-checked as well)."""
_NESTED = {"crossrank": CrossRankConfig, "localize": LocalizeConfig, "ledger": LedgerConfig}


@dataclass(kw_only=True)
class RankGuardConfig:
    crossrank: CrossRankConfig = field(default_factory=CrossRankConfig)
    localize: LocalizeConfig = field(default_factory=LocalizeConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    hash_every: int = 10
    """Compare parameter and optimizer-state checksums across replicas every N steps (0: off)."""
    replay: bool = True
    """Localize a finding by replaying the suspect's step on itself and on peers."""
    quarantine: bool = True
    """Exclude faulty devices from the gradient average (False: veto and report only)."""
    rollback: bool = True
    """Keep the last verified state in memory and restore it when replicas differ."""

    def __post_init__(self) -> None:
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, build_config(cls, value, f"rank guard {name}"))
            elif not isinstance(value, cls):
                raise TypeError(f"rank guard {name} must be a mapping or {cls.__name__}, got {value!r}")
        if isinstance(self.hash_every, bool) or not isinstance(self.hash_every, int) or self.hash_every < 0:
            raise ValueError(f"hash_every={self.hash_every!r} must be an integer >= 0 (0: off)")
        for name in ("replay", "quarantine", "rollback"):
            check_bool(name, getattr(self, name))


class RankGuard:
    """Cross-rank detection, localization and in-job quarantine for one DDP model.

    Construct on every rank right after wrapping the model (before the first backward). All of
    :meth:`check` and :meth:`end` are collectives: call them on every rank, every step. Both
    return the world's events (identical on every rank; also kept in :attr:`events`); rank 0
    appends them to ``run_dir/events.jsonl`` unless ``write_events=False`` (a caller that writes
    them itself, e.g. the Guard after its policy). The device ledger is ``ledger`` -- give one
    file shared by a fleet's jobs so a device judged faulty stays out of later jobs -- or else
    ``run_dir/ledger.json``; a device it already calls faulty is quarantined from the start.
    """

    def __init__(
        self,
        ddp: DDP,
        optimizer: torch.optim.Optimizer,
        *,
        config: RankGuardConfig | None = None,
        run_dir: str | Path | None = None,
        ledger: str | Path | None = None,
        write_events: bool = True,
    ) -> None:
        self.config = c = config or RankGuardConfig()
        self.model, self.optimizer = ddp.module, optimizer
        group = ddp.process_group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.hook = bucket_hook(ddp)
        self.detector = CrossRankDetector(self.model, c.crossrank, group)
        self.hook.add(self.detector.signatures)
        self.hashes = ReplicaHashCheck(self.model, optimizer, every=c.hash_every, group=group)
        self.localizer = RankLocalizer(self.model, c.localize, group)
        self.devices: list[Any] = [None] * self.world
        dist.all_gather_object(self.devices, device_id(), group=group)
        path = Path(ledger) if ledger is not None else None if run_dir is None else Path(run_dir) / LEDGER_FILE
        known = [RankLedger.read(path) if self.rank == 0 and path is not None else None]
        dist.broadcast_object_list(known, src=0, group=group)  # one ledger, even without a shared disk
        self.ledger = RankLedger(self.devices, path, c.ledger, writer=self.rank == 0, entries=known[0])
        self.quarantined: set[int] = set()
        self.events: list[Event] = []
        self.verdicts: dict[int, Event] = {}
        self.veto = False
        self.stop: str | None = None
        """Why the rank guard asks the run to stop (None: it does not): ranks it cannot tell apart
        (two replicas, or half the healthy ranks or more convicted at once). The same on every
        rank; a loop ends after the step it was set in."""
        self._writer = (
            JsonlWriter(Path(run_dir) / "events.jsonl")
            if run_dir is not None and self.rank == 0 and write_events
            else None
        )
        if self._writer is not None:
            self._writer.touch()
        self._log_events = write_events and self.rank == 0  # else the caller records (and logs) them
        self.ledger.save()
        self._verified: TrainState | None = capture(self.model, optimizer, 0, 0) if c.rollback else None
        self._emit(
            [
                self._quarantine(0, r, "faulty in the ledger")
                for r in range(self.world)
                if self.ledger.faulty(r) and c.quarantine
            ]
        )

    # -- the per-step protocol ---------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before the forward pass of ``step``."""
        self.veto = False
        self.detector.begin(step)

    def check(
        self,
        step: int,
        *,
        replay: Callable[[int], Any] | None = None,
        local_events: Sequence[Event] | None = None,
        delegate: bool = False,
    ) -> list[Event]:
        """After backward, before the optimizer: the world's verdicts on ``step``; sets :attr:`veto`.

        ``replay(r)`` recomputes rank r's local gradient of this step into ``.grad`` (needed to
        localize); ``local_events``: this rank's own detectors' findings, shared with every rank
        (one more small all-reduce per step; ``None`` when there are no local detectors).
        ``delegate``: the shared local findings are localized and ledgered, but what to do about
        them is the caller's (the Guard's policy): they get no action here, and :attr:`veto`
        answers the cross-rank findings alone. :attr:`verdicts` holds this step's replay
        verdict per rank.
        """
        self.verdicts = {}
        events = self.detector.check(step, local_events)
        if not events:
            return []
        own = [e for e in events if e.detector == self.detector.name]
        desync = self._replicas(step, step)  # a replay on a peer means something only on equal replicas
        verdicts = [] if desync or replay is None or not self.config.replay else self._localize(step, events, replay)
        self.verdicts = {e.rank: e for e in verdicts}
        cleared = {e.rank for e in verdicts if e.verdict in NOT_ACCUSED}
        reproduced = {e.rank for e in verdicts if e.verdict == "correct_result"}
        suspects = {r for e in own for r in ([e.rank] if e.rank is not None else e.evidence.get("candidates", []))}
        natural = (
            bool(own)
            and all(e.verdict == "grad_outlier" for e in own)
            and suspects <= reproduced
            and (delegate or len(own) == len(events))
        )
        if natural:  # every suspect's gradient reproduces on a peer: the data did it; apply the step
            self.detector.learn()
        self.veto = bool(desync) or (bool(own) and not natural) or (not delegate and len(own) < len(events))
        events += [e for e in verdicts if e.verdict not in NOT_ACCUSED] or verdicts
        for e in events:  # delegated: the caller's final decision fills in the rest
            if not delegate or e.detector == self.detector.name:
                e.action = e.action or ("veto" if self.veto else "report")
        events += desync
        events += self._judge(step, [e for e in events if e.rank not in cleared])
        self._emit(events)
        return events

    def verify(self, step: int) -> list[Event]:
        """Compare the replicas now (a collective): after a caller restored a state on every rank."""
        events = self._replicas(step, step)
        events += self._judge(step, events)
        self._emit(events)
        return events

    def end(self, step: int) -> list[Event]:
        """After the update of ``step`` (applied or vetoed): the replica hash check when due."""
        if not self.hashes.due(step + 1):
            return []
        events = self._replicas(step, step + 1)
        events += self._judge(step, events)
        self._emit(events)
        return events

    def _replicas(self, step: int, state_step: int) -> list[Event]:
        """Compare the replicas: equal -- remember this state as verified; different -- restore
        the last verified state on every rank (action ``rollback``)."""
        events = self.hashes.check(step, excluded=sorted(self.quarantined))
        if not events:
            if self.config.rollback:
                self._verified = capture(self.model, self.optimizer, state_step, state_step)
            return []
        if self._verified is not None:
            with torch.no_grad():
                self.model.load_state_dict(self._verified.model)
            self.optimizer.load_state_dict(clone_tree(self._verified.optimizer))
        for e in events:
            e.action = "rollback" if self._verified is not None else "report"
            e.evidence["restored_step"] = None if self._verified is None else self._verified.step
        return events

    # -- engine callback points --------------------------------------------------------------
    def before_step(self, ctx) -> None:
        self.begin(ctx.step)

    def before_optimizer_step(self, ctx) -> None:
        trainer = ctx.trainer
        replay = getattr(trainer, "local_gradients", None)
        self.check(ctx.step, replay=None if replay is None else (lambda r: replay(r, ctx.step, ctx.data_pos)))
        if self.veto:
            ctx.skip_update = True

    def after_step(self, ctx) -> None:
        self.end(ctx.step)
        ctx.metrics["quarantined"] = sorted(self.quarantined)
        if self.stop:  # the run ends after this step, on every rank
            ctx.metrics["stop"] = self.stop

    # -- decisions ---------------------------------------------------------------------------
    def healthy(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.quarantined]

    def _localize(self, step: int, events: list[Event], replay: Callable[[int], Any]) -> list[Event]:
        reported = self.detector.last
        if reported is None or reported.step != step:
            return []  # a step without signatures (sampling): nothing to compare a replay with
        suspects: set[int] = set()
        for e in events:
            if e.detector != self.detector.name or e.verdict in LOCALIZABLE:
                suspects.update([e.rank] if e.rank is not None else e.evidence.get("candidates", []))
        suspects -= self.quarantined
        if not suspects:
            return []
        against_self = own_evidence(events, self.detector.name)
        return self.localizer.diagnose(step, reported, sorted(suspects), self.healthy(), replay, against_self)

    def _judge(self, step: int, events: list[Event]) -> list[Event]:
        """Ledger the suspicions; quarantine the devices that became faulty -- except two replicas
        the evidence cannot tell apart, or half the healthy ranks or more at once (no majority
        left): none is quarantined, and the run stops."""
        faulty: dict[int, str] = {}
        for e in events:
            if e.rank is None or e.rank in self.quarantined:
                continue
            self.ledger.record(e)
            if self.ledger.faulty(e.rank) and e.rank not in faulty:
                faulty[e.rank] = f"{e.detector}: {e.verdict}"
        if not self.config.quarantine:
            return []
        healthy = self.healthy()
        if len(healthy) == 2:
            ambiguous = [e for e in events if e.detector == self.localizer.name and e.verdict == "ambiguous"]
            if ambiguous:
                return [self._stand_down(step, healthy, ambiguous[0].evidence.get("reason", "ambiguous"))]
            if set(healthy) <= set(faulty):
                return [self._stand_down(step, healthy, "the ledger calls both devices faulty")]
        new = sorted(r for r in faulty if r not in self.quarantined)
        if len(healthy) >= 3 and len(new) > 1 and 2 * len(new) >= len(healthy):
            why = (
                f"the ledger calls {len(new)} of {len(healthy)} healthy ranks faulty at once: no "
                "majority of healthy ranks is left to trust"
            )
            return [self._stand_down(step, new, why)]
        return [self._quarantine(step, r, why) for r, why in faulty.items() if r not in self.quarantined]

    def _stand_down(self, step: int, ranks: list[int], why: str) -> Event:
        """Ranks that cannot be told apart (two replicas, or too many convicted at once): quarantine
        none (a healthy one may be among them), keep them as suspects in the ledger, and ask the
        run to stop cleanly."""
        ledger = None if self.ledger.path is None else str(self.ledger.path)
        if len(ranks) == 2:
            which = f"between ranks {ranks[0]} and {ranks[1]}"
            kept = "neither was quarantined (either may be the healthy one), both are suspects in the ledger"
        else:
            which = f"among ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
            kept = "none was quarantined (a healthy rank may be among them), all are suspects in the ledger"
        self.stop = self.stop or (
            f"ambiguous fault {which} at step {step}: {why}; {kept}" + (f" {ledger}" if ledger else "")
        )
        log.error("rank guard: stopping the run: %s", self.stop)
        return Event(
            step,
            "quarantine",
            "not_quarantined",
            action="stop",
            evidence={
                "suspects": list(ranks),
                "devices": [self.devices[r] for r in ranks],
                "why": why,
                "reason": self.stop,
                "ledger": ledger,
            },
        )

    def quarantine(self, step: int, rank: int, reason: str) -> Event:
        """Exclude ``rank`` from the gradient average from the next bucket on (on every rank
        alike: call it everywhere with the same arguments); refused for the last healthy rank."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"cannot quarantine rank {rank!r}; allowed: 0..{self.world - 1}")
        event = self._quarantine(step, rank, reason)
        self._emit([event])
        return event

    def _quarantine(self, step: int, rank: int, reason: str) -> Event:
        evidence = {"device": self.devices[rank], "reason": reason, "suspicions": len(self.ledger.suspicions(rank))}
        if len(self.quarantined) + 1 >= self.world:
            return Event(
                step,
                "quarantine",
                "not_quarantined",
                rank=rank,
                action="report",
                evidence={**evidence, "why": "it is the last healthy rank"},
            )
        self.quarantined.add(rank)
        self.hook.exclude(self.quarantined)
        self.detector.excluded = frozenset(self.quarantined)
        return Event(
            step,
            "quarantine",
            "quarantined",
            rank=rank,
            action="quarantine",
            evidence={**evidence, "healthy": self.healthy()},
        )

    def _emit(self, events: list[Event]) -> None:
        self.events += events
        for e in events:
            record = e.to_dict()
            if self._writer is not None:
                self._writer.write(record)
            if self._log_events:
                log.warning("%s", event_line(record))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
