"""A training run bound to a run directory: config.json, metrics.jsonl, summary.json, checkpoint/.

All validation happens before the folder is created, so bad input leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sdcscope import __version__
from sdcscope.engine.rundir import JsonlWriter, check_new_run_dir, write_json
from sdcscope.engine.state import TrainState, load_checkpoint, param_sha256, save_checkpoint
from sdcscope.engine.trainer import TrainConfig, Trainer
from sdcscope.workloads import WorkloadConfig, make_workload

CHECKPOINT_DIR = "checkpoint"


class Run:
    """Train a workload into ``out``; ``Run.resume(out)`` continues a run from its checkpoint."""

    def __init__(self, out: str | Path, workload: WorkloadConfig, train: TrainConfig, *,
                 extra_config: dict[str, Any] | None = None, _state: TrainState | None = None,
                 _config: dict[str, Any] | None = None) -> None:
        self.out = Path(out)
        if _state is None:
            check_new_run_dir(self.out)
        self.workload = make_workload(workload)  # may raise (missing corpus): before any output
        self.trainer = Trainer(self.workload, train)
        self.config = _config or {
            "sdcscope_version": __version__,
            "workload": workload.to_dict(),
            "train": train.to_dict(),
            "data": self.workload.describe(),
            **(extra_config or {}),
        }
        self.summary: dict[str, Any] = {}
        if _state is not None:
            self.trainer.restore(_state)

    @classmethod
    def resume(cls, out: str | Path) -> "Run":
        out = Path(out)
        config_path = out / "config.json"
        if not config_path.is_file():
            raise ValueError(f"--resume {str(out)!r} is not a run directory (no config.json)")
        config = json.loads(config_path.read_text())
        state = load_checkpoint(out / CHECKPOINT_DIR)
        return cls(out, WorkloadConfig(**config["workload"]), TrainConfig(**config["train"]),
                   _state=state, _config=config)

    @property
    def resumed(self) -> bool:
        return (self.out / "config.json").exists()

    def train(self, steps: int, *, callbacks: Iterable[object] = (),
              on_step: Callable[[dict[str, Any]], None] | None = None,
              stop_on_nonfinite: bool = True) -> dict[str, Any]:
        """Train until ``steps`` optimizer steps in total; write metrics, checkpoint, summary."""
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0")
        if steps < self.trainer.step:
            raise ValueError(f"steps={steps} is below the {self.trainer.step} steps this run already has")
        resumed = self.resumed
        self.out.mkdir(parents=True, exist_ok=True)
        self.config["steps"] = steps
        write_json(self.out / "config.json", self.config)
        for cb in callbacks:
            self.trainer.add_callback(cb)
        metrics = JsonlWriter(self.out / "metrics.jsonl")
        if resumed:
            metrics.truncate_after("step", self.trainer.step)
        metrics.touch()
        for name in ("injections.jsonl", "events.jsonl"):  # part of the contract, even when empty
            JsonlWriter(self.out / name).touch()
        t0 = time.perf_counter()
        outcome, last = "completed", {}
        eval_every = self.trainer.config.eval_every
        try:
            while self.trainer.step < steps:
                last = self.trainer.train_step()
                if eval_every and self.trainer.step % eval_every == 0:
                    last.update({f"eval_{k}": v for k, v in self.trainer.evaluate().items() if k != "step"})
                metrics.write(last)
                if on_step is not None:
                    on_step(last)
                if not math.isfinite(last["loss"]):
                    outcome = "crash"
                    if stop_on_nonfinite:
                        break
        finally:
            metrics.close()
        wall = time.perf_counter() - t0
        final_eval = self.trainer.evaluate()
        save_checkpoint(self.trainer.snapshot(), self.out / CHECKPOINT_DIR)
        self.summary = {
            "outcome": outcome,
            "final_train_loss": last.get("loss"),
            "final_val_loss": final_eval.get("val_loss"),
            **{f"final_{k}": v for k, v in final_eval.items() if k not in ("val_loss", "step")},
            "param_sha256": param_sha256(self.trainer.model),
            "steps": self.trainer.step,
            "wall_seconds": round(wall, 4),
        }
        val_loss = self.summary["final_val_loss"]
        if val_loss is not None and not math.isfinite(val_loss):
            self.summary["outcome"] = "crash"
        write_json(self.out / "summary.json", self.summary)
        return self.summary

