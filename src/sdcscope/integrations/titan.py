"""The Guard inside torchtitan's ``Trainer`` (FSDP2, tensor parallel, HSDP as torchtitan applies them).

::

    from torchtitan.trainer import Trainer
    from sdcscope.integrations.titan import guard_titan

    trainer = Trainer(config)                                  # as torchtitan's train.py builds it
    sdc = guard_titan(trainer, "guard.yaml", run_dir="out/sdc")  # or a GuardConfig, a dict, None
    trainer.train()
    sdc.close()           # (also done by trainer.close())
    sdc.events            # as written to out/sdc/events.jsonl

torchtitan's extension points (model converters, ``post_optimizer_build_fn``, config overrides)
act on the model before training or after the update; none sits between the backward pass and the
optimizer step, where the guard decides. So, as the Hugging Face adapter does, the adapter wraps
three methods of the trainer *instance* (put back by :meth:`TitanGuard.close`):

* ``trainer.forward_backward_step`` (one gradient-accumulation micro-batch: forward, loss,
  backward): before the step's first micro-batch the guard begins the step (RNG, buffers,
  checksums of the local shards); after its last one (``trainer.gradient_accumulation_steps``)
  the guard checks the gradients and decides -- before ``train_step`` clips them
  (``training.max_norm``). A replay zeroes the gradients and runs every micro-batch of the step
  again through torchtitan's own ``forward_backward_step`` (every rank together: FSDP2 gathers,
  tensor parallel reduces); after a recompute the step's loss is the clean one.
* ``trainer.optimizers.step`` (torchtitan's ``OptimizersContainer``): the update under the guard's
  LR backoff followed by its checksums -- or nothing on a veto or rollback (the gradients were
  cleared too, so ``train_step`` clips nothing).
* ``trainer.should_continue_training``: false once the guard stopped (stalled, or a persistent
  fault: :attr:`Guard.stop_reason`), so ``train()`` ends after that step on every rank.

Steps are numbered from 0: torchtitan's step 1 is the guard's step 0. The model's parameters are
DTensors under every torchtitan data or model parallelism, so the guard runs in the sharded world
(:mod:`sdcscope.guard.sharded`): each rank checks what it holds and computes, the findings are
shared and every rank takes the same decision. The guard config is fitted to that world
(:data:`~sdcscope.common.world.SUPPORT`): per-step metrics and ZClip are off there. Under
torchtitan's ``ChunkedLossWrapper`` (its debug model's loss) the check of FSDP2's collectives is off
too (:data:`CHUNKED_LOSS`; refused if the config sets it).

Refused when the adapter is built, naming the setting: pipeline parallel (no world the guard
knows: each rank runs part of the layers), more than one model part or optimizer, a compiled
model (``compile.enable`` with ``"model"`` in ``compile.components``: the guard's module hooks
need eager mode), CUDA graphs (a replayed graph runs none of the guard's hooks: set
``training.disable_cuda_graphs``), CPU offload, and a multi-process run whose parameters are not
DTensors. Importing this module does not import torchtitan.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from sdcscope.common.world import world_of
from sdcscope.guard import Guard, GuardConfig
from sdcscope.integrations import GuardSession, Patches, load_config, open_guard
from sdcscope.observe.eventlog import EventCounts

__all__ = ["TitanGuard", "guard_titan"]

log = logging.getLogger("sdcscope.integrations.titan")


def guard_titan(
    trainer: Any,
    config: GuardConfig | str | os.PathLike | Mapping | None = None,
    *,
    run_dir: str | os.PathLike | None = None,
    on_event: Callable[[dict], None] | None = None,
) -> TitanGuard:
    """Guard ``trainer`` (a built ``torchtitan.trainer.Trainer``): settings checked and the guard
    attached now. ``run_dir`` (default ``<dump_folder>/sdcscope``) gets ``events.jsonl``;
    ``on_event(record)`` is called for every event as well."""
    return TitanGuard(trainer, config, run_dir=run_dir, on_event=on_event)


class TitanGuard:
    """The Guard's protocol in a torchtitan ``Trainer``; build it with :func:`guard_titan`."""

    def __init__(
        self,
        trainer: Any,
        config: GuardConfig | str | os.PathLike | Mapping | None = None,
        *,
        run_dir: str | os.PathLike | None = None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        if not all(hasattr(trainer, a) for a in ("forward_backward_step", "optimizers", "model_parts")):
            raise TypeError(f"guard_titan needs a torchtitan Trainer, got {type(trainer).__name__}")
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a directory path or None, got {run_dir!r}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a callable or None, got {on_event!r}")
        _check_supported(trainer)
        self.config = _fit_loss(load_config(config), trainer)
        (model,) = trainer.model_parts
        (optimizer,) = trainer.optimizers.optimizers
        self.trainer = trainer
        self.run_dir = Path(run_dir) if run_dir is not None else Path(trainer.config.dump_folder) / "sdcscope"
        self.on_event = on_event
        self.counts = EventCounts()
        """Detections, actions, replays and rollbacks so far."""
        self.guard: Guard = open_guard(model, optimizer, self.config, self.run_dir, self._count)
        self._session = GuardSession(self.guard)
        self._micro: list[tuple[dict, torch.Tensor]] = []  # the open step's micro-batches and losses
        self._patches = Patches()
        self._patches.set(trainer, "forward_backward_step", self._wrap_forward_backward)
        self._patches.set(trainer.optimizers, "step", self._wrap_optimizer_step)
        self._patches.set(trainer, "should_continue_training", self._wrap_should_continue)
        self._patches.set(trainer, "close", self._wrap_close)

    @property
    def events(self) -> list[dict]:
        return self.guard.events

    def close(self) -> None:
        """Put the trainer's methods back, detach the guard's hooks, close its files (idempotent)."""
        self._patches.undo()
        self.guard.close()
        self._micro = []

    def _count(self, record: dict) -> None:
        self.counts.add(record)
        if self.on_event is not None:
            self.on_event(record)

    # -- the wrapped methods -----------------------------------------------------------------
    def _wrap_forward_backward(self, forward_backward: Callable) -> Callable:
        def guarded(**kwargs):
            session, trainer = self._session, self.trainer
            if not session.open:
                self._micro = []
                session.begin(trainer.step - 1)
            loss = forward_backward(**kwargs)
            self._micro.append((kwargs, loss))
            if len(self._micro) < trainer.gradient_accumulation_steps:  # more micro-batches to come
                return loss
            earlier = [m[1].detach() for m in self._micro[:-1]]
            total = torch.stack([*earlier, loss.detach()]).sum()
            clean = session.check(total, lambda: self._rerun(forward_backward))
            if clean is total:
                return loss
            # train_step sums what forward_backward_step returns: make the step's sum the recomputed loss
            return clean - torch.stack(earlier).sum() if earlier else clean

        return guarded

    def _rerun(self, forward_backward: Callable) -> torch.Tensor:
        """The whole step again, every micro-batch from zeroed gradients (every rank together);
        torchtitan's token count is left as the step's first run set it."""
        trainer = self.trainer
        self._session.clear_grads()
        seen = trainer.ntokens_seen
        try:
            return torch.stack([forward_backward(**kwargs).detach() for kwargs, _ in self._micro]).sum()
        finally:
            trainer.ntokens_seen = seen

    def _wrap_optimizer_step(self, step: Callable) -> Callable:
        def guarded(*args, **kwargs):
            return self._session.update(lambda: step(*args, **kwargs))

        return guarded

    def _wrap_should_continue(self, should_continue: Callable) -> Callable:
        def guarded() -> bool:
            return should_continue() and not self.guard.stopped

        return guarded

    def _wrap_close(self, close: Callable) -> Callable:
        def guarded() -> None:
            self.close()
            close()

        return guarded


CHUNKED_LOSS = (
    "torchtitan's ChunkedLossWrapper runs the lm_head's backward once per chunk, so FSDP2 reduce-scatters its "
    "gradient once per chunk and accumulates the shards, while the collective check compares one "
    "reduce-scatter of a unit per step"
)


def _fit_loss(config: GuardConfig, trainer: Any) -> GuardConfig:
    """Under torchtitan's ``ChunkedLossWrapper`` the collective check cannot run (:data:`CHUNKED_LOSS`):
    the default's is switched off with a log line, one the user set is refused."""
    if type(trainer.loss_fn).__name__ != "ChunkedLossWrapper" or config.collectives is None:
        return config
    if config.collectives != GuardConfig().collectives:
        raise ValueError(f"guard collectives cannot run here: {CHUNKED_LOSS}; set collectives: null")
    log.info("guard collectives is off: %s", CHUNKED_LOSS)
    return dataclasses.replace(config, collectives=None)


def _check_supported(trainer: Any) -> None:
    """Refuse, naming the setting, what the adapter cannot guard correctly."""
    config, dims = trainer.config, trainer.parallel_dims
    problems = []
    if dims.pp_enabled:
        problems.append(
            f"pipeline parallel (parallelism.pipeline_parallel_degree={dims.pp}): each rank runs part of the "
            f"layers, a world the guard does not know"
        )
    if len(trainer.model_parts) != 1:
        problems.append(f"{len(trainer.model_parts)} model parts: the guard watches one model")
    if len(getattr(trainer.optimizers, "optimizers", ())) != 1:
        n = len(getattr(trainer.optimizers, "optimizers", ()))
        problems.append(f"{n} optimizers (optimizer.param_groups): the guard drives one optimizer")
    if config.compile.enable and "model" in config.compile.components:
        problems.append("compile.enable with 'model' in compile.components: the guard's module hooks need eager mode")
    if trainer.fwd_bwd_fn != trainer._forward_backward_body:
        problems.append(
            "CUDA graphs (training.disable_cuda_graphs=False): a replayed graph runs none of the guard's "
            "hooks; set training.disable_cuda_graphs=True"
        )
    if config.training.enable_cpu_offload:
        problems.append("training.enable_cpu_offload: the optimizer steps offloaded shards the guard does not see")
    if dims.world_size > 1 and len(trainer.model_parts) == 1 and not world_of(trainer.model_parts[0]).sharded:
        problems.append(
            "a multi-process run whose parameters are not DTensors (torchtitan's DDP, replicate()): the guard "
            "knows DDP as a DistributedDataParallel wrapper only; use FSDP (data_parallel_shard_degree)"
        )
    if problems:
        raise ValueError(
            "guard_titan cannot guard this Trainer: "
            + "; ".join(problems)
            + " (supported: FSDP2, tensor parallel and HSDP as torchtitan applies them, in eager mode)"
        )
