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

from sdcscope.engine import Run, TrainConfig, check_new_run_dir
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.inject import validate_specs
from sdcscope.jobs import FaultyRun
from sdcscope.study.compare import compare_runs, write_comparison
from sdcscope.workloads import WorkloadConfig


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
        self.golden = Run(self.out / "golden", self.workload, self.train, extra_config={"faults": []})
        self.faulty = self._faulty("faulty", steps=self.steps)  # validates the specs
        self.guarded = None
        if self.guard is not None:  # the same model architecture: validated above
            self.guarded = self._faulty("guarded", guard=self.guard, validate=False)
        self.config = {
            "faults": [s.to_dict() for s in self.specs],
            "guard": None if self.guard is None else self.guard.to_dict(),
        }

    def _faulty(self, label: str, guard: GuardConfig | None = None, **kw: Any) -> FaultyRun:
        extra = {"faults": [s.to_dict() for s in self.specs], "guard": None if guard is None else guard.to_dict()}
        run = Run(self.out / label, self.workload, self.train, extra_config=extra)
        # a fault that never fired is reported as the not_fired outcome
        return FaultyRun(run, self.specs, guard, warn_unfired=False, guard_log="shared", **kw)

    def run(self, steps: int, progress: Callable[[str, int], Any] | None = None) -> dict[str, Any]:
        def bar(label: str):
            return progress(label, steps) if progress else _null_bar()

        if steps != self.steps:  # the schedules against this run length
            trainer = self.faulty.run.trainer
            validate_specs(trainer.model, self.specs, trainer.optimizer, steps=steps, grad_accum=self.train.grad_accum)
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
        warnings.warn(
            f"no fault fired in {str(faulty)!r}: its outcome is not_fired (a target never "
            "reached, e.g. a module not called or a first layer without dX, or a schedule that "
            "missed every event)",
            stacklevel=3,
        )
    return comparison


class _null_bar:
    def __enter__(self):
        return lambda metrics: None

    def __exit__(self, *exc):
        return None
