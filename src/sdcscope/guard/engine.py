"""The guard in sdcscope's own trainer: the step protocol mapped onto the trainer's callback points.

``trainer.add_callback(guard.callback(trainer))``. The trainer applies the update itself, so the
callback uses the protocol's parts around it: the session checks and acts before the optimizer
step, the trainer clips and steps, the session ends the step after it. A rollback restores the
trainer's own state (its step, data position and skipped batches with the model and optimizer).
A stopped guard (:attr:`Guard.stopped <sdcscope.guard.Guard.stopped>`) puts ``stop`` (the reason)
in the step's metrics row: the run ends after that step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sdcscope.engine import TrainState
from sdcscope.guard.actions import Loop

if TYPE_CHECKING:
    from sdcscope.guard.guard import Guard


class TrainerLoop(Loop):
    """The engine trainer's side of the discarding actions."""

    def __init__(self, session, ctx) -> None:
        super().__init__(session)
        self.ctx = ctx

    def rollback(self) -> TrainState:
        trainer = self.ctx.trainer
        skip, state = set(trainer.skip_data), self.session.guard.ring.latest()
        trainer.restore(state)
        trainer.skip_data |= skip
        self.ctx.restored = True
        return state

    def drop_update(self) -> None:
        self.ctx.skip_update = True

    def skip_batch(self) -> None:
        self.ctx.trainer.skip_data.add(self.ctx.data_pos)


class GuardCallback:
    """Engine callback of a :class:`~sdcscope.guard.Guard`: build it with ``guard.callback(trainer)``."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.session = guard.session

    def _snapshot(self, trainer) -> Callable[[], None]:
        s = self.session

        def take() -> None:
            extra = {"skip_data": sorted(trainer.skip_data), "guard": s.own_state()}
            self.guard.ring.take(
                trainer.model, trainer.optimizer, trainer.step, trainer.data_pos, trainer.lr_scale, extra
            )
            s.progress.took_snapshot()

        return take

    def prime(self, trainer) -> None:
        """Snapshot and checksum the trainer's state as it is (verified by whoever built it)."""
        g = self.guard
        if len(g.ring) == 0:
            self._snapshot(trainer)()
        if g.state is not None:
            g.safe(g.state.record, "state_checksum")

    def before_step(self, ctx) -> None:
        self.session.begin(ctx.step, ctx.data_pos, snapshot=self._snapshot(ctx.trainer))

    def before_optimizer_step(self, ctx) -> None:
        s, trainer = self.session, ctx.trainer

        def rerun() -> torch.Tensor:
            return trainer.forward_backward(ctx)

        # a data-parallel world's trainer replays any rank's local gradient; elsewhere a step is one whole
        replay = trainer.local_gradients if trainer.world.data_parallel else None
        rank_replay = None if replay is None else (lambda r: replay(r, ctx.step, ctx.data_pos))
        applied, ctx.step_loss = s.check(ctx.step_loss, rerun, TrainerLoop(s, ctx), rank_replay=rank_replay)
        if applied.rolled_back is not None:
            s.end(applied=False)
            return
        if applied.discarded:  # vetoed: the step ends after the trainer skipped the update
            return
        s.before_update()
        clip = trainer.workload.config.grad_clip
        s.update_imminent(clip_norm=clip if clip > 0 else None)  # the trainer clips next
        ctx.grad_norms = s.shared_grad_norms()  # the trainer clips with them if still valid
        scale = s.lr_scale()  # the trainer sets every step's lr afresh: no restore needed
        for group in trainer.optimizer.param_groups:
            group["lr"] *= scale

    def after_step(self, ctx) -> None:
        if self.guard.world.distributed:
            ctx.metrics["quarantined"] = self.guard.ranks.quarantined
        if ctx.restored:
            self._stop(ctx)
            return
        s = self.session
        applied = not ctx.skip_update
        row = s.update_metrics(ctx.step_loss) if applied else {}  # the step's lr is still set
        row = s.end(applied=applied, row=row, snapshot=self._snapshot(ctx.trainer), logged=ctx.metrics)
        row.update(ctx.metrics)  # the trainer's own values win
        ctx.metrics.update(row)
        ctx.metrics["events"] = s.events
        self._stop(ctx)

    def _stop(self, ctx) -> None:
        """A stopped guard asks the run to end after this step: ``stop`` in the step's metrics row
        (:meth:`sdcscope.engine.run.Run.train` ends the run as ``stalled`` with the reason)."""
        if self.guard.stopped:
            ctx.metrics["stop"] = self.guard.stop_reason
