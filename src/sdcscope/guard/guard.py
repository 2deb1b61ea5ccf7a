"""The Guard: observe, detect and mitigate SDC inside any PyTorch training loop.

Plain loop::

    guard = Guard(model, optimizer, GuardConfig(), run_dir="run", loss_fn=loss_fn).attach()
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        guard.optimizer_step(loss, before_step=clip)  # checks, maybe replays, then steps (or not)

The Guard composes the detectors, the mitigations and the event files; every driver -- this plain
loop, the engine callback, the HF and Lightning adapters, the rank guard -- runs the one step
protocol of :class:`~sdcscope.guard.session.StepSession` (``guard.session``). ``docs/guard.md``
covers gradient accumulation (``step_fn``), GradScaler, DDP and the policy.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sdcscope.common.io import JsonlWriter
from sdcscope.common.world import world_of
from sdcscope.detect import Event
from sdcscope.detect.protocol import Detector, Registration, registered
from sdcscope.detect.state import StateChecksum
from sdcscope.guard.config import GuardConfig
from sdcscope.guard.plainloop import PlainLoop, check_optimizer
from sdcscope.guard.session import StepSession
from sdcscope.guard.world import fit_config, make_side
from sdcscope.localize.ledger import LEDGER_FILE, utc_now
from sdcscope.mitigate import LRBackoff, SnapshotRing, ZClip
from sdcscope.observe import Metrics
from sdcscope.observe.eventlog import event_line

if TYPE_CHECKING:
    from sdcscope.detect import ABFTDetector, NonFiniteDetector, SpikeDetector

log = logging.getLogger(__name__)


class Guard(PlainLoop):
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: GuardConfig | None = None,
        *,
        run_dir: str | Path | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        rank: int | None = None,
        on_event: Callable[[dict], None] | None = None,
        ddp: nn.Module | None = None,
        ledger: str | Path | None = None,
        rank_batch: Callable[[int, int], Any] | None = None,
        stateful: Iterable[Any] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """``run_dir``: events go to ``run_dir/events.jsonl``; ``on_event``: also (or instead)
        to this callable; ``loss_fn(model, batch)``: lets a plain loop's step be replayed
        (forward, then the guard runs ``backward()``). ``step_fn(model, batch)``, instead of
        ``loss_fn``: the whole step's work -- forward and backward of every micro-batch of
        ``batch`` (gradient accumulation) -- returning the step's loss (detached); a replay zeroes
        the gradients and calls it. Either one must use the ``model`` it is given.

        ``ledger``: the device ledger, a file a fleet's jobs may share (default
        ``run_dir/ledger.json``; in one process written once there is a finding).
        Data-parallel: ``ddp`` is the DDP wrapper of ``model`` (or pass the wrapper as ``model``);
        build the Guard on every rank before the first backward. ``rank_batch(rank, step)``: that rank's
        batch of ``step``, so a plain loop's suspect rank can be replayed with ``loss_fn`` (the
        engine's DDP trainer replays by itself).

        ``stateful``: the loop's other training state -- an LR scheduler, any object with
        ``state_dict()`` and ``load_state_dict()`` (a ``GradScaler`` goes to ``scaler``) --
        snapshotted with the model and optimizer and restored with them on a rollback (the
        engine's trainer needs none: it sets each step's learning rate from the step).

        ``scaler``: the plain loop's ``torch.amp.GradScaler`` (mixed precision in fp16). The loop
        runs ``scaler.scale(loss).backward()`` and passes the unscaled ``loss``; the guard does the
        rest in :meth:`optimizer_step`: it unscales the gradients before its checks, treats the
        scaler's overflow (inf/NaN gradients) as the scaler does -- a skipped step, no finding --
        scales the loss of a replay alike, steps through ``scaler.step`` and calls
        ``scaler.update()``; the scaler rolls back with the model. Without it the guard would
        judge every overflow a fault, and a veto would never let the scaler back off."""
        for name, fn in (
            ("loss_fn", loss_fn),
            ("step_fn", step_fn),
            ("rank_batch", rank_batch),
            ("on_event", on_event),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"Guard {name} must be a callable or None, got {fn!r}")
        if loss_fn is not None and step_fn is not None:
            raise ValueError(
                "Guard takes loss_fn or step_fn, not both: loss_fn(model, batch) returns the loss "
                "of one forward pass (the guard runs backward on a replay); step_fn(model, batch) "
                "runs the forward and backward of every micro-batch itself and returns the loss"
            )
        check_optimizer(optimizer)
        stateful = list(stateful)
        if scaler is not None:
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"Guard scaler must be a torch.amp.GradScaler or None, got {scaler!r}")
            stateful += [] if any(obj is scaler for obj in stateful) else [scaler]
        for obj in stateful:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"Guard stateful items need state_dict() and load_state_dict() (an LR scheduler, "
                    f"a GradScaler), got {obj!r}"
                )
        world = world_of(model, ddp, rank=rank)
        model, rank = world.ddp.module if world.ddp is not None else model, world.rank if world.distributed else rank
        config = fit_config(config or GuardConfig(), world.kind)
        if scaler is not None and (why := world.unsupported("guard.scaler")):
            raise ValueError(f"Guard scaler= is not supported in a {world.kind} run: {why}")
        self.world = world
        """The world this guard's model trains in (:mod:`sdcscope.common.world`)."""
        self.model, self.optimizer = model, optimizer
        self.config = c = config or GuardConfig()
        self.loss_fn, self.step_fn, self.rank = loss_fn, step_fn, rank
        self.stateful, self.scaler = stateful, scaler
        self.metrics = Metrics(model, optimizer, c.metrics) if c.metrics else None
        self.detectors: dict[str, Detector] = {}
        """The detectors whose sections are set, by name, in the order they run (:mod:`sdcscope.detect.protocol`)."""
        self.registrations: dict[str, Registration] = {}
        """Their registrations, as registered when this guard was built."""
        for reg in registered():
            section = c.detector_section(reg)
            if section is None:
                continue
            detector = reg.build(model, optimizer, section, rank)
            if not isinstance(detector, Detector):
                raise TypeError(f"detector {reg.name!r}: build returned {detector!r}, which has no check(view)")
            self.detectors[reg.name], self.registrations[reg.name] = detector, reg
        self.state = StateChecksum(model, optimizer, c.state_checksum, rank=rank) if c.state_checksum else None
        self.ring = SnapshotRing(c.snapshots)
        self.backoff = LRBackoff(c.lr_backoff)
        self.zclip = ZClip(c.zclip) if c.zclip else None
        self.invariants = None
        if c.invariants is not None:
            from sdcscope.invariants import InvariantChecker

            self.invariants = InvariantChecker(  # the loop's schedulers and scaler are watched too
                model,
                optimizer,
                c.invariants,
                rank=rank or 0,
                schedulers=[s for s in stateful if isinstance(s, torch.optim.lr_scheduler.LRScheduler)],
                scaler=next((s for s in stateful if isinstance(s, torch.amp.GradScaler)), None),
            )
        self.events: list[dict[str, Any]] = []
        self.skip_batches: set[int] = set()
        lead = not world.distributed or rank == 0  # in a distributed world rank 0 writes the world's events
        self._writer = JsonlWriter(Path(run_dir) / "events.jsonl") if run_dir is not None and lead else None
        self._run_dir, self._rank_writer = run_dir, None
        self._lead, self._started = lead, f"guard-{socket.gethostname()}-{utc_now()}"
        self._ledger_file = (
            Path(ledger) if ledger is not None else None if run_dir is None else Path(run_dir) / LEDGER_FILE
        )
        self.rank_batch = rank_batch
        self._on_event = on_event
        self._attached = self._ever_attached = False
        self.session = StepSession(self)
        """The step protocol every driver uses (:mod:`sdcscope.guard.session`)."""
        self._stop_reason: str | None = None
        if self._writer is not None and world.distributed:
            self._writer.touch()
        self.ranks = make_side(self, world, run_dir=run_dir, ledger=ledger)
        """The world's side of the decision (:mod:`sdcscope.guard.world`)."""

    # -- the built-in detectors ---------------------------------------------------------------
    @property
    def abft(self) -> ABFTDetector | None:
        """The ABFT detector (None: off)."""
        return self.detectors.get("abft")

    @property
    def nonfinite(self) -> NonFiniteDetector | None:
        """The non-finite detector (None: off)."""
        return self.detectors.get("nonfinite")

    @property
    def loss_spike(self) -> SpikeDetector | None:
        """The loss spike detector (None: off)."""
        return self.detectors.get("loss_spike")

    @property
    def grad_spike(self) -> SpikeDetector | None:
        """The gradient-norm spike detector (None: off)."""
        return self.detectors.get("grad_spike")

    # -- lifecycle ---------------------------------------------------------------------------
    def _parts(self) -> list[Any]:
        """What has hooks to attach: the metrics, the detectors that have some, the invariants."""
        parts = [self.metrics, *self.detectors.values(), self.invariants]
        return [p for p in parts if p is not None and hasattr(p, "attach")]

    def attach(self) -> Guard:
        """Start watching; ``run_dir/events.jsonl`` exists from here on (empty on a clean run)."""
        if not self._attached:
            for part in self._parts():
                part.attach()
            if self._writer is not None:
                self._writer.touch()
            self._attached = self._ever_attached = True
        return self

    def ensure_attached(self) -> None:
        """A guard never attached attaches when its first step begins (without its hooks the
        forward would go unchecked); one detached on purpose stays detached."""
        if not self._ever_attached:
            self.attach()

    def detach(self) -> None:
        for part in self._parts():
            part.detach()
        self._attached = False

    def close(self) -> None:
        self.detach()
        if self.config.fleet_history is not None and self._lead and self._ledger_file is not None:
            self.safe(self._record_fleet, "fleet history")
        if self.metrics is not None:
            self.metrics.close()
        if self._writer is not None:
            self._writer.close()
        if self._rank_writer is not None:
            self._rank_writer.close()
        self.ranks.close()

    def _record_fleet(self) -> None:
        """Record this run's ledger in the fleet history (``fleet_history``); once more adds nothing."""
        from sdcscope.localize.history import History, injected_faults, record_ledger, run_id

        run_dir = self._run_dir
        run = run_id(run_dir) if run_dir is not None else self._started  # a plain loop: this guard's life
        injected = run_dir is not None and injected_faults(run_dir)
        written, found = record_ledger(History(self.config.fleet_history), self._ledger_file, run, injected=injected)
        log.info("fleet history %s: %d new of %d record(s) of run %s", self.config.fleet_history, written, found, run)

    def __enter__(self) -> Guard:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.close()

    def callback(self, trainer=None):
        """The engine callback (:class:`~sdcscope.guard.engine.GuardCallback`); with ``trainer``,
        the first rollback target and the reference of the state checksums are taken now, before
        any other callback (an injector) runs."""
        from sdcscope.guard.engine import GuardCallback

        if self.scaler is not None:
            raise ValueError(
                "Guard scaler= is for a plain loop's optimizer_step; the engine's trainer trains without a GradScaler"
            )
        self.attach()
        callback = GuardCallback(self)
        if trainer is not None:
            callback.prime(trainer)
        return callback

    # -- what the loop reads -----------------------------------------------------------------
    @property
    def rolled_back_to(self) -> int | None:
        """The step whose snapshot the last step rolled back to (None: no rollback this step)."""
        return self.session.rolled_back_to

    @property
    def state_verified(self) -> bool:
        """Whether the training state is vouched for: no finding since the last verified snapshot
        is unresolved. A finding whose step was applied without a recompute (reported, let
        pass), or corrupted state that was not rolled back, taints the state until a rollback to a
        snapshot taken before it; one the guard repaired (recompute, veto, rollback) does not.
        Checkpoints record it as their certification."""
        return not self.session.unresolved

    @property
    def stopped(self) -> bool:
        """The guard stopped training: it stalled (``stall_after`` steps without progress) or a
        ``stop`` / single-process ``quarantine`` action answered a persistent fault. Every loop
        that drives the guard ends after this step (the engine's run ends as ``stalled``, the CLI
        exits with ``GUARD_STOPPED``); :attr:`stop_reason` says why."""
        return self.stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why the guard stopped training (None while it has not); a sharded run's rank section
        may stop it too (the same reason on every rank)."""
        return self._stop_reason or self.ranks.stop

    def stop(self, reason: str, *, event: bool = True) -> None:
        """Stop training cleanly with ``reason`` (once): a warning and, with ``event``, a ``guard:
        stopped`` event (a stall has its ``guard: stalled`` one); the loop reads :attr:`stopped`.
        The device ledger names the device."""
        if self._stop_reason is not None:
            return
        self._stop_reason = reason
        log.warning("the guard stops training: %s", reason)
        if not event:
            return
        evidence: dict[str, Any] = {"reason": reason, **self.ranks.stop_evidence()}
        rank = None if self.world.distributed else self.rank  # a world's stop is about no one rank
        self.record(
            Event(self.session.step, "guard", "stopped", rank=rank, evidence=evidence, action="stop"),
            world=True,
            finding=False,
        )

    @property
    def discarded_steps(self) -> int:
        """Steps whose update the guard vetoed or rolled back."""
        return self.session.progress.discarded_steps

    @property
    def stalled(self) -> bool:
        """The last ``stall_after`` steps made no progress: a fault the guard cannot repair (a
        permanent one the replay reproduces, or one that corrupts the weights again after every
        rollback) holds training still. A plain loop should stop (or move the job) rather than
        go on discarding."""
        n = self.config.stall_after
        return n is not None and self.session.progress.idle >= n

    # -- the plain loop's driver -------------------------------------------------------------
    def begin(self, step: int, batch: Any = None) -> None:
        """Before the forward pass of ``step``; ``batch``: all of the step's data (a replay runs it again)."""
        self.session.begin(step, batch)

    @contextlib.contextmanager
    def step(self, step: int, batch: Any = None) -> Iterator[Guard]:
        self.begin(step, batch)
        yield self

    # -- events and failures -----------------------------------------------------------------
    def record(self, event: Event, world: bool = False, finding: bool = True) -> None:
        """Write ``event`` (after the action it names). ``world``: a verdict every rank holds alike
        (under DDP rank 0 writes it, and only these count toward the snapshot decision, which must
        be the same on every rank); ``finding``: False for the guard's reports about itself (its
        internal errors, a stall), which do not hold its next snapshot back."""
        record = event.to_dict()
        self.events.append(record)
        if finding:  # see state_verified
            self.session.judge_finding(event)
        distributed = self.world.distributed
        if not distributed or world:
            self.session.events += 1
            self.session.findings += finding
        writer = self._writer
        if distributed and not world and self.rank != 0 and self._run_dir is not None:
            if self._rank_writer is None:  # this rank's own report, outside the world verdict
                self._rank_writer = JsonlWriter(Path(self._run_dir) / f"events.rank{self.rank}.jsonl")
            writer = self._rank_writer
        if writer is not None:
            writer.write(record)
        if not world or not distributed or self.rank == 0:  # a world verdict: one line, from rank 0
            log.warning("%s", event_line(record))
        if self.metrics is not None:
            self.metrics.event(record)
        if self._on_event is not None:
            self._on_event(record)

    def internal_error(self, where: str, exc: BaseException) -> None:
        """The guard's own failure: an event (``guard:internal_error``), or raised under ``strict``."""
        if self.config.strict:
            raise exc
        evidence = {"where": where, "error": repr(exc), "trace": traceback.format_exc(limit=3)}
        self.record(
            Event(self.session.step, "guard", "internal_error", rank=self.rank, evidence=evidence, action="report"),
            finding=False,
        )

    def safe(self, fn: Callable[[], Any], where: str, default: Any = None):
        """``fn()``, its failure turned into :meth:`internal_error` (then ``default``, or [])."""
        try:
            return fn()
        except Exception as exc:
            self.internal_error(where, exc)
            return [] if default is None else default
