"""The guard's step protocol, written once: begin → check → replay → decide → act → record.

Every driver -- :meth:`Guard.optimizer_step <sdcscope.guard.Guard.optimizer_step>` (a plain
loop), the engine callback (:mod:`sdcscope.guard.engine`), the HF and Lightning adapters
(:mod:`sdcscope.integrations`) and the rank guard (:mod:`sdcscope.guard.ranks`) -- drives one
:class:`StepSession` through these public methods, in this order:

1. :meth:`begin` before the forward pass: RNG, batch and buffers remembered, state checksums verified;
2. :meth:`check` after the last backward: the detectors (:meth:`decide`), a replay when one fired,
   the policy's actions, applied in one place (:meth:`act`), then the events written with what
   the actions did;
3. for an update that goes ahead, :meth:`before_update` (metrics of the gradients as computed,
   ZClip), the loop's own clipping, then :meth:`update` (or :meth:`update_imminent` +
   :meth:`update_metrics` where the loop applies the update itself);
4. :meth:`end` after the update (or after the discard): state checksums, invariants, progress,
   the next snapshot.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from sdcscope.detect import Event
from sdcscope.detect.protocol import CheckView
from sdcscope.guard.actions import PRIORITY, Applied, Loop, make_actions, qk_clip_findings
from sdcscope.guard.progress import Progress
from sdcscope.guard.replay import rng_state
from sdcscope.guard.snapshots import SessionSnapshots
from sdcscope.guard.strikes import escalate, name_from_snapshot
from sdcscope.observe import grad_norms

if TYPE_CHECKING:
    from sdcscope.guard.guard import Guard


@dataclass(slots=True)
class StepGrads:
    step: int
    idx: list[int]  # the trainable parameters that have a gradient
    norms: torch.Tensor | None  # their gradients' 2-norms, as torch._foreach_norm gives them
    sq: torch.Tensor | None  # the norms squared in fp64 (an fp32 square can overflow)
    total: float | None = None  # the global norm, once read to the host


@dataclass
class Decision:
    """The policy's answer for one step: action names (most decisive first), the findings they
    answer (recorded once acted on) and the loss to report (a recompute's, if the replay was kept)."""

    actions: list[str]
    events: list[Event]
    loss: Any
    extra: list[Event] | None = None  # events of the actions themselves (a quarantine)


def check_loss(loss: Any, what: str = "loss") -> None:
    """A usage error, raised before the guard changes anything: the loss must be one number."""
    if loss is None or isinstance(loss, numbers.Real):
        return
    if not isinstance(loss, torch.Tensor):
        try:
            loss = torch.as_tensor(loss)
        except Exception:
            raise TypeError(
                f"{what} must be a scalar tensor, a number or None, got {type(loss).__name__}: {loss!r}"
            ) from None
    if loss.numel() != 1:
        where = "before optimizer_step" if what == "loss" else "in step_fn"
        raise ValueError(
            f"{what} must be a scalar (0-d or 1 element), got shape {list(loss.shape)}; "
            f"reduce it (e.g. loss.mean()) {where}"
        )


class StepSession(SessionSnapshots):
    """The per-step state of a :class:`~sdcscope.guard.Guard` and its protocol."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        model = guard.model
        self.step, self.batch, self.rng = 0, None, None
        self.clock = -1  # steps begun, minus 1: the LR backoff's count (a loop's step may restart or go back)
        # persistent buffers (BatchNorm running statistics, ...): a forward pass updates them, so a
        # replay or a veto puts back their values from before the step
        self.buffer_slots = [
            (m, name)
            for m in model.modules()
            for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set
        ]
        self.buffers_before: list[torch.Tensor] = []
        self.pending: list[Event] | None = None  # state checksum findings of begin(): the step ran on corrupted state
        self.first_event = 0  # the guard's events before this step's
        self.acting: Any = None  # while act() records its decision: what the actions did (Applied)
        self.stop_reason: str | None = None  # why this step's ``stop`` action stops training
        self.unresolved: list[dict[str, Any]] = []  # findings since the last verified snapshot not repaired
        self.params = list(model.parameters())  # those with a gradient are checked, frozen or not
        self.names = [name for name, _ in model.named_parameters()]  # of self.params, in order
        self.cuda = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        self.grads: StepGrads | None = None
        self.events = 0  # events of this step counted toward the world's decision
        self.findings = 0  # of those, the ones about training, not about the guard's own failures
        self.rolled_back_to: int | None = None
        self.progress = Progress()

    # -- 1. begin ----------------------------------------------------------------------------
    def begin(self, step: int, batch: Any = None, *, snapshot: Callable[[], None] | None = None) -> None:
        """Before the forward pass: remember RNG, batch and buffers; verify the state checksums.
        ``snapshot()``: how this loop takes a rollback target (default: :meth:`take_snapshot`)."""
        g = self.guard
        g.ensure_attached()
        self.step, self.batch, self.rng = step, batch, rng_state(self.cuda)
        self.clock += 1
        self.buffers_before = self.buffer_values()
        self.events = self.findings = 0
        self.rolled_back_to = None
        self.first_event, self.acting, self.stop_reason = len(g.events), None, None
        take = snapshot or (lambda: self.take_snapshot(step))
        if len(g.ring) == 0:
            take()
            if g.state is not None and not g.state.recorded:  # the reference of the state the snapshot holds
                g.safe(g.state.record, "state_checksum")
        due, self.progress.snapshot_due = self.progress.snapshot_due, False
        # due: after the loop's own end-of-step work (scheduler.step()), whatever this step's number;
        # new parameter groups (optimizer.add_param_group): the older snapshots no longer fit the optimizer
        due = due or g.ring.groups_changed(g.optimizer)
        # the state checksums are verified right before the update (decide); here only when a snapshot
        # is due, so that a snapshot never holds state that changed since it was last verified
        self.pending = self.verify_state() if due else None
        if due and not self.pending:
            take()
        for part in (*g.detectors.values(), g.metrics):
            if part is not None and hasattr(part, "begin_step"):
                g.safe(lambda p=part: p.begin_step(step), type(part).__name__)
        if g.invariants is not None:
            g.safe(lambda: g.invariants.step_begin(step), "invariants")
        g.ranks.begin(step)  # a collective's preparation: never skipped on one rank

    def verify_state(self) -> list[Event]:
        """The state checksums' findings now (when due this step): the weights and optimizer state
        against the reference recorded from verified state."""
        g = self.guard
        if g.state is None or not g.state.due(self.step):
            return []
        return g.safe(lambda: g.state.verify(self.step), "state_checksum") or []

    def judge_finding(self, event: Event) -> None:
        """Keep track of findings not repaired (:attr:`Guard.state_verified`): one whose step was
        applied without a recompute, or a state corruption without a rollback, taints the state
        until a rollback to a snapshot from before it."""
        acts, applied = event.actions, self.acting
        if event.detector in ("guard", "quarantine"):  # about the guard's own doings, not the state
            return
        if event.detector == "state_checksum":
            resolved = "rollback" in acts
        else:
            resolved = bool({"rollback", "veto", "recompute", "quarantine", "qk_clip"} & set(acts)) or (
                applied is not None and applied.discarded
            )
        if not resolved:
            self.unresolved.append(
                {"step": event.step, "detector": event.detector, "verdict": event.verdict, "module": event.module}
            )

    # -- 2. check: detect, replay, decide, act, record ---------------------------------------
    def check(
        self,
        loss: Any,
        rerun: Callable[[], torch.Tensor] | None,
        loop: Loop | None = None,
        *,
        rank_replay: Callable[[int], Any] | None = None,
        abft_events: list[Event] | None = None,
    ) -> tuple[Applied, Any]:
        """:meth:`decide`, then :meth:`act` on ``loop`` (default: a plain loop's); ``(what the
        actions did, the loss to report)``."""
        decision = self.decide(loss, rerun, rank_replay=rank_replay, abft_events=abft_events)
        return self.act(decision, loop or Loop(self)), decision.loss

    def decide(
        self,
        loss: Any,
        rerun: Callable[[], torch.Tensor] | None,
        *,
        rank_replay: Callable[[int], Any] | None = None,
        abft_events: list[Event] | None = None,
    ) -> Decision:
        """The one decision loop of every world: run the detectors on the finished backward pass,
        share the findings with the world, replay once, set verdicts, note strikes, map verdicts
        to the policy's actions and let the world translate them (:mod:`sdcscope.guard.world`).
        ``rerun()``: the step's forward and backward again; ``rank_replay(r)``: rank r's local
        gradient of this step (data parallel, no collectives). A non-scalar ``loss`` is refused
        (ValueError) before anything changes. ``abft_events``: this step's ABFT findings when the
        caller already ran ``abft.check``."""
        check_loss(loss)
        g, step, side = self.guard, self.step, self.guard.ranks
        # memory faults since the last record -- between steps, between micro-batches, in backward --
        # are caught before an update builds on them
        events = list(self.pending) if self.pending else self.verify_state()
        if events and not side.detect_on_corrupt_state:  # the step's results are void: drain the detectors
            view = CheckView(step, loss, g.model)
            for name, detector in g.detectors.items():
                if g.registrations[name].drain:
                    g.safe(lambda d=detector: d.check(view), name)
        else:
            events += self.detect(loss, None if abft_events is None else {"abft": abft_events})
        stopped = side.stop
        events = side.share(self, events, rank_replay)
        if not events:
            return Decision([], [], loss)
        escalate(g, g.config.ledger.cooldown)  # suspicion: every GEMM checked, the replay's too
        loss = side.replay(self, events, loss, rerun)
        mine = [e for e in events if e.rank in (None, g.rank)]
        g.safe(lambda: name_from_snapshot(g, mine), "state_checksum")  # a row fault's elements, if it can
        side.judge(self, events)  # repeats at one site, a faulty device: persistent
        actions: list[str] = []
        for e in events:
            if e.detector in side.decided:
                continue
            chosen = side.translate(self, e, list(g.config.policy.actions_for(e.detector, e.verdict)))
            if "stop" in chosen and self.stop_reason is None:
                self.stop_reason = side.stop_reason(e)
            e.action = ", ".join(chosen)
            actions += [a for a in chosen if a not in actions and a in PRIORITY]
        extra = side.conclude(self, actions, events)
        if side.stop and not stopped and "stop" not in actions:  # the world stopped: this step is void
            self.stop_reason = self.stop_reason or side.stop
            actions += ["stop"] + ([] if "veto" in actions or "rollback" in actions else ["veto"])
            actions = [a for a in actions if a != "recompute"]
        if "rollback" in actions and g.ring.latest() is None:
            actions.remove("rollback")
            actions += [] if "veto" in actions else ["veto"]
        return Decision(sorted(actions, key=PRIORITY.index), events, loss, extra)

    def act(self, decision: Decision, loop: Loop) -> Applied:
        """Apply the decision's actions (most decisive first), then record its events with what
        the actions did: an event is written after the action it names."""
        applied = Applied()
        names = decision.actions
        if "rollback" in names or "veto" in names:
            loop.before_discard()
        for action in make_actions(names):
            action.apply(self, loop, applied)
        for e in decision.events:  # (a rank guard's own restore of the replicas is no rollback of ours)
            taken = e.actions
            if "rollback" not in taken or "rollback" not in names:
                continue
            if applied.rolled_back is None:  # the rollback failed: the veto behind it kept the update out
                e.action = ", ".join(dict.fromkeys("veto" if a == "rollback" else a for a in taken))
            else:
                e.evidence = {**e.evidence, "rolled_back_to": applied.rolled_back.step}
        self.acting = applied
        try:
            for e in decision.events + (decision.extra or []):
                self.guard.record(e, world=self.guard.world.distributed)
        finally:
            self.acting = None
        if "stop" in names:
            self.guard.stop(self.stop_reason or f"the policy stopped training at step {self.step}")
        return applied

    def grad_state(self) -> StepGrads:
        """This step's per-parameter gradient norms, computed once and shared by the non-finite
        prefilter, the gradient-spike detector, the metrics and the trainer's clipping."""
        g = self.grads
        if g is None or g.step != self.step:
            idx, norms = grad_norms(self.params)
            g = self.grads = StepGrads(self.step, idx, norms, None if norms is None else norms.double().square())
        return g

    def shared_grad_norms(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor] | None:
        """This step's per-parameter gradient norms as the trainer's ``StepContext.grad_norms``
        takes them (gradients, their versions, norms), if computed and all on one device and dtype."""
        g = self.grads
        if g is None or g.step != self.step or g.norms is None:
            return None
        grads = [self.params[i].grad for i in g.idx]
        first = grads[0]
        if any(x.dtype != first.dtype or x.device != first.device or x.is_sparse for x in grads):
            return None
        return grads, [x._version for x in grads], g.norms

    def detect(self, loss: Any, ran: Mapping[str, list[Event]] | None = None) -> list[Event]:
        """The guard's detectors on the finished backward pass, in registry order, each through the
        detector protocol (:mod:`sdcscope.detect.protocol`). The world values are computed once,
        before the first detector that reads them (:meth:`world_view`); when they cannot be, those
        detectors are skipped (an internal error says why). ``ran``: a detector's findings this
        step, by name, when the caller already ran it."""
        g = self.guard
        base, world, valued = CheckView(self.step, loss, g.model), None, False
        events: list[Event] = []
        for name, detector in g.detectors.items():
            if ran is not None and name in ran:
                events += ran[name]
                continue
            view = base
            if g.registrations[name].world_values:
                if not valued:
                    valued, world = True, self.world_view(base)
                if world is None:  # the gradient norms failed (an internal error says so)
                    continue
                view = world
            events += g.safe(lambda d=detector, v=view: d.check(v), name)
        return events

    def world_view(self, view: CheckView) -> CheckView | None:
        """``view`` with the world values: one fused pass over the gradients and one host sync (a
        collective in a sharded world); the global norm is non-finite iff some gradient is (or a
        norm overflowed). None when the gradient norms fail."""
        g, loss = self.guard, view.loss
        grads = g.safe(self.grad_state, "gradient norms", default=False)
        if grads is False:
            return None
        lv = (
            loss.detach().reshape(())
            if isinstance(loss, torch.Tensor)
            else torch.as_tensor(math.nan if loss is None else loss, dtype=torch.float64).reshape(())
        )
        loss_v, grad_sq = g.ranks.world_values(lv, grads)  # sharded: the world-mean loss, the norm over every shard
        grad_v = None if grad_sq is None else math.sqrt(grad_sq)
        grads.total = grad_v  # read: the metrics take it from here
        return replace(
            view,
            loss_value=None if loss is None else loss_v,
            grad_norm=grad_v,
            grad_sq=grads.sq,
            grad_names=tuple(self.names[i] for i in grads.idx),
            own_overflow=grad_v is not None and not math.isfinite(grad_v) and g.ranks.own_overflow(grads.sq),
        )

    # -- 3. the update -----------------------------------------------------------------------
    def before_update(self) -> None:
        """The gradient-norm metrics, as computed (before any clipping); ZClip. The metrics of the
        gradients the update uses come later, from :meth:`update_imminent`."""
        g = self.guard
        if g.metrics is not None:

            def grad_norms_to_metrics() -> None:
                s = self.grad_state()
                g.metrics.after_backward((s.idx, s.sq), s.total)

            g.safe(grad_norms_to_metrics, "metrics")
        if g.zclip is not None:
            g.safe(lambda: g.zclip.clip_(g.model.parameters()), "zclip")

    def update_imminent(self, clip_norm: float | None = None) -> None:
        """Right before ``optimizer.step()``, after the loop's own clipping (``clip_norm``: the
        global norm a trainer will still clip the gradients to): the metrics read from the
        optimizer's state and the gradients as the update will use them."""
        g = self.guard
        if g.metrics is not None:
            g.safe(lambda: g.metrics.before_optimizer_step(clip_norm=clip_norm), "metrics")

    def lr_scale(self) -> float:
        """The LR backoff's factor for this step."""
        return self.guard.backoff.scale(self.clock)

    def update(self, apply: Callable[[], Any], loss: Any, logged: dict | None = None) -> tuple[Any, dict]:
        """``apply()`` (the optimizer's step) under the LR backoff, then the update's metrics row;
        ``(its result, row)``. The caller ends the step (:meth:`end`)."""
        base_lrs = self.begin_update()
        try:
            return apply(), self.update_metrics(loss)
        finally:
            self.restore_lrs(base_lrs)

    def begin_update(self) -> list[Any]:
        """Right before the optimizer's step (:meth:`update_imminent`), its learning rates scaled
        by the LR backoff; returns the loop's own rates, which :meth:`restore_lrs` puts back after
        the step and :meth:`update_metrics` (a loop whose step runs outside the guard: hooks)."""
        self.update_imminent()
        groups = self.guard.optimizer.param_groups
        base_lrs = [group["lr"] for group in groups]
        scale = self.lr_scale()
        for group, lr in zip(groups, base_lrs):
            group["lr"] = lr * scale
        return base_lrs

    def restore_lrs(self, base_lrs: list[Any]) -> None:
        for group, lr in zip(self.guard.optimizer.param_groups, base_lrs):  # the very objects: no rounding drift
            group["lr"] = lr

    def update_metrics(self, loss: Any) -> dict:
        """The metrics row of an applied update (call while the optimizer's learning rates are the
        ones the update used); QK-clip on its attention logits."""
        g = self.guard
        if g.metrics is None:
            return {}
        g.safe(g.metrics.after_optimizer_step, "metrics")
        row = g.safe(lambda: g.metrics.collect(self.step, loss), "metrics", default={})
        if g.config.qk_clip is not None:
            for event in qk_clip_findings(self, row):
                g.record(event)
        return row

    # -- 4. end ------------------------------------------------------------------------------
    def end(
        self,
        *,
        applied: bool,
        row: dict | None = None,
        snapshot: Callable[[], None] | None = None,
        logged: dict | None = None,
        discarded: bool = True,
    ) -> dict:
        """After the update (or the discard). ``row``: the applied update's metrics
        (:meth:`update_metrics`); ``logged``: the loop's own metrics of the step (loss, grad_norm,
        lr), for the invariants' metric bounds; ``discarded``: a step not applied was the guard's
        doing (not a GradScaler's overflow)."""
        g = self.guard
        row = row or {}
        step = self.step
        g.ranks.end(step, verify=self.rolled_back_to is not None)  # before the state checksums: a replica rollback
        if g.state is not None and (applied or self.restored() or not g.state.recorded):
            # only verified state becomes the reference: an update of state verified before it, a
            # restored snapshot; a discarded step left the state as recorded (a fault in it stays seen)
            g.safe(g.state.record, "state_checksum")
        if g.metrics is not None and not applied:  # its forward statistics are no later step's
            g.safe(g.metrics.restart_step, "metrics")
        if g.invariants is not None and not applied:  # the step's effects were discarded
            g.safe(g.invariants.abandon_step, "invariants")
        elif g.invariants is not None:
            if logged:
                g.safe(lambda: g.invariants.log_metrics(logged), "invariants")
            for record in g.safe(g.invariants.step_end, "invariants"):
                fields = {k: record.get(k) for k in ("step", "detector", "verdict", "module", "rank")}
                g.record(
                    Event(**fields, evidence=record.get("evidence") or {}, action=record.get("action") or "report")
                )
        p, n = self.progress, g.config.stall_after
        if p.count(applied, discarded, self.rolled_back_to is not None, n):  # once per streak; every rank alike
            evidence = {"consecutive_discarded": p.idle, "discarded_steps": p.discarded_steps}
            g.record(
                Event(step, "guard", "stalled", rank=g.rank, action="report", evidence=evidence),
                world=True,
                finding=False,
            )
            g.stop(f"stalled: {p.idle} steps in a row without progress (a fault the guard cannot repair)", event=False)
        if applied and self.findings == 0:
            if snapshot is not None:  # the engine: its step numbers count its optimizer steps
                if g.ring.due(step + 1):
                    snapshot()
            elif p.since_snapshot >= g.ring.config.every:
                # a plain loop may still step its scheduler, and its step numbers may skip or
                # restart: snapshot when its next step begins, whatever that step's number
                p.snapshot_due = True
        return row
