"""One injection experiment: the golden run and the faulty run from the same seed and data,
written as two run directories plus ``comparison.json``.

The specs are validated before anything is written, against a probe forward pass too (the shapes
a module site's fault lands on; and an evaluation pass, for the permanent faults that act there).
A faulty run in which no fault fired has the outcome ``not_fired`` (and ``fired: false``), never
``masked``: it says nothing about masking.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcscope._io import JsonlWriter
from sdcscope.engine import (
    CheckpointError, Run, TrainConfig, check_new_run_dir, load_checkpoint,
    save_checkpoint,
)
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector, corrupt_checkpoint_file, validate_specs
from sdcscope.inject.checkpoint import checkpoint_faults
from sdcscope.inject.targets import evaluated, probe_model
from sdcscope.study.compare import compare_runs, write_comparison
from sdcscope.workloads import WorkloadConfig


class CheckpointFault:
    """Engine callback for ``checkpoint`` specs: at a firing step the run saves a checkpoint,
    the bytes are corrupted on disk, and the run tries to restart from it. The sha256 manifest
    refuses it (an event), and training continues from the state in memory."""

    def __init__(self, specs: list[FaultSpec], run_dir: Path, injections: JsonlWriter,
                 events: JsonlWriter, rank: int = 0) -> None:
        self.specs = specs  # all of them: a record's spec index is the spec's position
        self.run_dir, self.injections, self.events, self.rank = run_dir, injections, events, rank
        self.fired = 0
        """Records written (corrupted checkpoint tensors)."""

    def after_step(self, ctx) -> None:
        step, model = ctx.trainer.step, ctx.trainer.model
        if not any(s.site == "checkpoint" and s.schedule.covers(step) for s in self.specs) \
                or not checkpoint_faults(self.specs, model.state_dict(), step, self.rank):
            return
        directory = self.run_dir / f"checkpoint-{step}"
        save_checkpoint(ctx.trainer.snapshot(), directory)
        for record in corrupt_checkpoint_file(directory / "state.pt", self.specs, rank=self.rank):
            self.injections.write(record)
            self.fired += 1
        try:
            ctx.trainer.restore(load_checkpoint(directory))
            verdict, action = "accepted", "restored from the corrupted checkpoint"
        except CheckpointError as exc:
            verdict, action = "refused", f"kept the in-memory state ({exc})"
        self.events.write({"step": step, "detector": "checkpoint_manifest", "verdict": verdict,
                           "module": None, "rank": self.rank, "evidence": {"path": str(directory)},
                           "action": action})


@dataclass
class Experiment:
    """Golden + faulty run of one workload with fault specs; validated on construction."""

    out: Path
    workload: WorkloadConfig
    train: TrainConfig
    specs: list[FaultSpec]
    guard: GuardConfig | None = None
    """With a guard config a third run, ``guarded/``, repeats the faulty run under the Guard."""
    steps: int | None = None
    """The run length, when known on construction: a schedule that never fires in it is refused
    here (:meth:`run` checks its own ``steps`` again, before writing anything)."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        check_new_run_dir(self.out)
        faults = [s.to_dict() for s in self.specs]
        self.golden = Run(self.out / "golden", self.workload, self.train, extra_config={"faults": []})
        self.faulty = _FaultyRun(self.out / "faulty", self.workload, self.train, self.specs)
        run = self.faulty.run
        batch = run.workload.batch(self.train.seed, 0, 0)
        self._validate(self.steps, probe_model(run.trainer.model, lambda model: run.workload.loss(model, batch),
                                               evaluate=run.workload.evaluate if evaluated(self.specs) else None))
        self.guarded = None
        if self.guard is not None:
            self.guarded = _FaultyRun(self.out / "guarded", self.workload, self.train, self.specs,
                                      guard=self.guard)
        self.config = {"faults": faults, "guard": None if self.guard is None else self.guard.to_dict()}

    def _validate(self, steps: int | None, probe=None) -> None:
        trainer = self.faulty.run.trainer
        validate_specs(trainer.model, self.specs, trainer.optimizer, steps=steps,
                       grad_accum=self.train.grad_accum, probe=probe)

    def run(self, steps: int, progress: Callable[[str, int], Any] | None = None) -> dict[str, Any]:
        def bar(label: str):
            return progress(label, steps) if progress else _null_bar()

        self._validate(steps)
        with bar("golden") as advance:
            self.golden.train(steps, on_step=advance)
        runs = [("faulty", self.faulty)] + ([("guarded", self.guarded)] if self.guarded else [])
        for label, run in runs:
            with bar(label) as advance:
                run.train(steps, on_step=advance)
        comparison = _compare(self.golden.out, self.faulty.run.out)
        if self.guarded is not None:
            comparison["guarded"] = _compare(self.golden.out, self.guarded.run.out)
            comparison["guarded"]["events"] = self.guarded.guard.events
        write_comparison(self.out, comparison)
        return comparison


def _compare(golden: Path, faulty: Path) -> dict[str, Any]:
    """:func:`compare_runs`, with ``fired``; a run in which no fault fired is ``not_fired``."""
    comparison = compare_runs(golden, faulty)
    comparison["fired"] = comparison["injections"] > 0
    if not comparison["fired"]:
        comparison["outcome"] = "not_fired"
        warnings.warn(f"no fault fired in {str(faulty)!r}: its outcome is not_fired (a target never "
                      "reached, e.g. a module not called or a first layer without dX, or a schedule that "
                      "missed every event)", stacklevel=3)
    return comparison


class _FaultyRun:
    """A run with the injector (and optionally the Guard) attached; writes injections/events."""

    def __init__(self, out: Path, workload: WorkloadConfig, train: TrainConfig, specs: list[FaultSpec],
                 guard: GuardConfig | None = None) -> None:
        extra = {"faults": [s.to_dict() for s in specs], "guard": None if guard is None else guard.to_dict()}
        self.run = Run(out, workload, train, extra_config=extra)
        t = self.run.trainer
        self.injections = JsonlWriter(out / "injections.jsonl")
        self.events = JsonlWriter(out / "events.jsonl")
        self.injector = Injector(t.model, specs, t.optimizer, log=self.injections.write,
                                 warn_unfired=False)   # reported as the not_fired outcome
        self.specs = specs
        self.guard = None
        if guard is not None:
            self.guard = Guard(t.model, t.optimizer, guard, rank=0, on_event=self.events.write)

    def train(self, steps: int, on_step=None) -> dict[str, Any]:
        callbacks = [self.injector.callback(),
                     CheckpointFault(self.specs, self.run.out, self.injections, self.events)]
        if self.guard is not None:
            callbacks.append(self.guard.callback(self.run.trainer))  # primed before any fault
        try:
            with self.injector:
                return self.run.train(steps, callbacks=callbacks, on_step=on_step)
        finally:
            if self.guard is not None:
                self.guard.detach()
            self.injections.close()
            self.events.close()


class _null_bar:
    def __enter__(self):
        return lambda metrics: None

    def __exit__(self, *exc):
        return None
