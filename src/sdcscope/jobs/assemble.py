"""One run with faults and a guard: the assembly shared by ``train``, ``inject``, campaigns and the
torchrun job.

Fault specs are validated once, before any output exists: against the model, a probe forward
pass (and an evaluation pass, for the faults that act there) and the run length. Then the
injector (``injections.jsonl``), the checkpoint faults and the guard (``events.jsonl``) are put
on the run's trainer in that order: a fault corrupts a value before any observer sees it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from sdcscope.engine import CheckpointError, Run, TrainConfig, load_checkpoint, save_checkpoint
from sdcscope.engine.rundir import JsonlWriter
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector, corrupt_checkpoint_file, probe_model, validate_specs
from sdcscope.inject.checkpoint import checkpoint_faults
from sdcscope.inject.collectives import check_collective_specs, is_collective
from sdcscope.inject.comm import check_comm_specs
from sdcscope.inject.probe import evaluated
from sdcscope.inject.targets import Target, resolve_targets
from sdcscope.workloads import Workload

__all__ = ["CheckpointFault", "FaultyRun", "GUARD_LOGS", "check_faults", "guard_trainer"]

GUARD_LOGS = ("run_dir", "shared")
"""Where a single-process run's guard writes its events: ``run_dir``: the Guard keeps
``events.jsonl`` itself (it exists from the start, empty on a clean run); ``shared``: through the
run's own events writer, as rank 0 (the file appears with the first event)."""


class CheckpointFault:
    """Engine callback for ``checkpoint`` specs: at a firing step the run saves a checkpoint,
    the bytes are corrupted on disk, and the run tries to restart from it. The sha256 manifest
    refuses it (an event), and training continues from the state in memory."""

    def __init__(
        self, specs: list[FaultSpec], run_dir: Path, injections: JsonlWriter, events: JsonlWriter, rank: int = 0
    ) -> None:
        self.specs = specs  # all of them: a record's spec index is the spec's position
        self.run_dir, self.injections, self.events, self.rank = run_dir, injections, events, rank
        self.fired = 0
        """Records written (corrupted checkpoint tensors)."""

    def after_step(self, ctx) -> None:
        step, model = ctx.trainer.step, ctx.trainer.model
        if not any(s.site == "checkpoint" and s.schedule.covers(step) for s in self.specs) or not checkpoint_faults(
            self.specs, model.state_dict(), step, self.rank
        ):
            return
        directory = self.run_dir / f"checkpoint-{step}"
        save_checkpoint(ctx.trainer.snapshot(), directory)  # atomic; raises StorageError when refused
        for record in corrupt_checkpoint_file(directory / "state.pt", self.specs, rank=self.rank):
            self.injections.write(record)
            self.fired += 1
        try:
            ctx.trainer.restore(load_checkpoint(directory))
            verdict, action = "accepted", "restored from the corrupted checkpoint"
        except CheckpointError as exc:
            verdict, action = "refused", f"kept the in-memory state ({exc})"
        self.events.write(
            {
                "step": step,
                "detector": "checkpoint_manifest",
                "verdict": verdict,
                "module": None,
                "rank": self.rank,
                "evidence": {"path": str(directory)},
                "action": action,
            }
        )


def check_faults(
    workload: Workload,
    model: nn.Module,
    optimizer: Optimizer | None,
    specs: Sequence[FaultSpec],
    *,
    train: TrainConfig,
    steps: int | None,
    world_size: int = 1,
    distributed: bool = False,
) -> dict[int, list[Target]]:
    """Validate ``specs`` against ``model`` before anything is written (raises ValueError/TypeError);
    the targets of the specs checked against the model, by their position among those.

    ``steps``: a schedule that never fires in the run is refused (None: not checked). In a
    ``distributed`` job, ``comm`` specs are checked against the gradient buckets (named by their
    position among all specs) and the others against the model (numbered among themselves)."""
    specs = list(specs)
    if distributed:

        def is_comm(spec: FaultSpec) -> bool:
            return spec.site == "comm"

        def is_fsdp(spec: FaultSpec) -> bool:  # comm.p2p lands on a pipeline's stage boundary (check_job)
            return is_collective(spec) and spec.site != "comm.p2p"

        for applies, check in ((is_comm, check_comm_specs), (is_fsdp, check_collective_specs)):
            mine = [(i, s) for i, s in enumerate(specs) if applies(s)]
            ids, subset = [i for i, _ in mine], [s for _, s in mine]
            check(model, subset, world_size=world_size, steps=steps, grad_accum=train.grad_accum, spec_ids=ids)
        specs = [s for s in specs if not is_comm(s) and not is_collective(s)]
    batch = workload.batch(train.seed, 0, 0)
    return validate_specs(
        model,
        specs,
        optimizer,
        world_size=world_size,
        steps=steps,
        grad_accum=train.grad_accum,
        probe=probe_model(
            model, lambda m: workload.loss(m, batch), evaluate=workload.evaluate if evaluated(specs) else None
        ),
    )


