"""The Guard inside ``transformers.Trainer``.

::

    from sdcscope.integrations.hf import guard_trainer

    trainer = Trainer(model=model, args=args, train_dataset=data)
    sdc = guard_trainer(trainer, "guard.yaml", run_dir="out/sdc")  # or a GuardConfig, a dict, None
    trainer.train()
    sdc.events            # as written to out/sdc/events.jsonl; metrics in out/sdc/metrics.jsonl
    sdc.counts            # detections, actions, replays, rollbacks

Every training log the Trainer writes (``logging_steps``) also carries the guard's whole-model
metrics and event counts under ``sdcscope/`` (``sdcscope/detections``, ``sdcscope/actions/veto``,
``sdcscope/replays``, ``sdcscope/rollbacks``, ``sdcscope/grad_norm``, ...), so they reach every
``report_to`` logger (W&B, MLflow, TensorBoard, ...) with the Trainer's own ``loss``.

A ``TrainerCallback`` alone sees neither the step's inputs nor the optimizer's step, so the
adapter is bound to the trainer and, for the length of ``train()``, wraps three of its methods on
the instance (put back at the end):

* ``trainer.training_step`` (forward + backward of one micro-batch): before the step's first
  micro-batch the guard begins the step (RNG, buffers, state checksums); each micro-batch's
  arguments are kept; after the last one (``accelerator.sync_gradients``) the guard checks the
  gradients and decides -- *before* the Trainer clips them (``max_grad_norm``), so the detectors
  and the gradient-norm metrics see pre-clip gradients and a recompute is clipped like any step.
  A replay zeroes the gradients and runs the original ``training_step`` on every micro-batch of
  the step again (gradient accumulation is replayed whole). After a recompute the returned loss
  is the clean one, so the Trainer's logged ``loss`` is too.
* ``trainer.log``: a training log gets the guard's metrics and counts (above);
* ``trainer.optimizer.step`` (accelerate's wrapper): applied under the guard's LR backoff and
  followed by its metrics and checksums -- or skipped on a veto or rollback, leaving parameters
  and optimizer state untouched (gradients are cleared too, so the Trainer clips nothing).

The Trainer's step counter and LR schedule go on over a discarded step (as with a GradScaler
overflow). A rollback restores the model and optimizer of the guard's latest snapshot; the
Trainer does not re-run the steps since then, it trains on from the next batch. Steps are
numbered as ``trainer.state.global_step`` when they begin (0-based; the Trainer logs the count
after the update, one more). Once the guard stops (stalled: ``GuardConfig.stall_after`` steps
in a row discarded; or a persistent fault: :attr:`Guard.stopped`, with ``stop_reason``) the
adapter stops training after that step.

**Data parallel (DDP).** Launched by ``torchrun`` (or ``accelerate launch``), one process per
device, the Trainer wraps the model in ``DistributedDataParallel``; the adapter then builds the
Guard with ``ddp=`` (:mod:`sdcscope.guard.ranks`): each rank checks what it computed, every
rank's findings are shared and every rank takes the same decision each step (a collective: no
rank skips one). A finding is localized by replaying the suspect rank's micro-batches on itself
and on a healthy peer (the suspect sends them to the peer, only then:
:class:`~sdcscope.integrations.ddp.RankReplay`); events name the rank. A ``recompute`` becomes a
``veto`` (the replay is one rank's, not a world step), and a rank the device ledger calls
faulty is quarantined: it leaves the gradient average from the next step (its data is not
learned from) while the others train on. Rank 0 writes ``events.jsonl`` (the world's verdicts)
and ``metrics.jsonl``, rank r > 0 ``metrics.rank{r}.jsonl``. Under DDP the guard config's
``ranks`` section applies; ``invariants`` and ``qk_clip`` are refused.

Not supported, refused when the adapter is built (and again when training begins), naming the
setting: DeepSpeed, FSDP (``TrainingArguments.fsdp``: accelerate shards the model on GPUs only --
on CPU with gloo it trains DDP instead, which the adapter guards as DDP -- so the sharded step
cannot be run and checked here; Lightning's ``ModelParallelStrategy`` and torchtitan are the
guarded FSDP2 trainers), tensor/context parallelism (``parallelism_config``),
DataParallel over several GPUs in one process, fp16 mixed precision (its GradScaler),
``torch_compile`` and the LOMO optimizers (their update happens inside backward). Supported:
one process, or DDP with one process per device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "sdcscope.integrations.hf needs the 'transformers' package (with 'accelerate'): "
        "pip install 'sdcscope[transformers]'"
    ) from exc


from sdcscope.common.world import is_ddp
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.world import fit_config
from sdcscope.integrations import GuardSession, Patches, load_config, open_guard
from sdcscope.integrations.ddp import RankReplay
from sdcscope.observe.eventlog import EventCounts
from sdcscope.observe.sinks import LatestRow

__all__ = ["SDCGuardCallback", "guard_trainer"]


def guard_trainer(
    trainer: Trainer,
    config: GuardConfig | str | os.PathLike | Mapping | None = None,
    *,
    run_dir: str | os.PathLike | None = None,
    on_event: Callable[[dict], None] | None = None,
) -> SDCGuardCallback:
    """Guard ``trainer``'s training: build the callback (config and settings checked now) and add
    it to the trainer. ``run_dir`` (default ``<output_dir>/sdcscope``) gets ``events.jsonl`` and
    ``metrics.jsonl``; ``on_event(record)`` is called for every event as well."""
    callback = SDCGuardCallback(trainer, config, run_dir=run_dir, on_event=on_event)
    if any(isinstance(c, SDCGuardCallback) for c in trainer.callback_handler.callbacks):
        raise ValueError("this Trainer is guarded already: one guard_trainer() per Trainer")
    trainer.add_callback(callback)
    return callback


class SDCGuardCallback(TrainerCallback):
    """The Guard's protocol in ``transformers.Trainer``; build it with :func:`guard_trainer`
    (constructed alone, it does nothing until ``trainer.add_callback(it)``)."""

    def __init__(
        self,
        trainer: Trainer,
        config: GuardConfig | str | os.PathLike | Mapping | None = None,
        *,
        run_dir: str | os.PathLike | None = None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"SDCGuardCallback needs a transformers.Trainer, got {type(trainer).__name__}")
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a directory path or None, got {run_dir!r}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be a callable or None, got {on_event!r}")
        self.config = load_config(config)
        _check_supported(trainer)
        _check_distributed(trainer, self.config)
        self.trainer = trainer
        self.run_dir = Path(run_dir) if run_dir is not None else Path(trainer.args.output_dir) / "sdcscope"
        self.on_event = on_event
        self.guard: Guard | None = None
        """The guard of the current (or last) ``train()``: built when training begins."""
        self._session: GuardSession | None = None
        self._micro: list[tuple[tuple, dict, torch.Tensor]] = []  # the open step's micro-batches
        self._replay: RankReplay | None = None  # under DDP: a suspect rank's step, replayed
        self._training_step: Callable | None = None
        self._patches = Patches()
        self.counts = EventCounts()
        """Detections, actions, replays and rollbacks of the current (or last) ``train()``."""
        self._latest = LatestRow()

    @property
    def events(self) -> list[dict]:
        return self.guard.events if self.guard is not None else []

    # -- TrainerCallback ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs) -> None:
        """The optimizer exists from here on (the Trainer builds and wraps it in ``train()``)."""
        self._close()  # a train() again, or one retried by auto_find_batch_size
        trainer = self.trainer
        _check_supported(trainer)
        optimizer = trainer.optimizer
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        ddp = _ddp(trainer)
        self.counts, self._latest = EventCounts(), LatestRow()
        self.guard = open_guard(trainer.model, inner, self.config, self.run_dir, self._count, ddp=ddp)
        if self.guard.metrics is not None:
            self.guard.metrics.sinks.append(self._latest)
        self._session = GuardSession(self.guard)
        self._micro = []
        self._replay = RankReplay(self.guard, self._replay_batches) if self.guard.world.data_parallel else None
        self._patches.set(trainer, "training_step", self._wrap_training_step)
        self._patches.set(optimizer, "step", self._wrap_optimizer_step)
        self._patches.set(trainer, "log", self._wrap_log)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.guard is not None and self.guard.stopped:  # stalled, or a persistent fault: Guard.stop_reason
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._close()

    def _close(self) -> None:
        """Put the trainer's methods back, detach the guard's hooks, close its files."""
        self._patches.undo()
        if self.guard is not None:
            self.guard.close()
        self._micro = []
        self._replay = None

    def _count(self, record: dict) -> None:
        self.counts.add(record)
        if self.on_event is not None:
            self.on_event(record)

    def tracked(self) -> dict[str, float]:
        """What goes into the Trainer's training logs (``report_to``: W&B, MLflow, TensorBoard,
        ...): the guard's whole-model metrics of the latest step and its event counts, under
        ``sdcscope/``."""
        return {**self._latest.summary(), **self.counts.as_metrics()}

    # -- the wrapped methods -----------------------------------------------------------------
    def _wrap_log(self, log: Callable) -> Callable:
        """``Trainer.log(logs)``, which hands the logs to every ``report_to`` logger: a training
        log (one with ``loss``) gets :meth:`tracked` added first."""

        def logged(logs, *args, **kwargs):
            if isinstance(logs, dict) and "loss" in logs:
                logs = {**logs, **self.tracked()}
            return log(logs, *args, **kwargs)

        return logged

    def _wrap_optimizer_step(self, step: Callable) -> Callable:
        def guarded(*args, **kwargs):
            return self._session.update(lambda: step(*args, **kwargs))

        return guarded

    def _wrap_training_step(self, training_step: Callable) -> Callable:
        self._training_step = training_step  # the Trainer's own, for a rank replay

        def guarded(model, inputs, *args, **kwargs):
            session, trainer = self._session, self.trainer
            if not session.open:
                self._micro = []
                if self._replay is not None:
                    self._replay.start()
                session.begin(trainer.state.global_step)
            loss = training_step(model, inputs, *args, **kwargs)
            self._micro.append(((model, inputs, *args), kwargs, loss))
            if self._replay is not None:
                self._replay.add(((inputs, *args), kwargs))
            if not trainer.accelerator.sync_gradients:  # more micro-batches to come
                return loss
            earlier = [m[2] for m in self._micro[:-1]]
            total = torch.stack([*earlier, loss]).sum()
            if self._replay is not None:  # every rank decides together; the rank guard replays
                clean = session.check(total, None, self._replay)
            else:
                clean = session.check(total, lambda: self._rerun(training_step))
            if clean is total:
                return loss
            # the Trainer sums what training_step returns: make the step's sum the recomputed loss
            return clean - torch.stack(earlier).sum() if earlier else clean

        return guarded

    def _rerun(self, training_step: Callable) -> torch.Tensor:
        """The whole step again: every micro-batch, from zeroed gradients."""
        self._session.clear_grads()
        return torch.stack([training_step(*args, **kwargs) for args, kwargs, _ in self._micro]).sum()

    def _replay_batches(self, batches: list) -> torch.Tensor:
        """A rank's micro-batches (its own or a suspect's) through ``training_step`` on the plain
        module: the forward and backward without DDP's all-reduce."""
        module, step = self.trainer.model, self._training_step
        return torch.stack([step(module, *args, **kwargs) for args, kwargs in batches]).sum()


