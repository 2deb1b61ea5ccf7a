"""The Guard: observe, detect and mitigate SDC inside any PyTorch training loop.

Plain loop::

    guard = Guard(model, optimizer, GuardConfig(), run_dir="run", loss_fn=loss_fn).attach()
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        guard.optimizer_step(loss, before_step=clip)  # checks, maybe replays, then steps (or not)

``before_step`` (optional, here ``clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0)``)
is whatever must happen to the gradients between backward and ``optimizer.step()`` -- gradient
clipping, say: the guard runs it on the gradients the update will use, after its checks and any
recompute. A ``GradScaler`` is given to the guard (``scaler=``), which unscales, steps and
updates it itself. Do not clip between the ``with`` block and ``optimizer_step``: the detectors would
see clipped gradients and a recomputed step would lose the clipping.

Gradient accumulation (several forward/backward passes per optimizer step): give
``step_fn(model, batch)`` instead of ``loss_fn`` -- it runs every micro-batch of the step's
``batch`` (forward and backward) and returns the step's loss, detached -- and call it in the loop::

    def step_fn(model, micro_batches):
        total = 0.0
        for mb in micro_batches:
            loss = loss_fn(model, mb) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        return total

    guard = Guard(model, optimizer, GuardConfig(), run_dir="run", step_fn=step_fn).attach()
    for step, micro_batches in enumerate(steps):
        optimizer.zero_grad()
        with guard.step(step, micro_batches):
            loss = step_fn(model, micro_batches)
        guard.optimizer_step(loss, before_step=clip)

A replay zeroes the gradients and calls ``step_fn`` (or ``loss_fn`` + backward) with the batch
given to :meth:`Guard.step`, so that must be all of the step's data.

Engine: ``trainer.add_callback(guard.callback())``.

Data-parallel (DDP, every rank): ``Guard(ddp_model, optimizer, config, run_dir="run",
loss_fn=loss_fn, rank_batch=lambda rank, step: batch_of(rank, step))`` -- each rank checks its
own computation and every rank takes the same decision (:mod:`sdcscope.guard.ranks`).

Per step: the weights and optimizer state are verified against their checksums before the
forward pass; after backward, non-finite values, ABFT checksums of every GEMM and loss /
gradient-norm spikes are checked before the optimizer may step. A detection triggers a replay
of the step from the pre-step state with the same data and RNG: a different result proves a
transient fault (the clean re-run is kept: *recompute*), the same result points at the data or
a persistent fault. The policy table then picks the actions. Every finding is an event in
``events.jsonl``. The guard's own failures become events too, never a crashed run (unless
``strict``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import numbers
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdcscope._io import JsonlWriter
from sdcscope.detect import ABFTDetector, Event, NonFiniteDetector, SpikeDetector
from sdcscope.detect.state import StateChecksum
from sdcscope.inject import reexecution
from sdcscope.mitigate import LRBackoff, SnapshotRing, ZClip, qk_clip_
from sdcscope.observe import Metrics, grad_norms
from sdcscope.guard.config import GuardConfig

QK_NAMES = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("q", "k"))
"""Names of an attention module's query and key projections that QK-clip rescales."""
PRIORITY = ("rollback", "veto", "recompute", "skip_batch", "lr_backoff", "qk_clip", "report", "none")
"""Every policy action but ``quarantine``, which only a data-parallel run takes as such
(:mod:`sdcscope.guard.ranks`); a single process vetoes the step instead (:data:`SOLO_QUARANTINE`)."""
SOLO_QUARANTINE = "no rank to quarantine outside a data-parallel run: the step is vetoed instead"
REPLAY_RTOL = 1e-4
"""A replay on CPU must reproduce the step bit for bit. Elsewhere kernels may reduce in a
different order on each run (atomics, split-K): there a loss or gradient counts as reproduced
when ``‖first − replay‖ ≤ REPLAY_RTOL·‖first‖`` (such differences are ~1e-7 relative in fp32; a
finding a replay re-checks, ABFT's or the non-finite detector's, does not depend on it)."""


@dataclass(slots=True)
class _StepGrads:
    step: int
    idx: list[int]                  # the trainable parameters that have a gradient
    norms: torch.Tensor | None      # their gradients' 2-norms, as torch._foreach_norm gives them
    sq: torch.Tensor | None         # the norms squared in fp64 (an fp32 square can overflow)
    total: float | None = None      # the global norm, once read to the host


