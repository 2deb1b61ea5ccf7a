"""Fault injection inside a Lightning ``Trainer``: faults at a chosen optimizer step and micro-batch.

::

    from sdcscope.integrations.lightning_inject import SDCInjectorCallback

    inj = SDCInjectorCallback("faults.yaml", run_dir="out/sdc")     # or FaultSpecs, dicts
    trainer = lightning.pytorch.Trainer(callbacks=[inj], accumulate_grad_batches=4, ...)
    trainer.fit(module, data)
    inj.records          # as written to out/sdc/injections.jsonl (exact values before and after)

A spec's ``schedule`` counts optimizer steps from 0 (``trainer.global_step`` while the step runs)
and, within a step, its micro-batches from 0 (``schedule.micro_batch``; the training batches of one
step under ``accumulate_grad_batches``): ``on_train_batch_start`` sets the
:class:`~sdcscope.inject.Injector`'s position. Validation is an evaluation pass at the current
step, where only permanent faults act. With the guard
(:class:`~sdcscope.integrations.lightning.SDCGuardCallback`) a replay of the step meets a
transient fault no more, a permanent one again. The injector is built when training starts (the
optimizer exists then) and detached when it ends; values already corrupted stay so. Works with
``lightning.pytorch`` and with ``pytorch_lightning``; ``pip install 'sdcscope[lightning]'``.

Under DDP (``strategy="ddp"``, one process per device) a spec's ``rank`` picks the process it
lives on (``trainer.global_rank``); rank r logs to ``injections.rank{r}.jsonl`` and rank 0 merges
them into ``injections.jsonl`` when training ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as exc:
        raise ImportError(
            "sdcscope.integrations.lightning_inject needs the 'lightning' package (or "
            "'pytorch_lightning'): pip install 'sdcscope[lightning]'"
        ) from exc

from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
from sdcscope.integrations.injection import Position, callback_args, merge_injections, open_injector

__all__ = ["SDCInjectorCallback"]


class SDCInjectorCallback(pl.Callback):
    """``run_dir`` (default ``<default_root_dir>/sdcscope``) gets ``injections.jsonl``; ``rank``:
    the process the faults' ``rank`` fields are compared with (None: this process's,
    ``trainer.global_rank``; 0 in a single-process fit)."""

    def __init__(
        self,
        specs: str | os.PathLike | FaultSpec | Mapping | Iterable,
        *,
        run_dir: str | os.PathLike | None = None,
        rank: int | None = None,
    ) -> None:
        self.specs, self.run_dir, self.rank = callback_args(specs, run_dir, rank)
        self.injector: Injector | None = None
        """The injector of the current (or last) fit: built when training starts."""
        self._position = Position()
        self._world: tuple[int, int, Path] | None = None  # (rank, world size, run_dir) of the fit

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every fired fault, as written to ``injections.jsonl``."""
        return self.injector.records if self.injector is not None else []

    def on_train_start(self, trainer, pl_module) -> None:
        self._close()
        optimizers = trainer.optimizers
        run_dir = self.run_dir if self.run_dir is not None else Path(trainer.default_root_dir) / "sdcscope"
        self.injector = open_injector(
            pl_module,
            self.specs,
            optimizers[0] if len(optimizers) == 1 else None,
            run_dir,
            grad_accum=trainer.accumulate_grad_batches,
            rank=trainer.global_rank if self.rank is None else self.rank,
            world_size=trainer.world_size,
        )
        self._world = (trainer.global_rank, trainer.world_size, run_dir)
        self._position = Position()

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        step, micro = self._position.at(trainer.global_step)
        self.injector.set_position(step, micro)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.injector is not None:  # not the sanity check before training
            self.injector.set_position(trainer.global_step, 0, evaluating=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()
        if self._world is not None:
            merge_injections(self._world[2], *self._world[:2])

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.injector is not None:
            self.injector.close()