FSDP_REFUSED = (
    "FSDP (TrainingArguments.fsdp): accelerate shards the model on GPUs only (on CPU it trains DDP, which "
    "this adapter guards), so its sharded step under this adapter cannot be run and checked on CPU with gloo; "
    "for a guarded FSDP2 run use Lightning's ModelParallelStrategy (sdcscope.integrations.lightning), "
    "torchtitan (sdcscope.integrations.titan) or the Guard in your own loop over a fully_shard model"
)
"""The HF adapter's refusal of the Trainer's FSDP, with the reason."""


def _check_supported(trainer: Trainer) -> None:
    """Refuse, naming the setting, what the adapter cannot guard correctly."""
    args = trainer.args
    problems = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        problems.append("DeepSpeed (TrainingArguments.deepspeed): its engine owns the gradients and the optimizer step")
    if getattr(trainer, "is_fsdp_enabled", False):
        problems.append(FSDP_REFUSED)
    pc = getattr(trainer.accelerator, "parallelism_config", None) or getattr(args, "parallelism_config", None)
    sharded = [
        name
        for name in ("tp_size", "cp_size", "sp_size", "dp_shard_size")
        if isinstance(getattr(pc, name, 1), int) and getattr(pc, name, 1) > 1
    ]
    if sharded:
        problems.append(
            f"parallelism_config with {', '.join(f'{n}={getattr(pc, n)}' for n in sharded)}: the model is "
            f"sharded across ranks, and this adapter guards whole replicas only"
        )
    if args.n_gpu > 1:
        problems.append(f"DataParallel over n_gpu={args.n_gpu} GPUs: run one process per GPU")
    if args.fp16 or getattr(trainer.accelerator, "scaler", None) is not None:
        problems.append(
            "fp16 mixed precision (TrainingArguments.fp16): its GradScaler steps the optimizer; use bf16=True or fp32"
        )
    if args.torch_compile:
        problems.append("torch_compile=True: the guard's hooks on the model's modules need eager mode")
    if str(getattr(args.optim, "value", args.optim)) in ("lomo", "adalomo"):
        problems.append(f"optim={args.optim!r}: LOMO updates the weights inside backward, before any check")
    if problems:
        raise ValueError(
            "SDCGuardCallback cannot guard this Trainer: "
            + "; ".join(problems)
            + " (supported: one process, or DDP with one process per device)"
        )


def _ddp(trainer: Trainer) -> nn.Module | None:
    """The Trainer's DDP wrapper of its model in a data-parallel run (None in one process), checked
    when training begins (the Trainer wraps the model in ``train()``)."""
    if trainer.args.world_size <= 1:
        return None
    wrapped = trainer.model_wrapped
    if not is_ddp(wrapped) or wrapped.module is not trainer.model:
        raise ValueError(
            f"SDCGuardCallback cannot guard this Trainer: world_size={trainer.args.world_size} but the "
            f"model is wrapped in {type(wrapped).__name__}, not a DistributedDataParallel of "
            f"trainer.model (supported: one process, or DDP with one process per device)"
        )
    return wrapped


def _check_distributed(trainer: Trainer, config: GuardConfig) -> None:
    """Guard settings that cannot run under DDP, refused before training (not on every rank later)."""
    if trainer.args.world_size > 1:
        fit_config(config, "ddp")
