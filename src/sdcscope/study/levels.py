"""Levels (a) and (b) of the three-level analysis (Ma et al., ACL 2025) for one trial.

(a) **Submodule**: at the injection step, the faulty and the healthy execution of the same batch
from the same parameters run in lock-step (:func:`sdcscope.localize.lockstep` with
synchronization): every submodule output (forward) and input gradient (backward) is compared and
overwritten with the healthy value. Gives the first divergent submodule and direction and the
mismatch frequency and severity per submodule.

(b) **Single optimizer step**: over the horizon, with the parameters re-synchronized to the
healthy ones every step, the gradient noise-to-signal ratio ``|g_faulty - g_healthy| /
|g_healthy|`` per step (gradients before clipping; a fault in optimizer state has ratio 0).

Level (c), the training period without synchronization, is the trial itself (see
:mod:`.worker`). ``arm(step)`` returns a fresh, attached injector holding the trial's fault;
both functions leave the trainer at a state the caller restores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from sdcscope.engine import StepContext, Trainer
from sdcscope.inject import Injector
from sdcscope.localize import lockstep
from sdcscope.study.plan import TARGET_SEP

__all__ = ["submodule_level", "gradient_level", "in_target"]


def in_target(module: str | None, target: str, sep: str = TARGET_SEP) -> bool:
    """Whether ``module`` (a first divergence) lies inside the trial's target: a target group is
    the names of its modules joined by ``sep``, and a divergence in any of them, or in a submodule
    of one, is the injected unit's."""
    if not module:
        return False
    return any(module == t or module.startswith(t + ".") for t in target.split(sep) if t)


def submodule_level(trainer: Trainer, arm: Callable[[int], Injector]) -> dict[str, Any]:
    model, workload, step = trainer.model, trainer.workload, trainer.step
    batch = workload.batch(trainer.config.seed, trainer.data_pos, 0)

    def healthy() -> None:
        workload.loss(model, batch).backward()

    def faulty() -> None:
        injector = arm(step)
        try:
            injector.set_position(step, 0)
            healthy()
        finally:
            injector.close()

    report = lockstep(healthy, faulty, model, sync=True)
    return {
        "first_divergence": None if report.first is None else report.first.to_dict(),
        "lockstep": report.by_module(),
    }


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _nsr(faulty: list[torch.Tensor], healthy: list[torch.Tensor]) -> float:
    num = sum(float((f.double() - h.double()).pow(2).sum()) for f, h in zip(faulty, healthy))
    den = sum(float(h.double().pow(2).sum()) for h in healthy)
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


class _Grab:
    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def before_optimizer_step(self, ctx) -> None:
        self.grads = _grads(ctx.trainer.model)


def gradient_level(trainer: Trainer, arm: Callable[[int], Injector], steps: int) -> list[float]:
    """Noise-to-signal ratio of each of ``steps`` steps; the trainer follows the healthy run."""
    ratios, grab = [], _Grab()
    for _ in range(steps):
        step, state = trainer.step, trainer.snapshot()
        injector = arm(step)
        trainer.callbacks = [injector.callback()]
        try:
            injector.set_position(step, 0)
            trainer.forward_backward(StepContext(trainer, step, trainer.data_pos))
            faulty = _grads(trainer.model)
        finally:
            injector.close()
        trainer.restore(state)
        trainer.callbacks = [grab]
        trainer.train_step()
        ratios.append(_nsr(faulty, grab.grads))
    trainer.callbacks = []
    return ratios
