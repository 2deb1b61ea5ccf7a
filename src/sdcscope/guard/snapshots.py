"""The step session's rollback state: what a plain loop's snapshot holds (model, optimizer, the
``stateful`` objects and the guard's own statistics), its restore, and the step's buffers and
gradients put back before a re-execution. Mixed into :class:`~sdcscope.guard.session.StepSession`."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sdcscope.engine import TrainState


class SessionSnapshots:
    """Snapshots and restores of one :class:`~sdcscope.guard.session.StepSession` (its ``guard``,
    ``progress``, ``buffer_slots``, ``params``)."""

    def own_state(self) -> dict[str, Any]:
        """The guard's state that shapes later training and decisions, snapshotted with the model:
        ZClip's running statistics (they scale the gradients) and the windows of the detectors
        registered with ``rolls_back`` (the spike detectors'). After a rollback the steps since the
        snapshot run again; without these the statistics would count them twice and training
        would part from a run that never met the fault."""
        g = self.guard
        kept = {name: d for name, d in g.detectors.items() if g.registrations[name].rolls_back}
        return {"zclip": g.zclip, "detectors": kept, "unresolved": self.unresolved}

    def take_snapshot(self, step: int) -> None:
        """A plain loop's rollback target: model, optimizer, the ``stateful`` objects and the
        guard's own training state (:meth:`own_state`)."""
        g = self.guard
        extra = {"guard": self.own_state(), "stateful": [obj.state_dict() for obj in g.stateful]}
        g.ring.take(g.model, g.optimizer, step, step, extra=extra)  # deep-copies extra
        self.progress.took_snapshot()

    def restore_snapshot(self) -> TrainState:
        """A plain loop's rollback: the latest snapshot into the model, optimizer and ``stateful``
        objects. One that no longer fits them is refused before anything changes."""
        g = self.guard
        state = g.ring.restore_latest(g.model, g.optimizer)
        for obj, saved in zip(g.stateful, state.extra.get("stateful", ())):
            obj.load_state_dict(copy.deepcopy(saved))  # the snapshot stays as taken
        return state

    def rolled_back(self, state: TrainState) -> None:
        """After the loop's state was restored to ``state``: the guard's own state too."""
        for name, saved in state.extra.get("guard", {}).items():
            saved = copy.deepcopy(saved)  # the snapshot stays as taken
            if name == "detectors":
                self.guard.detectors.update(saved)
            else:
                setattr(self if name == "unresolved" else self.guard, name, saved)
        self.rolled_back_to = state.step
        self.progress.rolled_back()

    def buffer_values(self) -> list[torch.Tensor]:
        return [m._buffers[n].detach().clone() for m, n in self.buffer_slots]

    @torch.no_grad()
    def restore_buffers(self, values: list[torch.Tensor] | None = None) -> None:
        """Put the persistent buffers back to ``values`` (default: before this step's forward)."""
        for (module, name), value in zip(self.buffer_slots, self.buffers_before if values is None else values):
            module._buffers[name].copy_(value)

    def clear_grads(self) -> None:
        """Clear every gradient a re-execution computes: the guard optimizer's, and those of any
        parameter of the model outside it; else backward would add the replay to them."""
        self.guard.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def restored(self) -> bool:
        """Whether this step restored a verified state: a rollback of ours or of the rank guard's."""
        if self.rolled_back_to is not None:
            return True
        return any("rollback" in str(r.get("action") or "") for r in self.guard.events[self.first_event :])
