"""The plain loop's driver of a :class:`~sdcscope.guard.guard.Guard`: ``optimizer_step`` checks
the step, lets the session decide (replay, recompute, veto, rollback), then calls
``optimizer.step()`` unless vetoed -- with a GradScaler's unscale and overflow handled as the
scaler would -- and re-runs the step's forward and backward for a replay."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from sdcscope.guard.actions import Loop
from sdcscope.guard.session import check_loss
from sdcscope.inject import reexecution


def check_optimizer(optimizer: Any) -> None:
    """Refuse, before any step, an optimizer the guard cannot drive: ``optimizer_step`` calls
    ``optimizer.step()`` once, after the checks, on the gradients of one forward/backward."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"Guard optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"Guard cannot drive {type(optimizer).__name__}: its step(closure) re-evaluates the loss "
            "itself (several forward/backward passes per step, none of them checked); use an optimizer "
            "whose step() takes no closure (SGD, Adam, AdamW, ...)"
        )


class _ScaledLoop(Loop):
    """A plain loop with a GradScaler: the scaler backs off before a rollback restores its state."""

    def before_discard(self) -> None:
        self.session.guard.scaler.update()


class PlainLoop:
    """``optimizer_step`` and the replays it runs; mixed into the Guard (which holds the session,
    the optimizer, the scaler and the user's ``loss_fn`` / ``step_fn``)."""

    def optimizer_step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        before_step: Callable[[], Any] | None = None,
        after_step: Callable[[], Any] | None = None,
    ) -> bool:
        """Check, mitigate, then call ``optimizer.step()`` unless vetoed; True when it stepped.

        ``loss``: the step's loss, a scalar (0-d or one-element tensor, or a number) or None.
        ``before_step()``: run on the gradients the update will use -- after the checks, after a
        recompute replaced them, right before ``optimizer.step()`` (not on a veto or rollback);
        put gradient clipping there (with ``scaler`` the gradients are unscaled by then), not
        before this call, so that the detectors and the pre-clip gradient-norm metrics see the
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
            raise TypeError(
                f"optimizer_step before_step must be a callable (e.g. lambda: "
                f"nn.utils.clip_grad_norm_(model.parameters(), 1.0)) or None, got {before_step!r}"
            )
        if after_step is not None and not callable(after_step):
            raise TypeError(f"optimizer_step after_step must be a callable or None, got {after_step!r}")
        check_loss(loss)
        s = self.session
        replays = self.loss_fn is not None or self.step_fn is not None
        rerun = self.step_replay()
        rank_replay = self._rank_replay if replays and self.rank_batch is not None else None
        overflow = self.scaler is not None and self._unscale()
        found = None
        if overflow and not s.pending and self.abft is not None:
            # GEMM results that overflowed fail their checksums with an infinite ratio: those go
            # with the step. A result that fails with a finite ratio did not overflow: a fault
            # (whose huge value may be what overflowed downstream), judged like any other step
            found = [
                e
                for e in self.safe(lambda: self.abft.check(s.step), "abft")
                if math.isfinite(e.evidence.get("ratio", math.inf))
            ]
        if overflow and not s.pending and not found:  # the scaler's own overflow: no finding
            self.scaler.update()  # scaler.step would skip it: the scaler backs off, as without the guard
            s.end(applied=False, discarded=False)
            return False
        loop = Loop(s) if self.scaler is None else _ScaledLoop(s)
        applied, loss = s.check(loss, rerun, loop, rank_replay=rank_replay, abft_events=found)
        if applied.discarded:
            s.end(applied=False)
            return False
        if overflow and self._found_inf():  # a recompute's gradients decide whether scaler.step would skip
            self.scaler.update()
            s.end(applied=False, discarded=False)
            return False
        s.before_update()
        if before_step is not None:  # the user's own code: its errors are the user's, not the guard's
            before_step()

        def apply() -> None:
            if self.scaler is None:
                self.optimizer.step()
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()

        _, row = s.update(apply, loss)
        if after_step is not None:  # the user's own code, like before_step
            with torch.no_grad():
                after_step()
        s.end(applied=True, row=row, logged={"loss": loss} if loss is not None else None)
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
            check_loss(loss, "step_fn's return value")
            if loss is None:
                raise ValueError("step_fn must return the step's loss (a scalar), got None")
            return loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        loss = self.loss_fn(self.model, batch)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return loss.detach()

    def step_replay(self) -> Callable[[], torch.Tensor] | None:
        """The replay of this step that ``StepSession.check`` takes: its forward and backward again
        on its batch (through ``loss_fn`` or ``step_fn``), or None when the guard cannot re-run it
        (neither given, or no batch passed to ``begin``)."""
        replays = self.loss_fn is not None or self.step_fn is not None
        return self._rerun if replays and self.session.batch is not None else None

    def _rerun(self) -> torch.Tensor:
        self.session.clear_grads()
        loss = self._run_step(self.session.batch)
        if self.scaler is not None:  # unscale the replay's gradients as the first ones were, and let
            # scaler.step judge the replay's: its record of this step's unscale_ is dropped first
            self.scaler._per_optimizer_states.pop(id(self.optimizer), None)
            self.scaler.unscale_(self.optimizer)
        return loss

    def _rank_replay(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local gradient of this step, on the plain module (no all-reduce)."""
        self.session.clear_grads()
        with reexecution():
            return self._run_step(self.rank_batch(rank, self.session.step))
