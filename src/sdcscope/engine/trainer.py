"""A small deterministic training loop with named callback points.

Callback points, in order within a step::

    before_step → [after_forward → after_backward] × micro-batches → before_optimizer_step
    → (optimizer step unless vetoed) → after_step;   before_evaluate → on_evaluate around evaluate()

A callback is any object with some of these methods, each taking a :class:`StepContext`.
``before_optimizer_step`` may veto the update by setting ``ctx.skip_update = True``.
Same seed ⇒ bitwise-identical parameters on CPU; the batch of a step is a pure function of
(seed, data position, micro-batch), so a snapshot restored later replays exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from sdcscope.common.validate import check_bool, check_non_negative, check_positive
from sdcscope.common.world import World
from sdcscope.engine.state import TrainState, apply, capture
from sdcscope.workloads import Workload

SEED_MAX = 2**64 - 1
"""The largest seed ``torch.manual_seed`` takes."""
CALLBACK_POINTS = (
    "before_step",
    "after_forward",
    "after_backward",
    "before_optimizer_step",
    "after_step",
    "before_evaluate",
    "on_evaluate",
)


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    eval_every: int = 0
    """Evaluate every N steps (0: only when asked, e.g. at the end of a run)."""
    compile: bool = False
    """Run each micro-batch's forward and backward as a ``torch.compile`` graph (inductor): what
    LLM training does. The guard's ABFT then checks through graph taps
    (:mod:`sdcscope.detect.abft.graph`) and the injector reaches GEMMs the same way; evaluation
    stays eager."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed={self.seed!r} must be an integer in 0..{SEED_MAX}")
        check_positive("grad_accum", self.grad_accum)
        check_non_negative("eval_every", self.eval_every)
        check_bool("compile", self.compile)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepContext:
    """What callbacks see. ``loss`` is the current micro-batch's loss (a tensor)."""

    trainer: Trainer
    step: int
    data_pos: int
    micro_batch: int = 0
    batch: Any = None
    loss: torch.Tensor | None = None
    step_loss: torch.Tensor | None = None
    """Mean loss over the micro-batches (a callback that recomputes the step replaces it)."""
    skip_update: bool = False
    restored: bool = False
    """Set by a callback that restored an earlier state (rollback): the step is not counted."""
    metrics: dict[str, Any] = field(default_factory=dict)
    grad_norms: tuple[list[torch.Tensor], list[int], torch.Tensor] | None = None
    """A callback that computed the gradients' norms before the update may leave them here:
    ``(gradients, their ._version values then, their 2-norms stacked as torch._foreach_norm gives
    them)``. The trainer takes its clipping norm from them when they cover exactly the gradients
    it clips, unchanged since (same tensors, same versions), and all share one device and dtype
    (so the norm is bitwise the one ``clip_grad_norm_`` would compute); otherwise it recomputes."""


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together, as ``torch.nn.utils.get_total_norm`` (torch ≥ 2.6)
    computes it; on older torch the same arithmetic (per-tensor norms in one fused pass, then
    the norm of those)."""
    get = getattr(torch.nn.utils, "get_total_norm", None)
    if get is not None:
        return get(tensors, foreach=True)
    if not tensors:
        return torch.tensor(0.0)
    dev = tensors[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in torch._foreach_norm(tensors)]))


def _shared_norm(shared, params: list[nn.Parameter], clip: float) -> torch.Tensor | None:
    """The total gradient norm from a callback's :attr:`StepContext.grad_norms`, if valid for
    ``params`` as they are (torch ≥ 2.6: ``clip_grads_with_norm_``), else None. Never while
    something observes ``clip_grad_norm_`` (the invariant recorder wraps it): it must see the call."""
    if shared is None or not hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        return None
    if clip > 0 and not getattr(torch.nn.utils.clip_grad_norm_, "__module__", "").startswith("torch."):
        return None
    grads, versions, norms = shared
    if len(grads) != len(params) or any(p.grad is not g or g._version != v for p, g, v in zip(params, grads, versions)):
        return None
    return torch.linalg.vector_norm(norms)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic algorithms while a compiled micro-batch runs (and compiles): inductor's CPU
    kernels otherwise accumulate with parallel atomics (an embedding's backward), so two runs of
    one seed differ in the last bits with more than one thread, and no replay reproduces a step."""
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)


