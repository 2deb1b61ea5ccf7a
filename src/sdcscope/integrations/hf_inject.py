"""Fault injection inside ``transformers.Trainer``: faults at a chosen optimizer step and micro-batch.

::

    from sdcscope.integrations.hf_inject import inject_trainer

    trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4), ...)
    inj = inject_trainer(trainer, "faults.yaml", run_dir="out/sdc")   # or FaultSpecs, dicts
    trainer.train()
    inj.records          # as written to out/sdc/injections.jsonl (exact values before and after)

A spec's ``schedule`` counts the Trainer's optimizer steps from 0 (``state.global_step`` when the
step begins) and, within a step, its micro-batches from 0 (``schedule.micro_batch``): the
callback sets the :class:`~sdcscope.inject.Injector`'s position in ``on_step_begin`` (micro-batch
0) and after each micro-batch (``on_substep_end``). Between steps -- evaluation, logging, saving --
the position is an evaluation pass at the next step, where only permanent faults act. With the
guard (:func:`~sdcscope.integrations.hf.guard_trainer`) a replay of the step meets a transient
fault no more (a re-execution), a permanent one again. The injector is built when training begins
(the optimizer exists then, for ``optimizer_state`` faults) and detached when it ends; values
already corrupted (a weight, a moment) stay so. ``pip install 'sdcscope[transformers]'``.

Under DDP (``torchrun``, one process per device) a spec's ``rank`` picks the process it lives on
(``args.process_index``); rank r logs to ``injections.rank{r}.jsonl`` and rank 0 merges them into
``injections.jsonl`` when training ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "sdcscope.integrations.hf_inject needs the 'transformers' package (with 'accelerate'): "
        "pip install 'sdcscope[transformers]'"
    ) from exc

from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, validate_specs
from sdcscope.integrations.injection import callback_args, merge_injections, open_injector

__all__ = ["SDCInjectorCallback", "inject_trainer"]


def inject_trainer(
    trainer: Trainer,
    specs: str | os.PathLike | FaultSpec | Mapping | Iterable,
    *,
    run_dir: str | os.PathLike | None = None,
    rank: int | None = None,
) -> SDCInjectorCallback:
    """Inject ``specs`` into ``trainer``'s training: check them against ``trainer.model`` and the
    world now (sites other than ``optimizer_state``, whose optimizer does not exist yet) and add
    the callback. ``run_dir`` (default ``<output_dir>/sdcscope``) gets ``injections.jsonl``;
    ``rank``: the process the specs' ``rank`` fields are compared with (None: this process's,
    ``args.process_index``)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"inject_trainer needs a transformers.Trainer, got {type(trainer).__name__}")
    callback = SDCInjectorCallback(specs, run_dir=run_dir, rank=rank)
    early = [s for s in callback.specs if s.site != "optimizer_state"]
    validate_specs(trainer.model, early, world_size=trainer.args.world_size)
    if any(isinstance(c, SDCInjectorCallback) for c in trainer.callback_handler.callbacks):
        raise ValueError("this Trainer has an injector already: one inject_trainer() per Trainer (give it every spec)")
    trainer.add_callback(callback)
    return callback


class SDCInjectorCallback(TrainerCallback):
    """Keeps an :class:`Injector`'s (step, micro-batch) position at the Trainer's; see the module
    docstring. ``trainer.add_callback(SDCInjectorCallback(specs))`` or :func:`inject_trainer`."""

    def __init__(
        self,
        specs: str | os.PathLike | FaultSpec | Mapping | Iterable,
        *,
        run_dir: str | os.PathLike | None = None,
        rank: int | None = None,
    ) -> None:
        self.specs, self.run_dir, self.rank = callback_args(specs, run_dir, rank)
        self.injector: Injector | None = None
        """The injector of the current (or last) ``train()``: built when training begins."""
        self._micro = 0
        self._world: tuple[int, int, Path] | None = None  # (rank, world size, run_dir) of the train()

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every fired fault, as written to ``injections.jsonl``."""
        return self.injector.records if self.injector is not None else []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        self._close()  # a train() again
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        run_dir = self.run_dir if self.run_dir is not None else Path(args.output_dir) / "sdcscope"
        self._world = (args.process_index, args.world_size, run_dir)
        self.injector = open_injector(
            model,
            self.specs,
            inner,
            run_dir,
            grad_accum=args.gradient_accumulation_steps,
            rank=args.process_index if self.rank is None else self.rank,
            world_size=args.world_size,
        )

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._micro = 0
        self.injector.set_position(state.global_step, 0)

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self._micro += 1
        self.injector.set_position(state.global_step, self._micro)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        # what runs before the next step (evaluation, logging, saving) meets permanent faults only
        self.injector.set_position(state.global_step, 0, evaluating=True)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._close()
        if self._world is not None:
            merge_injections(self._world[2], *self._world[:2])

    def _close(self) -> None:
        if self.injector is not None:
            self.injector.close()