def _check_optimizer(optimizer: Any) -> None:
    """Refuse, before any step, an optimizer the guard cannot drive: ``optimizer_step`` calls
    ``optimizer.step()`` once, after the checks, on the gradients of one forward/backward."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Guard optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"Guard cannot drive {type(optimizer).__name__}: its step(closure) re-evaluates the loss "
                         "itself (several forward/backward passes per step, none of them checked); use an optimizer "
                         "whose step() takes no closure (SGD, Adam, AdamW, ...)")


def _rng_state(cuda: list[int]) -> tuple:
    """The CPU generator's state and those of the CUDA devices ``cuda``: a replay draws the same
    dropout masks wherever the model runs."""
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in cuda]


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)


def _reproduced(first: torch.Tensor, again: torch.Tensor | None) -> bool:
    """Whether a replay reproduced a gradient (bitwise on CPU, else within :data:`REPLAY_RTOL`)."""
    if again is None:
        return False
    if first.is_sparse:
        first, again = first.to_dense(), again.to_dense()
    if torch.equal(first, again):
        return True
    if first.device.type == "cpu":
        return False
    return float(torch.linalg.vector_norm(first - again)) <= REPLAY_RTOL * float(torch.linalg.vector_norm(first))


def _check_loss(loss: Any, what: str = "loss") -> None:
    """A usage error, raised before the guard changes anything: the loss must be one number."""
    if loss is None or isinstance(loss, numbers.Real):
        return
    if not isinstance(loss, torch.Tensor):
        try:
            loss = torch.as_tensor(loss)
        except Exception:
            raise TypeError(f"{what} must be a scalar tensor, a number or None, "
                            f"got {type(loss).__name__}: {loss!r}") from None
    if loss.numel() != 1:
        where = "before optimizer_step" if what == "loss" else "in step_fn"
        raise ValueError(f"{what} must be a scalar (0-d or 1 element), got shape {list(loss.shape)}; "
                         f"reduce it (e.g. loss.mean()) {where}")


class Guard:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: GuardConfig | None = None,
                 *, run_dir: str | Path | None = None,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 rank: int | None = None, on_event: Callable[[dict], None] | None = None,
                 ddp: DistributedDataParallel | None = None, ledger: str | Path | None = None,
                 rank_batch: Callable[[int, int], Any] | None = None, stateful: Iterable[Any] = (),
                 scaler: torch.amp.GradScaler | None = None) -> None:
        """``run_dir``: events go to ``run_dir/events.jsonl``; ``on_event``: also (or instead)
        to this callable; ``loss_fn(model, batch)``: lets a plain loop's step be replayed
        (forward, then the guard runs ``backward()``). ``step_fn(model, batch)``, instead of
        ``loss_fn``: the whole step's work -- forward and backward of every micro-batch of
        ``batch`` (gradient accumulation) -- returning the step's loss (detached); a replay zeroes
        the gradients and calls it. Either one must use the ``model`` it is given.

        Data-parallel: ``ddp`` is the DDP wrapper of ``model`` (or pass the wrapper as ``model``);
        build the Guard on every rank before the first backward. ``ledger``: a device ledger shared
        across jobs (default ``run_dir/ledger.json``); ``rank_batch(rank, step)``: that rank's
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
        for name, fn in (("loss_fn", loss_fn), ("step_fn", step_fn), ("rank_batch", rank_batch),
                         ("on_event", on_event)):
            if fn is not None and not callable(fn):
                raise TypeError(f"Guard {name} must be a callable or None, got {fn!r}")
        if loss_fn is not None and step_fn is not None:
            raise ValueError("Guard takes loss_fn or step_fn, not both: loss_fn(model, batch) returns the loss "
                             "of one forward pass (the guard runs backward on a replay); step_fn(model, batch) "
                             "runs the forward and backward of every micro-batch itself and returns the loss")
        _check_optimizer(optimizer)
        stateful = list(stateful)
        if scaler is not None:
            if not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"Guard scaler must be a torch.amp.GradScaler or None, got {scaler!r}")
            if ddp is not None or isinstance(model, DistributedDataParallel):
                raise ValueError("Guard scaler= is not supported in data-parallel runs yet: the rank guard "
                                 "compares gradients before the scaler unscales them")
            stateful += [] if any(obj is scaler for obj in stateful) else [scaler]
        for obj in stateful:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"Guard stateful items need state_dict() and load_state_dict() (an LR scheduler, "
                                f"a GradScaler), got {obj!r}")
        if ddp is None and isinstance(model, DistributedDataParallel):
            ddp, model = model, model.module
        if ddp is not None:
            from sdcscope.guard.ranks import check_distributed

            rank = check_distributed(config or GuardConfig(), model, ddp, rank)
        self.model, self.optimizer = model, optimizer
        self.config = c = config or GuardConfig()
        self.loss_fn, self.step_fn, self.rank = loss_fn, step_fn, rank
        self.stateful, self.scaler = stateful, scaler
        self.metrics = Metrics(model, optimizer, c.metrics) if c.metrics else None
        self.nonfinite = NonFiniteDetector(model, c.nonfinite, rank=rank) if c.nonfinite else None
        self.loss_spike = SpikeDetector(c.loss_spike, rank=rank) if c.loss_spike else None
        self.grad_spike = SpikeDetector(c.grad_spike, rank=rank) if c.grad_spike else None
        self.abft = ABFTDetector(model, c.abft, rank=rank) if c.abft else None
        self.state = StateChecksum(model, optimizer, c.state_checksum, rank=rank) if c.state_checksum else None
        self.ring = SnapshotRing(c.snapshots)
        self.backoff = LRBackoff(c.lr_backoff)
        self.zclip = ZClip(c.zclip) if c.zclip else None
        self.invariants = None
        if c.invariants is not None:
            from sdcscope.detect.invariants import InvariantChecker

            self.invariants = InvariantChecker(  # the loop's schedulers and scaler are watched too
                model, optimizer, c.invariants, rank=rank or 0,
                schedulers=[s for s in stateful if isinstance(s, torch.optim.lr_scheduler.LRScheduler)],
                scaler=next((s for s in stateful if isinstance(s, torch.amp.GradScaler)), None))
        self.events: list[dict[str, Any]] = []
        self.skip_batches: set[int] = set()
        self.rolled_back_to: int | None = None
        lead = ddp is None or rank == 0  # under DDP rank 0 writes the world's events
        self._writer = JsonlWriter(Path(run_dir) / "events.jsonl") if run_dir is not None and lead else None
        self._run_dir, self._rank_writer = run_dir, None
        self.rank_batch = rank_batch
        self._on_event = on_event
        self._step, self._batch, self._rng = 0, None, None
        self._clock = -1  # steps begun, minus 1: the LR backoff's count (a loop's step may restart or go back)
        # persistent buffers (BatchNorm running statistics, ...): a forward pass updates them, so a
        # replay or a veto puts back their values from before the step (self._buffers_before)
        self._buffer_slots = [(m, name) for m in model.modules() for name, b in m._buffers.items()
                              if b is not None and name not in m._non_persistent_buffers_set]
        self._buffers_before: list[torch.Tensor] = []
        self._pending: list[Event] = []
        self._params = list(model.parameters())   # those with a gradient are checked, frozen or not
        self._cuda = sorted({p.device.index or 0 for p in self._params if p.device.type == "cuda"})
        self._snapshot_due = False   # a plain loop's next snapshot: taken when its next step begins
        self._since_snapshot = 0     # updates applied since the training state was the latest snapshot's
        self._furthest = 0           # the most of those reached since that snapshot was taken
        self._rerun = 0              # applied steps since a rollback that have not got further yet
        self._grads: _StepGrads | None = None
        self._step_events = 0
        self._step_findings = 0      # the step's events about training, not about the guard's own failures
        self.discarded_steps = 0
        """Steps whose update the guard vetoed or rolled back."""
        self._idle = 0               # steps in a row without progress (:attr:`stalled`)
        self._attached = self._ever_attached = False
        self.ranks = None
        if ddp is not None:
            from sdcscope.guard.ranks import GuardRanks

            if self._writer is not None:
                self._writer.touch()
            self.ranks = GuardRanks(self, ddp, c.ranks, run_dir=run_dir, ledger=ledger)

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> "Guard":
        """Start watching; ``run_dir/events.jsonl`` exists from here on (empty on a clean run)."""
        if not self._attached:
            for part in (self.metrics, self.abft, self.invariants):
                if part is not None:
                    part.attach()
            if self._writer is not None:
                self._writer.touch()
            self._attached = self._ever_attached = True
        return self

    def detach(self) -> None:
        for part in (self.metrics, self.abft, self.invariants):
            if part is not None:
                part.detach()
        self._attached = False

    def close(self) -> None:
        self.detach()
        if self.metrics is not None:
            self.metrics.close()
        if self._writer is not None:
            self._writer.close()
        if self._rank_writer is not None:
            self._rank_writer.close()
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> "Guard":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.close()

    def callback(self, trainer=None) -> "GuardCallback":
        """The engine callback; with ``trainer``, the first rollback target and the reference of
        the state checksums are taken now, before any other callback (an injector) runs."""
        if self.scaler is not None:
            raise ValueError("Guard scaler= is for a plain loop's optimizer_step; the engine's trainer "
                             "trains without a GradScaler")
        self.attach()
        callback = GuardCallback(self)
        if trainer is not None:
            callback.prime(trainer)
        return callback

    # -- the per-step protocol ---------------------------------------------------------------
    def begin(self, step: int, batch: Any = None, *, snapshot: Callable[[], None] | None = None) -> None:
        """Before the forward pass: remember RNG, batch and buffers; verify the state checksums.
        A guard never attached attaches here (without its hooks the forward would go unchecked);
        one detached on purpose stays detached."""
        if not self._ever_attached:
            self.attach()
        self._step, self._batch, self._rng = step, batch, _rng_state(self._cuda)
        self._clock += 1
        self._buffers_before = self._buffer_values()
        self._step_events = self._step_findings = 0
        self.rolled_back_to = None
        take = snapshot or (lambda: self._take_snapshot(step))
        if len(self.ring) == 0:
            take()
        self._pending = self._safe(lambda: self.state.verify(step), "state_checksum") \
            if self.state is not None and self.state.due(step) else []
        due, self._snapshot_due = self._snapshot_due, False
        # due: after the loop's own end-of-step work (scheduler.step()), whatever this step's number;
        # new parameter groups (optimizer.add_param_group): the older snapshots no longer fit the optimizer
        if (due or self.ring.groups_changed(self.optimizer)) and not self._pending:
            take()
        for part in (self.abft, self.metrics):
            if part is not None:
                self._safe(lambda p=part: p.begin_step(step), type(part).__name__)
        if self.invariants is not None:
            self._safe(lambda: self.invariants.step_begin(step), "invariants")
        if self.ranks is not None:  # a collective's preparation: never skipped on one rank
            self.ranks.begin(step)

    def _take_snapshot(self, step: int) -> None:
        """A plain loop's rollback target: model, optimizer, the ``stateful`` objects and the
        guard's own training state (:meth:`_own_state`)."""
        extra = {"guard": self._own_state(), "stateful": [obj.state_dict() for obj in self.stateful]}
        self.ring.take(self.model, self.optimizer, step, step, extra=extra)   # deep-copies extra
        self._took_snapshot()

    def _took_snapshot(self) -> None:
        """The training state is the latest snapshot's: progress is counted from here."""
        self._since_snapshot = self._furthest = self._rerun = 0

    def _own_state(self) -> dict[str, Any]:
        """The guard's state that shapes later training and decisions, snapshotted with the model:
        ZClip's running statistics (they scale the gradients) and the spike detectors' windows.
        After a rollback the steps since the snapshot run again; without these the statistics
        would count them twice and training would part from a run that never met the fault."""
        return {"zclip": self.zclip, "loss_spike": self.loss_spike, "grad_spike": self.grad_spike}

    def _rolled_back(self, state) -> None:
        """After the model and optimizer were restored to ``state``: the guard's own state too."""
        for name, saved in state.extra.get("guard", {}).items():
            setattr(self, name, copy.deepcopy(saved))   # the snapshot stays as taken
        self.rolled_back_to = state.step
        self._since_snapshot = 0

    @contextlib.contextmanager
    def step(self, step: int, batch: Any = None) -> Iterator["Guard"]:
        self.begin(step, batch)
        yield self

    def optimizer_step(self, loss: torch.Tensor | float | None = None, *,
                       before_step: Callable[[], Any] | None = None,
                       after_step: Callable[[], Any] | None = None) -> bool:
        """Check, mitigate, then call ``optimizer.step()`` unless vetoed; True when it stepped.

        ``loss``: the step's loss, a scalar (0-d or one-element tensor, or a number) or None.
        ``before_step()``: run on the gradients the update will use -- after the checks, after a
        recompute replaced them, right before ``optimizer.step()`` (not on a veto or rollback);
        put gradient clipping (``nn.utils.clip_grad_norm_``) there (with ``scaler`` the
        gradients are unscaled by then), not before this call, so that the detectors and the pre-clip gradient-norm metrics see the
        gradients as computed and a recomputed step is clipped like any other.
        ``after_step()``: run right after ``optimizer.step()``, before the guard records the
        checksums of the new weights: put legitimate edits of the weights there (weight clipping,
        max-norm constraints, EMA copies written back) -- made after this call, they would look
        like memory corruption to the state checksums at the next step.

        After a rollback the model and optimizer hold the snapshot of step
        :attr:`rolled_back_to`; the caller's loop should continue from there and skip the
        batches in :attr:`skip_batches`.
        """
        if before_step is not None and not callable(before_step):
            raise TypeError(f"optimizer_step before_step must be a callable (e.g. lambda: "
                            f"nn.utils.clip_grad_norm_(model.parameters(), 1.0)) or None, got {before_step!r}")
        if after_step is not None and not callable(after_step):
            raise TypeError(f"optimizer_step after_step must be a callable or None, got {after_step!r}")
        _check_loss(loss)
        replays = self.loss_fn is not None or self.step_fn is not None
        rerun = self._rerun_plain if replays and self._batch is not None else None
        rank_replay = self._rank_replay_plain if replays and self.rank_batch is not None else None
        overflow = self.scaler is not None and self._unscale()
        found = None
        if overflow and not self._pending and self.abft is not None:
            # GEMM results that overflowed fail their checksums with an infinite ratio: those go
            # with the step. A result that fails with a finite ratio did not overflow: a fault
            # (whose huge value may be what overflowed downstream), judged like any other step
            found = [e for e in self._safe(lambda: self.abft.check(self._step), "abft")
                     if math.isfinite(e.evidence.get("ratio", math.inf))]
        if overflow and not self._pending and not found:  # the scaler's own overflow (its scale ran too high): no finding
            actions = []
        else:
            actions, loss = self.decide(loss, rerun, rank_replay=rank_replay, abft_events=found)
            if overflow and found:  # a recompute's gradients decide whether scaler.step would skip
                overflow = self._found_inf()
        if "rollback" in actions or "veto" in actions:
            if self.scaler is not None:  # before a rollback restores the scaler's own state
                self.scaler.update()
            if "rollback" in actions and self._safe(self._rollback, "rollback", default=False):
                self._after_update(applied=False)
                return False
            self.optimizer.zero_grad(set_to_none=True)  # a veto (or a rollback that failed, reported)
            self._restore_buffers()
            self._after_update(applied=False)
            return False
        if overflow:  # scaler.step would skip it: the scaler backs its scale off, as without the guard
            self.scaler.update()
            self._after_update(applied=False, discarded=False)
            return False
        self.before_update()
        if before_step is not None:  # the user's own code: its errors are the user's, not the guard's
            before_step()
        self.update_imminent()

        def apply() -> None:
            if self.scaler is None:
                self.optimizer.step()
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()
        _, row = self._apply_update(apply, loss)
        if after_step is not None:  # the user's own code, like before_step
            with torch.no_grad():
                after_step()
        self._after_update(applied=True, row=row, logged={"loss": loss} if loss is not None else None)
        return True

    def _apply_update(self, apply: Callable[[], Any], loss) -> tuple[Any, dict]:
        """``apply()`` (the optimizer's step) under the LR backoff, then the update's metrics row
        (:meth:`_update_metrics`, under the learning rate the step used); ``(its result, row)``."""
        groups = self.optimizer.param_groups
        base_lrs = [g["lr"] for g in groups]
        scale = self.backoff.scale(self._clock)
        for g, lr in zip(groups, base_lrs):
            g["lr"] = lr * scale
        try:
            return apply(), self._update_metrics(loss)
        finally:
            for g, lr in zip(groups, base_lrs):  # the very objects: no rounding drift
                g["lr"] = lr

    def _rollback(self) -> bool:
        """Restore the latest snapshot: model, optimizer, the ``stateful`` objects and the guard's
        own state. A snapshot that no longer fits the model or optimizer is refused before
        anything changes (the caller reports it and vetoes)."""
        state = self.ring.restore_latest(self.model, self.optimizer)
        for obj, saved in zip(self.stateful, state.extra.get("stateful", ())):
            obj.load_state_dict(copy.deepcopy(saved))   # the snapshot stays as taken
        self._rolled_back(state)
        return True

    def _unscale(self) -> bool:
        """Unscale the guard optimizer's gradients (``scaler.unscale_``), so the checks, the
        metrics and ZClip see them as the update will; True when the scaler found inf/NaN in them
        (an overflow: ``scaler.step`` would skip the step)."""
        self.scaler.unscale_(self.optimizer)
        return self._found_inf()

    def _found_inf(self) -> bool:
        """Whether the scaler's last ``unscale_`` of the guard optimizer found inf/NaN."""
        return any(bool(found) for found in self.scaler._found_inf_per_device(self.optimizer).values())

    def _run_step(self, batch: Any) -> torch.Tensor:
        """The step's forward and backward on ``batch`` (``step_fn``, or ``loss_fn`` + backward,
        scaled by the ``scaler`` as the loop scales it)."""
        if self.step_fn is not None:
            loss = self.step_fn(self.model, batch)
            _check_loss(loss, "step_fn's return value")
            if loss is None:
                raise ValueError("step_fn must return the step's loss (a scalar), got None")
            return loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        loss = self.loss_fn(self.model, batch)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return loss.detach()

    def _clear_grads(self) -> None:
        """Clear every gradient a re-execution computes: the guard optimizer's, and those of any
        parameter of the model outside it (a second optimizer's, a backbone the optimizer leaves
        alone); else backward would add the replay to them."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._params:
            p.grad = None

    def _rerun_plain(self) -> torch.Tensor:
        self._clear_grads()
        loss = self._run_step(self._batch)
        if self.scaler is not None:  # unscale the replay's gradients as the first ones were, and let
            # scaler.step judge the replay's: its record of this step's unscale_ is dropped first
            self.scaler._per_optimizer_states.pop(id(self.optimizer), None)
            self.scaler.unscale_(self.optimizer)
        return loss

    def _rank_replay_plain(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local gradient of this step, on the plain module (no all-reduce)."""
        self._clear_grads()
        with reexecution():
            return self._run_step(self.rank_batch(rank, self._step))

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, loss, rerun: Callable[[], torch.Tensor] | None, *,
               rank_replay: Callable[[int], Any] | None = None,
               abft_events: list[Event] | None = None) -> tuple[list[str], Any]:
        """Run the detectors on the finished backward pass; replay if any fired; return the
        actions of the policy (most decisive first) and the loss to report. Under DDP the
        findings of every rank decide together and ``rank_replay(r)`` (rank r's local gradient of
        this step, no collectives) replaces ``rerun``. A non-scalar ``loss`` is refused
        (ValueError) before anything changes. ``abft_events``: this step's ABFT findings when
        the caller already ran ``abft.check`` (it must run once per step)."""
        _check_loss(loss)
        step = self._step
        events = list(self._pending)
        if events:  # the step ran on corrupted state: its results are void, drain the detectors
            if self.abft is not None:
                self._safe(lambda: self.abft.check(step), "abft")
        else:
            events = self._detect(step, loss, abft_events)
        if self.ranks is not None:  # every rank, every step: one world decision (sdcscope.guard.ranks)
            return self.ranks.decide(step, events, rank_replay), loss
        if not events:
            return [], loss
        replay = {}
        needs_replay = any(e.detector != "state_checksum" for e in events)
        if needs_replay and self.config.replay and rerun is not None:
            recheckable = any(e.detector in ("abft", "nonfinite") for e in events)
            replay, loss = self._replay(step, loss, rerun, recheckable)
        actions: list[str] = []
        for e in events:
            finding = e.verdict
            if e.detector != "state_checksum":
                e.verdict = replay.get("verdict", "unverified")
                e.evidence = {**e.evidence, "finding": finding,
                              **({"replay": replay} if replay else {})}
            chosen = self.config.policy.actions_for(e.detector, e.verdict)
            if "quarantine" in chosen:  # no other rank to carry on: the step is void, as under DDP
                chosen = list(dict.fromkeys("veto" if a == "quarantine" else a for a in chosen))
                e.evidence = {**e.evidence, "quarantine": SOLO_QUARANTINE}
            e.action = ", ".join(chosen)
            actions += [a for a in chosen if a not in actions]
        if "rollback" in actions and self.ring.latest() is None:
            actions.remove("rollback")
            actions.insert(0, "veto")
        if "lr_backoff" in actions:
            self.backoff.trigger(self._clock)
        if "skip_batch" in actions:
            self.skip_batches.add(step)
        for e in events:
            self._emit(e)
        return sorted(actions, key=PRIORITY.index), loss

    def _step_grads(self) -> _StepGrads:
        """This step's per-parameter gradient norms, computed once and shared by the non-finite
        prefilter, the gradient-spike detector, the metrics and (:meth:`shared_grad_norms`) the
        trainer's clipping."""
        g = self._grads
        if g is None or g.step != self._step:
            idx, norms = grad_norms(self._params)
            g = self._grads = _StepGrads(self._step, idx, norms,
                                         None if norms is None else norms.double().square())
        return g

    def shared_grad_norms(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor] | None:
        """This step's per-parameter gradient norms as the trainer's ``StepContext.grad_norms``
        takes them (gradients, their versions, norms), if computed and all on one device and dtype."""
        g = self._grads
        if g is None or g.step != self._step or g.norms is None:
            return None
        grads = [self._params[i].grad for i in g.idx]
        first = grads[0]
        if any(x.dtype != first.dtype or x.device != first.device or x.is_sparse for x in grads):
            return None
        return grads, [x._version for x in grads], g.norms

    def _detect(self, step: int, loss, abft_events: list[Event] | None = None) -> list[Event]:
        """One fused pass over the gradients and one host sync decide the cheap detectors: the
        global gradient norm is non-finite iff some gradient is (or overflowed), and only then
        does the non-finite detector look closer."""
        events: list[Event] = list(abft_events or [])
        if self.abft is not None and abft_events is None:
            events += self._safe(lambda: self.abft.check(step), "abft")
        if self.nonfinite is None and self.loss_spike is None and self.grad_spike is None:
            return events
        g = self._safe(self._step_grads, "gradient norms", default=False)
        if g is False:
            return events
        sq = g.sq
        lv = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else \
            torch.as_tensor(math.nan if loss is None else loss, dtype=torch.float64).reshape(())
        parts = [lv.double()] if sq is None else [lv.to(sq.device, torch.float64), sq.sum()]
        values = torch.stack(parts).tolist()  # the sync
        loss_v, grad_v = values[0], (math.sqrt(values[1]) if len(values) > 1 else None)
        g.total = grad_v   # read: the metrics take it from here
        bad_loss = loss is not None and not math.isfinite(loss_v)
        bad_grad = grad_v is not None and not math.isfinite(grad_v)
        if self.nonfinite is not None and (bad_loss or bad_grad):
            found = self._safe(lambda: self.nonfinite.check(step, loss), "nonfinite")
            if bad_grad and self.ranks is None and not any(e.evidence.get("what") == "grad" for e in found):
                # every gradient element is finite, but a gradient's norm overflowed its dtype (under
                # DDP the rank guard's pre-reduction signatures, overflow-safe, name the rank)
                found.append(Event(step, "nonfinite", "nonfinite", rank=self.rank,
                                   evidence={"what": "grad_norm", "value": grad_v,
                                             "note": "finite gradients whose norm overflows"}))
            events += found
        if self.loss_spike is not None and loss is not None:
            events += self._safe(lambda: self.loss_spike.check(step, loss_v), "spike")
        if self.grad_spike is not None and grad_v is not None:
            events += self._safe(lambda: self.grad_spike.check(step, grad_v), "spike")
        return events

    def _replay(self, step: int, loss, rerun, recheckable: bool = False) -> tuple[dict[str, Any], Any]:
        """Re-execute the step from the pre-step state (same data, same RNG) and compare.
        ``recheckable``: a finding the replay checks again (ABFT, non-finite) fired; if it does not
        fire again the fault was transient, even when its effect was masked (identical results)."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        first_grads = {n: p.grad.detach().clone() for n, p in named}
        first_loss = None if loss is None else float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        after_rng = _rng_state(self._cuda)
        _set_rng_state(self._rng)
        try:
            self._restore_buffers()  # else the step's forward pass would update them twice
            if self.abft is not None:  # the layers this step checked, not the next step's sample
                self.abft.begin_step(step)
            if self.metrics is not None:  # the step's row: the re-execution's forward alone
                self.metrics.restart_step()
            with reexecution():
                new_loss = rerun()
            again = []
            if self.nonfinite is not None:
                again += self.nonfinite.check(step, new_loss)
            if self.abft is not None:
                again += self.abft.check(step)
        except Exception as exc:  # the replay itself failed: report, decide without it
            _set_rng_state(after_rng)
            self._internal_error("replay", exc)
            return {"verdict": "unverified", "error": repr(exc)}, loss
        new_value = float(new_loss)
        self._grads = None  # the gradients are the re-execution's now
        differs = [n for n, p in self.model.named_parameters()
                   if n in first_grads and not _reproduced(first_grads[n], p.grad)]
        tol = 0.0 if not self._cuda or first_loss is None else REPLAY_RTOL * abs(first_loss)
        loss_differs = first_loss is not None and not (  # without the loop's loss, the gradients decide
            new_value == first_loss or abs(new_value - first_loss) <= tol
            or (math.isnan(new_value) and math.isnan(first_loss)))
        transient = (differs or loss_differs or recheckable) and not again
        result = {"verdict": "transient" if transient else "reproducible",
                  "loss_first": first_loss, "loss_replay": new_value,
                  "first_differing_grad": differs[0] if differs else None,
                  "differing_grads": len(differs), "replay_detections": len(again)}
        if not transient:
            if again and (differs or loss_differs):
                result["evidence"] = "the fault acted again on re-execution: a persistent fault"
            elif any(e.detector == "spike" for e in again) or not again:
                result["evidence"] = "identical re-execution: the data or the optimization, not the hardware"
        return result, new_loss

    # -- after the update --------------------------------------------------------------------
    def before_update(self) -> None:
        """The gradient-norm metrics, as computed (before any clipping); ZClip. The metrics of the
        gradients the update uses come later, from :meth:`update_imminent`."""
        if self.metrics is not None:
            def grad_norms_to_metrics() -> None:
                g = self._step_grads()
                self.metrics.after_backward((g.idx, g.sq), g.total)
            self._safe(grad_norms_to_metrics, "metrics")
        if self.zclip is not None:
            self._safe(lambda: self.zclip.clip_(self.model.parameters()), "zclip")

    def update_imminent(self, clip_norm: float | None = None) -> None:
        """Right before ``optimizer.step()``, after the loop's own clipping (``clip_norm``: the
        global norm a trainer will still clip the gradients to): the metrics read from the
        optimizer's state and the gradients as the update will use them (Adam's g²/v̂ against a
        v̂ built from clipped gradients), and the pre-step copy the update ratio may need."""
        if self.metrics is not None:
            self._safe(lambda: self.metrics.before_optimizer_step(clip_norm=clip_norm), "metrics")

    def _buffer_values(self) -> list[torch.Tensor]:
        return [m._buffers[n].detach().clone() for m, n in self._buffer_slots]

    @torch.no_grad()
    def _restore_buffers(self, values: list[torch.Tensor] | None = None) -> None:
        """Put the persistent buffers back to ``values`` (default: before this step's forward)."""
        for (module, name), value in zip(self._buffer_slots, self._buffers_before if values is None else values):
            module._buffers[name].copy_(value)

    def _update_metrics(self, loss) -> dict:
        """The metrics row of an applied update (call while the optimizer's learning rates are the
        ones the update used); QK-clip on its attention logits."""
        if self.metrics is None:
            return {}
        self._safe(self.metrics.after_optimizer_step, "metrics")
        row = self._safe(lambda: self.metrics.collect(self._step, loss), "metrics", default={})
        if self.config.qk_clip is not None:
            self._qk_clip(self._step, row)
        return row

    def _after_update(self, *, applied: bool, row: dict | None = None,
                      snapshot: Callable[[], None] | None = None, logged: dict | None = None,
                      discarded: bool = True) -> dict:
        """``row``: the applied update's metrics (:meth:`_update_metrics`); ``logged``: the loop's
        own metrics of the step (the trainer's row: loss, grad_norm, lr), for the invariants'
        metric bounds, as a trace records them; ``discarded``: a step not applied was the guard's
        doing (not a GradScaler's overflow)."""
        row = row or {}
        step = self._step
        if self.ranks is not None:  # before the state checksums: a replica rollback restores state
            self.ranks.end(step, verify=self.rolled_back_to is not None)
        if self.state is not None:
            self._safe(self.state.record, "state_checksum")
        if self.metrics is not None and not applied:   # its forward statistics are no later step's
            self._safe(self.metrics.restart_step, "metrics")
        if self.invariants is not None and not applied:  # the step's effects were discarded
            self._safe(self.invariants.abandon_step, "invariants")
        elif self.invariants is not None:
            if logged:
                self._safe(lambda: self.invariants.log_metrics(logged), "invariants")
            for record in self._safe(self.invariants.step_end, "invariants"):
                self._emit(Event(**{k: record.get(k) for k in ("step", "detector", "verdict", "module", "rank")},
                                 evidence=record.get("evidence") or {}, action=record.get("action") or "report"))
        self._count_progress(applied, discarded)
        if applied and self._step_findings == 0:
            if snapshot is not None:   # the engine: its step numbers count its optimizer steps
                if self.ring.due(step + 1):
                    snapshot()
            elif self._since_snapshot >= self.ring.config.every:
                # a plain loop may still step its scheduler, and its step numbers may skip or
                # restart: snapshot when its next step begins, whatever that step's number
                self._snapshot_due = True
        return row

    @property
    def stalled(self) -> bool:
        """The last ``stall_after`` steps made no progress: a fault the guard cannot repair (a
        permanent one the replay reproduces, or one that corrupts the weights again after every
        rollback) holds training still. A plain loop should stop (or move the job) rather than
        go on discarding."""
        n = self.config.stall_after
        return n is not None and self._idle >= n

    def _count_progress(self, applied: bool, discarded: bool) -> None:
        """Steps without progress in a row: vetoed, rolled back or skipped for a GradScaler
        overflow, and the steps a rollback re-ran in vain. After a rollback the loop re-runs the
        steps since the snapshot: they count only if the next rollback comes before training got
        any further than it had (a fault that strikes again, where the engine's step budget
        would stop the run); an applied step beyond the furthest point ends the streak."""
        before = self._idle
        if applied:
            self._since_snapshot += 1
            if self._since_snapshot > self._furthest:
                self._furthest, self._idle, self._rerun = self._since_snapshot, 0, 0
            else:
                self._rerun += 1
            return
        self.discarded_steps += discarded
        self._idle += 1
        if self.rolled_back_to is not None:  # the steps re-run since the last rollback were in vain
            self._idle += self._rerun
            self._rerun = 0
        n = self.config.stall_after
        if n is not None and before < n <= self._idle:  # once per streak; every rank alike
            self._emit(Event(self._step, "guard", "stalled", rank=self.rank, action="report",
                             evidence={"consecutive_discarded": self._idle,
                                       "discarded_steps": self.discarded_steps}), world=True, finding=False)

    def _qk_clip(self, step: int, row: dict) -> None:
        """An attention-logit bound above ``qk_clip`` is a finding (``attention_logit:high``);
        the policy's actions for it apply after the update: ``qk_clip`` (rescale W_q, W_k),
        ``lr_backoff``; anything else reports it."""
        threshold = self.config.qk_clip
        chosen = self.config.policy.actions_for("attention_logit", "high")
        modules = dict(self.model.named_modules())
        for key, value in row.items():
            if not key.startswith("attn/max_logit_bound/") or not (math.isfinite(value) and value > threshold):
                continue
            layer = key.split("/", 2)[2]
            evidence = {"max_logit_bound": value, "threshold": threshold, "scale": 1.0}
            proj = next(((modules[f"{layer}.{q}"], modules[f"{layer}.{k}"]) for q, k in QK_NAMES
                         if isinstance(modules.get(f"{layer}.{q}"), nn.Linear)
                         and isinstance(modules.get(f"{layer}.{k}"), nn.Linear)), None)
            done = [a for a in chosen if a == "lr_backoff" or (a == "qk_clip" and proj is not None)]
            if "qk_clip" in chosen and proj is None:   # a fused qkv projection: reported, not rescaled
                evidence["qk_clip"] = (f"no separate q/k nn.Linear under {layer!r} (looked for "
                                       f"{', '.join('/'.join(pair) for pair in QK_NAMES)})")
            if "qk_clip" in done:
                evidence["scale"] = qk_clip_(*proj, value, threshold)
            if "lr_backoff" in done:
                self.backoff.trigger(self._clock)
            self._emit(Event(step, "attention_logit", "high", module=layer, rank=self.rank,
                             evidence=evidence, action=", ".join(done) or "report"))

    # -- events and failures -----------------------------------------------------------------
    def _emit(self, event: Event, world: bool = False, finding: bool = True) -> None:
        """``world``: a verdict every rank holds alike (under DDP rank 0 writes it, and only these
        count toward the snapshot decision, which must be the same on every rank); ``finding``:
        False for the guard's reports about itself (its internal errors, a stall), which say
        nothing against the training state and so do not hold its next snapshot back."""
        record = event.to_dict()
        self.events.append(record)
        if self.ranks is None or world:
            self._step_events += 1
            self._step_findings += finding
        writer = self._writer
        if self.ranks is not None and not world and self.rank != 0 and self._run_dir is not None:
            if self._rank_writer is None:  # this rank's own report, outside the world verdict
                self._rank_writer = JsonlWriter(Path(self._run_dir) / f"events.rank{self.rank}.jsonl")
            writer = self._rank_writer
        if writer is not None:
            writer.write(record)
        if self._on_event is not None:
            self._on_event(record)

    def _internal_error(self, where: str, exc: BaseException) -> None:
        if self.config.strict:
            raise exc
        self._emit(Event(self._step, "guard", "internal_error", rank=self.rank,
                         evidence={"where": where, "error": repr(exc),
                                   "trace": traceback.format_exc(limit=3)}, action="report"), finding=False)

    def _safe(self, fn: Callable[[], Any], where: str, default: Any = None):
        try:
            return fn()
        except Exception as exc:
            self._internal_error(where, exc)
            return [] if default is None else default


class GuardCallback:
    """Engine callback: the guard's protocol mapped onto the trainer's callback points."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def _snapshot(self, trainer) -> Callable[[], None]:
        g = self.guard

        def take() -> None:
            g.ring.take(trainer.model, trainer.optimizer, trainer.step, trainer.data_pos, trainer.lr_scale,
                        {"skip_data": sorted(trainer.skip_data), "guard": g._own_state()})
            g._took_snapshot()
        return take

    def prime(self, trainer) -> None:
        """Snapshot and checksum the trainer's state as it is (verified by whoever built it)."""
        g = self.guard
        if len(g.ring) == 0:
            self._snapshot(trainer)()
        if g.state is not None:
            g._safe(g.state.record, "state_checksum")

    def before_step(self, ctx) -> None:
        self.guard.begin(ctx.step, ctx.data_pos, snapshot=self._snapshot(ctx.trainer))

    def before_optimizer_step(self, ctx) -> None:
        g, trainer = self.guard, ctx.trainer

        def rerun() -> torch.Tensor:
            return trainer.forward_backward(ctx)

        replay = getattr(trainer, "local_gradients", None)
        rank_replay = None if replay is None else (lambda r: replay(r, ctx.step, ctx.data_pos))
        actions, ctx.step_loss = g.decide(ctx.step_loss, rerun, rank_replay=rank_replay)
        if "skip_batch" in actions:
            trainer.skip_data.add(ctx.data_pos)
        if "rollback" in actions:
            skip, state = set(trainer.skip_data), g.ring.latest()
            trainer.restore(state)
            trainer.skip_data |= skip
            g._rolled_back(state)
            ctx.restored = True
            g._after_update(applied=False)
            return
        if "veto" in actions:
            ctx.skip_update = True
            g._restore_buffers()
            return
        g.before_update()
        clip = trainer.workload.config.grad_clip
        g.update_imminent(clip_norm=clip if clip > 0 else None)   # the trainer clips next
        ctx.grad_norms = g.shared_grad_norms()   # the trainer clips with them if still valid
        scale = g.backoff.scale(g._clock)  # the trainer sets every step's lr afresh: no restore needed
        for group in trainer.optimizer.param_groups:
            group["lr"] *= scale

    def after_step(self, ctx) -> None:
        if self.guard.ranks is not None:
            ctx.metrics["quarantined"] = self.guard.ranks.quarantined
        if ctx.restored:
            return
        applied = not ctx.skip_update
        row = self.guard._update_metrics(ctx.step_loss) if applied else {}  # the step's lr is still set
        row = self.guard._after_update(applied=applied, row=row, snapshot=self._snapshot(ctx.trainer),
                                       logged=ctx.metrics)
        row.update(ctx.metrics)   # the trainer's own values win
        ctx.metrics.update(row)
        ctx.metrics["events"] = self.guard._step_events
