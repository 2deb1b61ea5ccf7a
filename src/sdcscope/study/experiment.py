"""One injection experiment: the golden run and the faulty run from the same seed and data,
written as two run directories plus ``comparison.json``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdcscope._io import JsonlWriter
from sdcscope.engine import (
    CheckpointError, Run, TrainConfig, check_new_run_dir, load_checkpoint,
    save_checkpoint,
)
from sdcscope.faults import FaultSpec, fires
from sdcscope.inject import Injector, corrupt_checkpoint_file
from sdcscope.study.compare import compare_runs, write_comparison
from sdcscope.workloads import WorkloadConfig


class CheckpointFault:
    """Engine callback for ``checkpoint`` specs: at a firing step the run saves a checkpoint,
    the bytes are corrupted on disk, and the run tries to restart from it. The sha256 manifest
    refuses it (an event), and training continues from the state in memory."""

    def __init__(self, specs: list[FaultSpec], run_dir: Path, injections: JsonlWriter,
                 events: JsonlWriter, rank: int = 0) -> None:
        self.specs = [s for s in specs if s.site == "checkpoint"]
        self.run_dir, self.injections, self.events, self.rank = run_dir, injections, events, rank

    def after_step(self, ctx) -> None:
        step = ctx.trainer.step
        due = [s for s in self.specs if s.schedule.covers(step)
               and any(fires(s, step, None, t, self.rank) for t in s.target)]
        if not due:
            return
        directory = self.run_dir / f"checkpoint-{step}"
        save_checkpoint(ctx.trainer.snapshot(), directory)
        for record in corrupt_checkpoint_file(directory / "state.pt", due, rank=self.rank):
            self.injections.write(record)
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
    extra_callbacks: list[object] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        check_new_run_dir(self.out)
        faults = {"faults": [s.to_dict() for s in self.specs]}
        self.golden = Run(self.out / "golden", self.workload, self.train, extra_config={"faults": []})
        self.faulty = Run(self.out / "faulty", self.workload, self.train, extra_config=faults)
        t = self.faulty.trainer
        self.injections = JsonlWriter(self.out / "faulty" / "injections.jsonl")
        self.events = JsonlWriter(self.out / "faulty" / "events.jsonl")
        self.injector = Injector(t.model, self.specs, t.optimizer, log=self.injections.write)

    def run(self, steps: int, progress: Callable[[str, int], Any] | None = None) -> dict[str, Any]:
        def bar(label: str):
            return progress(label, steps) if progress else _null_bar()

        try:
            with bar("golden") as advance:
                self.golden.train(steps, on_step=advance)
            for name in ("injections.jsonl", "events.jsonl"):
                JsonlWriter(self.golden.out / name).touch()
            self.injections.touch()
            self.events.touch()
            callbacks = [self.injector.callback(), *self.extra_callbacks,
                         CheckpointFault(self.specs, self.faulty.out, self.injections, self.events)]
            with self.injector, bar("faulty") as advance:
                self.faulty.train(steps, callbacks=callbacks, on_step=advance)
        finally:
            self.injections.close()
            self.events.close()
        comparison = compare_runs(self.golden.out, self.faulty.out)
        write_comparison(self.out, comparison)
        return comparison


class _null_bar:
    def __enter__(self):
        return lambda metrics: None

    def __exit__(self, *exc):
        return None
