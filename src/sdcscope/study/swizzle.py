"""Channel swizzling for an NVDLA-style MAC-cell fault (the accelerator study in the seeds).

Without swizzling a faulty MAC cell meets the same (input channel a, output channel b) pair of a
layer at every step, so training can adapt to it: the weight ``W[b, a]`` no longer acts and
drifts freely, and the model fails once the fault is gone. Swizzling re-maps logical channels to
physical cells between steps: the pair that meets the broken cell is ``(pi_t(a0), sigma_t(b0))``
for a fresh permutation at step ``t`` -- here drawn uniformly per step from a hash of (fault seed,
step), so the cell's own position ``(a0, b0)`` does not matter. Evaluation at step ``t`` uses the
mapping of step ``t``.

Implemented on top of :class:`~sdcscope.inject.Injector` (public API only): one permanent
``mac_cell`` spec with the channels of the current step, re-built when the step changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
from sdcscope.workloads import mix_seed

__all__ = ["SwizzledFault"]


class SwizzledFault:
    """Engine callback (and fault handle) for a ``mac_cell`` spec on one module, swizzled per step."""

    def __init__(self, model: torch.nn.Module, spec: FaultSpec, optimizer=None) -> None:
        if spec.pattern.kind != "mac_cell" or len(spec.target) != 1:
            raise ValueError(f"swizzling needs a mac_cell pattern on one module, got {spec.pattern.kind!r} "
                             f"on {list(spec.target)}")
        module = dict(model.named_modules()).get(spec.target[0])
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() < 2:
            raise ValueError(f"swizzling needs a module with a weight [out, in, ...]: {spec.target[0]!r}")
        self.model, self.spec, self.optimizer = model, spec, optimizer
        self.n_out, self.n_in = int(weight.shape[0]), int(weight.shape[1])
        self.injector: Injector | None = None
        self.records: list[dict[str, Any]] = []
        self._at: tuple[int, bool] | None = None

    def channels(self, step: int) -> tuple[int, int]:
        """(input channel, output channel) that meet the faulty cell at ``step``."""
        g = torch.Generator().manual_seed(mix_seed("swizzle", self.spec.seed, step))
        a = int(torch.randint(self.n_in, (1,), generator=g))
        return a, int(torch.randint(self.n_out, (1,), generator=g))

    def injector_at(self, step: int) -> Injector:
        """A fresh, attached injector holding this step's mapping (the caller closes it)."""
        a, b = self.channels(step)
        pattern = dataclasses.replace(self.spec.pattern, input_channel=a, output_channel=b)
        return Injector(self.model, [dataclasses.replace(self.spec, pattern=pattern)], self.optimizer).attach()

    def _move(self, step: int, evaluating: bool) -> None:
        if self._at != (step, evaluating):
            self.close()
            self.injector = self.injector_at(step)
            self._at = (step, evaluating)
        self.injector.set_position(step, 0, evaluating=evaluating)

    def close(self) -> None:
        if self.injector is not None:
            self.records += self.injector.records
            self.injector.close()
            self.injector = None
            self._at = None

    # engine callback points
    def before_step(self, ctx) -> None:
        self._move(ctx.step, False)

    def before_evaluate(self, trainer) -> None:
        self._move(trainer.step, True)

    def after_backward(self, ctx) -> None:
        if ctx.micro_batch + 1 < ctx.trainer.config.grad_accum:
            self.injector.set_position(ctx.step, ctx.micro_batch + 1)