class Trainer:
    def __init__(self, workload: Workload, config: TrainConfig | None = None, callbacks: Iterable[object] = ()) -> None:
        self.workload = workload
        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        self.model = workload.build_model()
        self.optimizer = workload.build_optimizer(self.model)
        self.callbacks: list[object] = list(callbacks)
        self.step = 0
        self.data_pos = 0
        self.lr_scale = 1.0
        self.skip_data: set[int] = set()
        self.world = World()
        self._compiled: nn.Module | None = None
        """The world the trainer lives in: one process here; a distributed trainer's is described
        from its wrapped model (:class:`~sdcscope.engine.distributed.DistTrainer`)."""

    # -- callbacks ---------------------------------------------------------------------------
    def add_callback(self, callback: object) -> None:
        self.callbacks.append(callback)

    def _emit(self, point: str, ctx: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, point, None)
            if fn is not None:
                fn(ctx)

    # -- training ----------------------------------------------------------------------------
    def _next_data_pos(self) -> int:
        pos = self.data_pos
        while pos in self.skip_data:
            pos += 1
        return pos

    def batch_for(self, data_pos: int, micro_batch: int) -> Any:
        """The batch of micro-batch ``micro_batch`` at data position ``data_pos`` (a pure function)."""
        return self.workload.batch(self.config.seed, data_pos, micro_batch)

    @contextlib.contextmanager
    def micro_step(self, micro_batch: int, accum: int) -> Iterator[nn.Module]:
        """Around the forward and backward pass of one micro-batch; yields the module to run.
        A data-parallel trainer yields its wrapper and holds back the gradient all-reduce until
        the last micro-batch; a compiling one, the compiled module (built once)."""
        if not self.config.compile:
            yield self.model
            return
        if self._compiled is None:
            self._compiled = torch.compile(self.model)
        with _deterministic():
            yield self._compiled

    def forward_backward(self, ctx: StepContext) -> torch.Tensor:
        """Run all micro-batches of ``ctx.step``; return the mean loss (a 0-d tensor)."""
        accum = self.config.grad_accum
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for m in range(accum):
            ctx.micro_batch = m
            ctx.batch = self.batch_for(ctx.data_pos, m)
            with self.micro_step(m, accum) as module:
                ctx.loss = self.workload.loss(module, ctx.batch)
                self._emit("after_forward", ctx)
                (ctx.loss / accum).backward()
            self._emit("after_backward", ctx)
            total = ctx.loss.detach() if total is None else total + ctx.loss.detach()
        return total / accum

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics (one host sync for loss and grad norm)."""
        self.model.train()
        ctx = StepContext(self, self.step, self._next_data_pos())
        self._emit("before_step", ctx)
        ctx.step_loss = self.forward_backward(ctx)
        lr = self.workload.lr_at(self.step) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._emit("before_optimizer_step", ctx)
        if ctx.restored:
            ctx.metrics.update(
                step=ctx.step, loss=float(ctx.step_loss), data_pos=ctx.data_pos, skipped=True, rolled_back_to=self.step
            )
            self._emit("after_step", ctx)
            return ctx.metrics
        loss = ctx.step_loss
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self.clip_gradients(params, self.workload.config.grad_clip, ctx)
        if not ctx.skip_update:
            self.optimizer.step()
        loss_v, norm_v = torch.stack([loss, grad_norm.detach().to(loss.dtype)]).tolist()
        lr = float(self.optimizer.param_groups[0]["lr"])  # as used: a callback may scale it (LR backoff)
        ctx.metrics.update(
            step=self.step, loss=loss_v, grad_norm=norm_v, lr=lr, data_pos=ctx.data_pos, skipped=ctx.skip_update
        )
        self.step += 1
        self.data_pos = ctx.data_pos + 1
        self._emit("after_step", ctx)
        return ctx.metrics

    def clip_gradients(self, params: list[nn.Parameter], clip: float, ctx: StepContext) -> torch.Tensor:
        """Clip the gradients to the global norm ``clip`` (0: no clipping); return that norm (a
        sharded world's trainer computes it over every shard: :mod:`sdcscope.engine.distributed`)."""
        grad_norm = _shared_norm(ctx.grad_norms, params, clip)
        if grad_norm is None:
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
                if clip > 0
                else total_norm([p.grad for p in params])
            )
        elif clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, grad_norm, foreach=True)
        return grad_norm

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self._emit("before_evaluate", self)
        self.model.eval()
        try:
            result = self.workload.evaluate(self.model)
        finally:
            self.model.train()
        result["step"] = self.step
        self._emit("on_evaluate", result)
        return result

    # -- state -------------------------------------------------------------------------------
    def snapshot(self) -> TrainState:
        return capture(
            self.model,
            self.optimizer,
            self.step,
            self.data_pos,
            self.lr_scale,
            extra={"skip_data": sorted(self.skip_data)},
        )

    def restore(self, state: TrainState) -> None:
        apply(state, self.model, self.optimizer)
        self.step, self.data_pos, self.lr_scale = state.step, state.data_pos, state.lr_scale
        self.skip_data = set(state.extra.get("skip_data", []))
