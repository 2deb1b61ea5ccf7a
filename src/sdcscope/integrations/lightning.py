"""The Guard inside a Lightning ``Trainer`` (automatic optimization).

::

    from sdcscope.integrations.lightning import SDCGuardCallback

    sdc = SDCGuardCallback("guard.yaml", run_dir="out/sdc")   # or a GuardConfig, a dict, None
    trainer = lightning.pytorch.Trainer(callbacks=[sdc], ...)
    trainer.fit(module, data)
    sdc.events          # as written to out/sdc/events.jsonl; metrics in out/sdc/metrics.jsonl
    sdc.counts          # detections, actions, replays, rollbacks

With a logger (``Trainer(logger=...)``: CSV, TensorBoard, W&B, MLflow, ...) every step also logs
the guard's whole-model metrics and event counts under ``sdcscope/`` (``sdcscope/detections``,
``sdcscope/actions/veto``, ``sdcscope/replays``, ``sdcscope/rollbacks``, ``sdcscope/grad_norm``,
...) through ``pl_module.log_dict`` (so ``log_every_n_steps`` applies).

Lightning runs each step as ``optimizer.step(closure)``: the closure runs ``training_step``,
``zero_grad`` and ``backward``; then come ``on_before_optimizer_step``, gradient clipping
(``gradient_clip_val``) and the update. The callback maps the guard onto it:

* ``on_train_batch_start`` -- the guard begins the step (RNG, buffers, state checksums);
* ``on_before_backward`` -- the step's loss;
* ``on_before_optimizer_step`` -- checks and decision, on the gradients before clipping; a
  replay zeroes them and calls the step's closure again, which is the natural re-execution:
  Lightning's own ``training_step`` + ``backward`` with the same batch (captured by wrapping the
  module's ``optimizer_step`` hook, which receives it). After a recompute the step's outputs
  are the clean run's. The replay runs the module's and callbacks' hooks again (``self.log``
  included: an ``on_epoch`` aggregate counts a replayed step twice);
* the optimizer's ``step`` is wrapped for the fit: it runs the closure, then applies the update
  under the guard's LR backoff -- or, on a veto or rollback, does not, leaving parameters and
  optimizer state untouched.

``trainer.global_step`` (the step's number) and the LR schedulers go on over a discarded step.
A rollback restores the module and optimizer of the guard's latest snapshot and training goes
on from the next batch. Once the guard stops (stalled: ``GuardConfig.stall_after`` steps in a row
discarded; or a persistent fault: :attr:`Guard.stopped`, with ``stop_reason``) the callback
stops training (``trainer.should_stop``).

**Data parallel (DDP).** With ``strategy="ddp"`` (or ``ddp_spawn``, ``ddp_fork``, ...; one
process per device, on GPUs or on CPUs with gloo) the callback builds the Guard with ``ddp=`` (the
strategy's ``DistributedDataParallel`` wrapper; :mod:`sdcscope.guard.ranks`): each rank checks
what it computed, every rank's findings are shared and every rank takes the same decision each
step (a collective: no rank skips one). A finding is localized by replaying the suspect rank's
batch -- its ``training_step`` and backward on the plain module, ``self.log`` muted -- on itself
and on a healthy peer (the suspect sends its batch to the peer, only then:
:class:`~sdcscope.integrations.ddp.RankReplay`); events name the rank. A ``recompute`` becomes a
``veto`` (the replay is one rank's, not a world step), and a rank the device ledger calls faulty
is quarantined: it leaves the gradient average from the next step while the others train on.
Rank 0 writes ``events.jsonl`` (the world's verdicts) and ``metrics.jsonl``, rank r > 0
``metrics.rank{r}.jsonl``. Under DDP the guard config's ``ranks`` section applies;
``invariants`` and ``qk_clip`` are refused.

**Sharded (FSDP2).** With ``ModelParallelStrategy`` (``fully_shard`` / ``parallelize_module``
in the module's ``configure_model``; on GPUs or on CPUs with gloo) the parameters are DTensors and
the Guard runs in the sharded world (:mod:`sdcscope.guard.sharded`): each rank checks what it
holds and computes, the findings are shared, every rank replays a suspect step together through
the step's closure (a collective), and a transient fault's clean re-execution is kept
(``recompute``). What the sharded world cannot run (per-step metrics, ZClip, ...) is fitted by
:data:`~sdcscope.common.world.SUPPORT`.

Refused when fitting starts, naming the setting and the reason: manual optimization (use the
Guard itself in ``training_step``), DeepSpeed, ``FSDPStrategy`` (FSDP1's flat parameters; use
``ModelParallelStrategy``), a strategy the callback does not know, more than one optimizer,
LBFGS (its step calls the closure many times), fp16 mixed precision (its GradScaler steps the
optimizer), and ``accumulate_grad_batches > 1`` with replay on (the closure holds the last
micro-batch only: set ``replay: false``, and findings are judged unverified -- vetoed by the
default policy). Works with ``lightning.pytorch`` and with ``pytorch_lightning``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError as exc:
        raise ImportError(
            "sdcscope.integrations.lightning needs the 'lightning' package (or "
            "'pytorch_lightning'): pip install 'sdcscope[lightning]'"
        ) from exc

from sdcscope.common.world import is_ddp, world_of
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.world import fit_config
from sdcscope.integrations import GuardSession, Patches, load_config, open_guard
from sdcscope.integrations.ddp import RankReplay
from sdcscope.observe.eventlog import EventCounts
from sdcscope.observe.sinks import LatestRow

__all__ = ["SDCGuardCallback"]


class SDCGuardCallback(pl.Callback):
    """``run_dir`` (default ``<default_root_dir>/sdcscope``) gets ``events.jsonl`` and
    ``metrics.jsonl``; ``on_event(record)`` is called for every event as well. The config is
    loaded and validated here, the trainer's settings when fitting starts."""

    def __init__(
        self,
        config: GuardConfig | str | os.PathLike | Mapping | None = None,
        *,
        run_dir: str | os.PathLike | None = None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a directory path or None, got {run_dir!r}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a callable or None, got {on_event!r}")
        self.config = load_config(config)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.on_event = on_event
        self.guard: Guard | None = None
        """The guard of the current (or last) fit: built when training starts."""
        self._session: GuardSession | None = None
        self._closure: Callable[[], Any] | None = None  # the open step's training_step + backward
        self._loss: torch.Tensor | None = None
        self._replaying = False
        self._replay: RankReplay | None = None  # under DDP: a suspect rank's step, replayed
        self._module: Any = None
        self._patches = Patches()
        self.counts = EventCounts()
        """Detections, actions, replays and rollbacks of the current (or last) fit."""
        self._latest = LatestRow()

    @property
    def events(self) -> list[dict]:
        return self.guard.events if self.guard is not None else []

    # -- Callback ----------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._check_supported(trainer, pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        """The optimizer exists from here on (the strategy builds it after ``setup``)."""
        self._close()
        self._check_supported(trainer, pl_module)
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"SDCGuardCallback guards one optimizer, got {len(optimizers)}")
        (optimizer,) = optimizers  # (one the Guard cannot drive, LBFGS, the Guard refuses)
        run_dir = self.run_dir if self.run_dir is not None else Path(trainer.default_root_dir) / "sdcscope"
        ddp = _ddp(trainer, pl_module)
        _check_sharded(trainer, pl_module)
        self.counts, self._latest = EventCounts(), LatestRow()
        self.guard = open_guard(pl_module, optimizer, self.config, run_dir, self._count, ddp=ddp)
        if self.guard.metrics is not None:
            self.guard.metrics.sinks.append(self._latest)
        self._session = GuardSession(self.guard)
        self._module = pl_module
        self._replay = RankReplay(self.guard, self._replay_batches) if self.guard.world.data_parallel else None
        self._patches.set(pl_module, "optimizer_step", self._wrap_module_optimizer_step)
        self._patches.set(optimizer, "step", self._wrap_optimizer_step)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if not self._session.open:  # the step's first micro-batch
            self._loss = None
            if self._replay is not None:
                self._replay.start()
            self._session.begin(trainer.global_step)
        if self._replay is not None:
            self._replay.add((batch, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not self._replaying:  # a replay's loss is the closure's return value
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._replay is not None:  # every rank decides together; the rank guard replays
            self._session.check(self._loss, None, self._replay)
            return
        replayable = self._closure is not None and trainer.accumulate_grad_batches == 1
        self._session.check(self._loss, self._rerun if replayable else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        if trainer.loggers and not self._session.open:  # the step's update is done: log it
            pl_module.log_dict(self.tracked(), on_step=True, on_epoch=False, batch_size=1)
        if self.guard.stopped:  # stalled, or a persistent fault: Guard.stop_reason
            trainer.should_stop = True

    def _count(self, record: dict) -> None:
        self.counts.add(record)
        if self.on_event is not None:
            self.on_event(record)

    def tracked(self) -> dict[str, float]:
        """What goes to the trainer's loggers each step: the guard's whole-model metrics of the
        latest step and its event counts, under ``sdcscope/``."""
        return {**self._latest.summary(), **self.counts.as_metrics()}

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        """Put the module's and optimizer's methods back, detach the guard, close its files."""
        self._patches.undo()
        if self.guard is not None:
            self.guard.close()
        self._closure = None
        self._replay = self._module = None

    # -- the wrapped methods -----------------------------------------------------------------
    def _wrap_module_optimizer_step(self, optimizer_step: Callable) -> Callable:
        """``LightningModule.optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)``:
        the one place that is handed the step's closure."""

        def guarded(*args, **kwargs):
            self._closure = args[3] if len(args) > 3 else kwargs.get("optimizer_closure")
            try:
                return optimizer_step(*args, **kwargs)
            finally:
                self._closure = None

        return guarded

    def _wrap_optimizer_step(self, step: Callable) -> Callable:
        """The torch optimizer's ``step(closure)``: the closure (forward, backward, the guard's
        decision, clipping) runs first, as the optimizer itself would run it; the update follows
        unless the step is discarded."""

        def guarded(closure=None, **kwargs):
            if closure is None:
                return self._session.update(lambda: step(**kwargs))
            with torch.enable_grad():
                result = closure()
            self._session.update(lambda: step(**kwargs))
            return result

        return guarded

    def _rerun(self) -> torch.Tensor:
        self._session.clear_grads()
        self._replaying = True
        try:
            return self._closure()  # Lightning's closure returns the step's loss, detached
        finally:
            self._replaying = False

    def _replay_batches(self, batches: list) -> torch.Tensor:
        """A rank's batch (its own or a suspect's): ``training_step`` and backward on the plain
        module (no all-reduce), as the step's closure runs them, with ``self.log`` muted (a
        replay's values are no step's, and ``sync_dist`` would be a collective)."""
        module = self._module
        mute = Patches()
        for name in ("log", "log_dict"):
            mute.set(module, name, lambda _original: _muted)
        total = None
        try:
            with self._trainer_context():
                for batch, batch_idx in batches:
                    out = module.training_step(batch, batch_idx)
                    loss = out if isinstance(out, torch.Tensor) else out["loss"]
                    module.backward(loss)
                    total = loss.detach() if total is None else total + loss.detach()
        finally:
            mute.undo()
        return total

    def _trainer_context(self):
        """The precision plugin's context of a training step (autocast under bf16-mixed)."""
        return self._module.trainer.strategy.precision_plugin.train_step_context()

    def _check_supported(self, trainer, pl_module) -> None:
        """Refuse, naming the setting, what the callback cannot guard correctly."""
        problems = []
        if not pl_module.automatic_optimization:
            problems.append(
                "manual optimization (automatic_optimization=False): call the Guard yourself in "
                "training_step (guard.step(...), guard.optimizer_step(loss))"
            )
        kinds = {c.__name__ for c in type(trainer.strategy).__mro__}
        name = type(trainer.strategy).__name__
        if "DDPStrategy" in kinds and "DeepSpeedStrategy" not in kinds:
            fit_config(self.config, "ddp")
        elif "ModelParallelStrategy" in kinds:
            fit_config(self.config, "sharded")
        elif "SingleDeviceStrategy" not in kinds:
            why = next((why for kind, why in REFUSED.items() if kind in kinds), "not a strategy this callback knows")
            problems.append(f"strategy {name}: {why} (supported: {SUPPORTED})")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            problems.append(f"precision={trainer.precision!r}: its GradScaler steps the optimizer; use bf16 or fp32")
        if self.config.replay and trainer.accumulate_grad_batches > 1:
            problems.append(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} with replay: the step's "
                f"closure holds its last micro-batch only; set the guard's replay to false "
                f"(findings are then judged unverified) or accumulate_grad_batches=1"
            )
        if problems:
            raise ValueError("SDCGuardCallback cannot guard this fit: " + "; ".join(problems))


SUPPORTED = (
    "single-device; DDP -- strategy='ddp', 'ddp_spawn', 'ddp_fork', ...; or ModelParallelStrategy with "
    "fully_shard / parallelize_module in configure_model"
)
REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed's engine owns the gradients and the optimizer step, out of the guard's reach",
    "FSDPStrategy": "FSDP1 (FullyShardedDataParallel) flattens the parameters into FlatParameters, which the "
    "guard's per-tensor checks cannot address (and Lightning runs it on GPUs only); shard with FSDP2 instead: "
    "ModelParallelStrategy with fully_shard in configure_model",
}
"""Strategies refused by name, with the reason (the first of a strategy's classes found here)."""


def _muted(*args, **kwargs) -> None:
    """``LightningModule.log`` during a rank replay."""


def _ddp(trainer, pl_module) -> nn.Module | None:
    """The DDP strategy's wrapper of ``pl_module`` (None under a single-device strategy)."""
    if not any(c.__name__ == "DDPStrategy" for c in type(trainer.strategy).__mro__):
        return None
    wrapped = trainer.strategy.model
    if not is_ddp(wrapped) or wrapped.module is not pl_module:
        raise ValueError(
            f"SDCGuardCallback cannot guard this fit: strategy {type(trainer.strategy).__name__} wraps the "
            f"module in {type(wrapped).__name__}, not a DistributedDataParallel of the LightningModule"
        )
    return wrapped


def _check_sharded(trainer, pl_module) -> None:
    """Under ``ModelParallelStrategy`` the module's parameters must be DTensors once
    ``configure_model`` ran: plain ones would be a replica per rank with no gradient average."""
    if "ModelParallelStrategy" in {c.__name__ for c in type(trainer.strategy).__mro__}:
        if not world_of(pl_module).sharded:
            raise ValueError(
                "SDCGuardCallback cannot guard this fit: strategy ModelParallelStrategy but no parameter of the "
                "LightningModule is a DTensor; apply fully_shard or parallelize_module in configure_model"
            )
