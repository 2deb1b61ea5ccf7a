"""Parameter distance to the golden twin over training, recorded while the runs train.

The golden run trains first and keeps a copy of its parameters every ``every`` updates; each later
run (faulty, guarded) of the same seed and data records ``‖θ − θ_golden‖ / ‖θ_golden‖`` at the same
update counts. Keyed by the number of updates applied, so a step re-run after a rollback overwrites
its earlier value. The copies are bounded by ``budget_bytes``: ``every`` grows with the model.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sdcscope.common.validate import check_positive
from sdcscope.study.compare import param_distance

__all__ = ["ParamTrace", "trace_experiment"]


class ParamTrace:
    """Trainer callbacks (``after_step``) that record the parameter distance to a reference run."""

    def __init__(self, every: int = 1) -> None:
        check_positive("every", every)
        self.every = int(every)
        self.reference: dict[int, dict[str, torch.Tensor]] = {}
        self.values: dict[str, dict[int, float]] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module, steps: int, points: int = 100, budget_bytes: int = 256 << 20):
        """At most ``points`` points over ``steps`` updates, and at most ``budget_bytes`` of copies."""
        check_positive("steps", steps)
        size = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_floating_point())
        copies = max(1, min(points, budget_bytes // max(1, size)))
        return cls(max(1, math.ceil(steps / copies)))

    def record_reference(self) -> _Recorder:
        return _Recorder(self, None)

    def follow(self, label: str) -> _Recorder:
        self.values.setdefault(label, {0: 0.0})  # the same seed: the same initial parameters
        return _Recorder(self, label)

    def series(self) -> dict[str, Any]:
        """``{"every": k, label: {"steps": [...], "values": [...]}}``, steps sorted."""
        out: dict[str, Any] = {"every": self.every}
        for label, by_step in self.values.items():
            steps = sorted(by_step)
            out[label] = {"steps": steps, "values": [by_step[s] for s in steps]}
        return out


class _Recorder:
    def __init__(self, trace: ParamTrace, label: str | None) -> None:
        self.trace, self.label = trace, label

    def after_step(self, ctx) -> None:
        trainer = ctx.trainer
        step = int(trainer.step)
        if step % self.trace.every:
            return
        params = {n: p.detach() for n, p in trainer.model.named_parameters() if p.is_floating_point()}
        if self.label is None:
            self.trace.reference[step] = {n: p.to("cpu", copy=True) for n, p in params.items()}
        elif step in self.trace.reference:
            ref = self.trace.reference[step]
            self.trace.values[self.label][step] = param_distance({n: p.cpu() for n, p in params.items()}, ref)


def trace_experiment(experiment, steps: int) -> ParamTrace:
    """A :class:`ParamTrace` attached to an :class:`~sdcscope.study.experiment.Experiment`'s runs:
    the golden run records, the faulty (and guarded) runs follow it."""
    trace = ParamTrace.for_model(experiment.golden.trainer.model, steps)
    experiment.golden.trainer.add_callback(trace.record_reference())
    experiment.faulty.run.trainer.add_callback(trace.follow("faulty"))
    if experiment.guarded is not None:
        experiment.guarded.run.trainer.add_callback(trace.follow("guarded"))
    return trace