def guard_trainer(trainer: Any, config: GuardConfig, **wiring: Any) -> Guard:
    """The Guard over ``trainer``'s model and optimizer; ``wiring``: the Guard's keyword arguments
    (``run_dir``, ``on_event``, ``rank``, ``ddp``, ``ledger``, ``loss_fn``). A compiling trainer's
    ABFT checks through graph taps: hooks do nothing inside a compiled graph."""
    if trainer.config.compile and config.abft is not None and not config.abft.graph:
        config = dataclasses.replace(config, abft=dataclasses.replace(config.abft, graph=True))
    return Guard(trainer.model, trainer.optimizer, config, **wiring)


class FaultyRun:
    """A single-process :class:`Run` with its fault injector, checkpoint faults and guard: built,
    and so validated, before any output; armed while the ``with`` block (or :meth:`train`) runs.

    ``steps``: the run length the specs are checked against (None: unknown); ``validate=False``
    where the same specs were already checked against the same model architecture.
    ``warn_unfired=False`` where a fault that never fired is reported otherwise (an outcome)."""

    def __init__(
        self,
        run: Run,
        specs: Sequence[FaultSpec],
        guard: GuardConfig | None = None,
        *,
        steps: int | None = None,
        validate: bool = True,
        warn_unfired: bool = True,
        guard_log: str = "run_dir",
    ) -> None:
        if guard_log not in GUARD_LOGS:
            raise ValueError(f"guard_log={guard_log!r}; allowed: {', '.join(GUARD_LOGS)}")
        t = run.trainer
        self.run, self.specs = run, list(specs)
        self.injections = JsonlWriter(run.out / "injections.jsonl")
        self.events = JsonlWriter(run.out / "events.jsonl")
        self.callbacks: list[object] = []
        self.injector: Injector | None = None
        self.checkpoint: CheckpointFault | None = None
        self.guard: Guard | None = None
        if self.specs:
            if validate:
                targets = check_faults(run.workload, t.model, t.optimizer, self.specs, train=t.config, steps=steps)
            else:  # checked against this architecture already: only resolved on this model
                targets = {i: resolve_targets(t.model, spec) for i, spec in enumerate(self.specs)}
            # a resumed run restored its weights and optimizer state with its permanent faults in them
            self.injector = Injector(
                t.model,
                self.specs,
                t.optimizer,
                log=self.injections.write,
                resumed_at=t.step,
                warn_unfired=warn_unfired,
                targets=targets,
                graph=t.config.compile,
            )
            self.callbacks.append(self.injector.callback())
            if any(s.site == "checkpoint" for s in self.specs):
                self.checkpoint = CheckpointFault(self.specs, run.out, self.injections, self.events)
                self.callbacks.append(self.checkpoint)
        if guard is not None:
            wiring = {"run_dir": run.out} if guard_log == "run_dir" else {"rank": 0, "on_event": self.events.write}
            self.guard = guard_trainer(t, guard, **wiring)
            self.callbacks.append(self.guard.callback(t))  # primed before any fault

    @property
    def certify(self) -> Callable[[], bool | None] | None:
        """Whether the run's state is verified now (the guard's ``state_verified``), for the
        certification of each checkpoint; None without a guard (checkpoints record ``null``)."""
        if self.guard is None:
            return None
        return lambda: bool(self.guard.state_verified)

    @property
    def fired(self) -> int:
        """Faults fired in training (not evaluation) in this session, checkpoint faults included."""
        records = [] if self.injector is None else self.injector.records
        return sum(r.get("when") != "eval" for r in records) + (self.checkpoint.fired if self.checkpoint else 0)

    def __enter__(self) -> FaultyRun:
        if self.injector is not None:
            self.injector.attach()
        return self

    def __exit__(self, *exc) -> None:
        for tool in (self.injector, self.guard, self.injections, self.events):
            if tool is not None:
                tool.close()

    def train(self, steps: int, on_step: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        with self:
            return self.run.train(steps, callbacks=self.callbacks, on_step=on_step, certify=self.certify)
