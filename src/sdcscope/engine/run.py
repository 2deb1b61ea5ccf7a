"""A training run bound to a run directory: config.json, metrics.jsonl, summary.json, checkpoint/.

All validation happens before the folder is created, so bad input leaves nothing behind. A run
stopped by SIGINT or SIGTERM finishes its step, saves its checkpoint and summary, and raises
:class:`Interrupted`; ``Run.resume(out)`` continues it. Periodic checkpoints
(:class:`~sdcscope.engine.rundir.CheckpointPolicy`) make a run killed outright (``kill -9``, a lost
node) resumable from its newest complete checkpoint, bitwise as if it had not stopped. A write the
storage refuses (disk full, read-only) raises :class:`~sdcscope.common.storage.StorageError`; a
resume that fails so leaves config.json as it was, a new run that fails before its first
checkpoint leaves nothing.
"""

from __future__ import annotations

import contextlib
import copy
import math
import reprlib
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from sdcscope import __version__
from sdcscope.common.io import write_bytes_atomic
from sdcscope.common.storage import storage_cause, writing
from sdcscope.common.validate import build_config
from sdcscope.engine.resources import check_memory
from sdcscope.engine.rundir import (
    CHECKPOINT_DIR,
    LOG_FILES,
    CheckpointPolicy,
    JsonlWriter,
    as_written,
    check_new_run_dir,
    has_checkpoint,
    periodic_dir,
    pick_checkpoint,
    prune_checkpoints,
    read_json,
    read_jsonl,
    remove_incomplete_checkpoints,
    remove_stale_temps,
    write_json,
)
from sdcscope.engine.state import CheckpointError, param_sha256, save_checkpoint
from sdcscope.engine.trainer import TrainConfig, Trainer
from sdcscope.workloads import WorkloadConfig, make_workload

__all__ = ["Run", "Interrupted", "CHECKPOINT_DIR"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal at a step boundary; the checkpoint and ``summary`` are saved."""

    def __init__(self, signum: int, summary: dict[str, Any]) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {summary['steps']}")
        self.signum, self.summary = signum, summary


@contextlib.contextmanager
def stop_requests() -> Iterator[list[int]]:
    """Collect SIGINT/SIGTERM while training (the list of signals received), so the loop stops at
    a step boundary; a second signal acts at once. Only handlers still at Python's defaults are
    replaced, and only in the main thread (the only one that may set them)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    previous = {s: h for s, h in previous.items() if h in (signal.default_int_handler, signal.SIG_DFL)}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    def request(signum, frame) -> None:
        received.append(signum)
        restore()

    for s in previous:
        signal.signal(s, request)
    try:
        yield received
    finally:
        restore()


def _differences(a: Any, b: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (a's value, b's value)}`` wherever two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {
            k: v
            for key in sorted(a.keys() | b.keys(), key=str)
            for k, v in _differences(a.get(key), b.get(key), f"{prefix}{key}.").items()
        }
    return {} if a == b else {prefix[:-1]: (a, b)}


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must share with config.json to continue the run: everything that shapes
    the parameters (the evaluation cadence and the guard may change on resume)."""
    train = {k: v for k, v in config["train"].items() if k != "eval_every"}
    return as_written({"workload": config["workload"], "train": train, "faults": config.get("faults") or []})


def _follow(losses: dict[int, Any], row: dict[str, Any]) -> None:
    """Keep ``losses`` (step → logged loss of each applied step) on the trajectory of the training
    state: a rollback to step S drops the steps from S on (they are trained again, or never)."""
    back = row.get("rolled_back_to")
    if isinstance(back, int):
        for k in [k for k in losses if k >= back]:
            del losses[k]
    elif not row.get("skipped") and "step" in row:
        losses[row["step"]] = row.get("loss")


class Run:
    """Train a workload into ``out``; ``Run.resume(out)`` continues a run from its checkpoint."""

    def __init__(
        self,
        out: str | Path,
        workload: WorkloadConfig,
        train: TrainConfig,
        *,
        extra_config: dict[str, Any] | None = None,
        checkpoints: CheckpointPolicy | None = None,
        _config: dict[str, Any] | None = None,
    ) -> None:
        self.out = Path(out)
        if _config is None:
            check_new_run_dir(self.out)
        self._fresh = not self.out.exists() or not any(self.out.iterdir())  # see _undo
        self._existed = self.out.exists()
        self.workload = make_workload(workload)  # may raise (missing corpus): before any output
        check_memory(self.workload)
        self.trainer = Trainer(self.workload, train)
        self.checkpoints = checkpoints or CheckpointPolicy()
        self.resumed_from: Path | None = None
        """The checkpoint :meth:`resume` continued from."""
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        """Newer checkpoints :meth:`resume` passed over (incomplete, tampered, uncertified) and why."""
        self.config = _config or {
            "sdcscope_version": __version__,
            "workload": workload.to_dict(),
            "train": train.to_dict(),
            "data": self.workload.describe(),
            **(extra_config or {}),
        }
        self._written = copy.deepcopy(_config)  # config.json as on disk (None before the first write)
        self.summary: dict[str, Any] = {}

    @classmethod
    def resume(cls, out: str | Path, *, checkpoints: CheckpointPolicy | None = None) -> Run:
        """The run in ``out`` at its newest complete, certified checkpoint
        (:func:`~sdcscope.engine.rundir.pick_checkpoint`); refused (ValueError) unless
        config.json, the data and the checkpoint agree. ``checkpoints``: the periodic checkpoint
        policy from here on (None: the one config.json records). Nothing is written."""
        out = Path(out)
        path = out / "config.json"
        if not path.is_file():
            raise ValueError(f"--resume {str(out)!r} is not a run directory (no config.json)")
        config = read_json(path)
        world = config.get("world_size", 1)
        if world != 1:
            raise ValueError(
                f"--resume {str(out)!r}: the run was trained on {world} ranks (world_size in "
                f"{str(path)!r}): it resumes on its ranks (sdcscope train --resume, "
                "sdcscope.jobs.torchrun.resume_job), not in one process"
            )
        try:
            wcfg = build_config(WorkloadConfig, config.get("workload"), "workload")
            tcfg = build_config(TrainConfig, config.get("train"), "train")
            checkpoints = checkpoints or CheckpointPolicy.recorded(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from None
        if not has_checkpoint(out):
            raise CheckpointError(
                f"--resume {str(out)!r}: the run saved no checkpoint ({CHECKPOINT_DIR}/ is "
                "missing or incomplete), so it cannot be continued; train it again in a new "
                "or empty folder"
            )
        checkpoint, manifest, skipped, state = pick_checkpoint(out)
        recorded = manifest.get("run")
        diff = {} if recorded is None else _differences(_identity(config), recorded)
        if diff:
            raise CheckpointError(
                f"{str(path)!r} does not match the run's checkpoint: "
                + "; ".join(
                    f"{k} is {reprlib.repr(now)} but the checkpoint was trained with {reprlib.repr(then)}"
                    for k, (now, then) in diff.items()
                )
                + " (config.json was edited? a resumed run keeps its configuration)"
            )
        run = cls(out, wcfg, tcfg, checkpoints=checkpoints, _config=config)
        run.resumed_from, run.skipped_checkpoints = checkpoint, skipped
        data = _differences(config.get("data"), as_written(run.workload.describe()))
        if "data" in config and data:
            raise ValueError(
                f"{str(path)!r} does not match the workload it describes: "
                f"{', '.join(f'data.{k}' for k in data)} differ (config.json was edited, or the "
                "data changed since the run started; a resumed run needs the same model and data)"
            )
        if state is None:
            raise CheckpointError(
                f"{str(checkpoint)!r} is a sharded checkpoint (torch.distributed.checkpoint) of a distributed run; "
                "it loads on the ranks that wrote it: sdcscope train --resume RUN_DIR relaunches them"
            )
        try:
            run.trainer.restore(state)
        except (RuntimeError, ValueError, KeyError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise CheckpointError(
                f"the checkpoint in {str(checkpoint)!r} does not fit the model {str(path)!r} "
                f"describes ({lines[-1] if lines else type(exc).__name__})"
            ) from None
        if (out / "summary.json").is_file():
            run.summary = read_json(out / "summary.json")
        for name in LOG_FILES:  # a corrupt log is refused before anything is written
            read_jsonl(out / name)
        return run

    def reached(self, steps: int) -> bool:
        """Whether the run already has ``steps`` steps and their summary (:meth:`train` keeps them)."""
        return self.summary.get("steps") == steps == self.trainer.step

    def train(
        self,
        steps: int,
        *,
        callbacks: Iterable[object] = (),
        on_step: Callable[[dict[str, Any]], None] | None = None,
        stop_on_nonfinite: bool = True,
        certify: Callable[[], bool | None] | None = None,
    ) -> dict[str, Any]:
        """Train until ``steps`` optimizer steps in total; write metrics, checkpoints, summary.

        ``certify()``: whether the state at a checkpoint is verified (a guard's
        ``state_verified``), recorded in its manifest; None: no guard watched.

        A run that already has ``steps`` steps and their summary is left as it is. A non-finite
        loss of an applied step ends it as ``crash`` (one a guard discarded does not); a guard
        that keeps rolling back (more than 4 train steps per step to go) or discards more than half
        of the steps it trains (vetoes) ends it as ``stalled``. SIGINT or
        SIGTERM stops training after the current step: the checkpoint and a summary with outcome
        ``interrupted`` are saved, then :class:`Interrupted` is raised."""
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0")
        if steps < self.trainer.step:
            raise ValueError(f"steps={steps} is below the {self.trainer.step} steps this run already has")
        if self.reached(steps):
            return self.summary
        before = None if self._written is None else (self.out / "config.json").read_bytes()
        try:
            return self._train(steps, callbacks, on_step, stop_on_nonfinite, certify)
        except Interrupted:
            raise
        except BaseException as exc:
            self._undo(before, storage_cause(exc) is not None)
            raise

    def _undo(self, config_before: bytes | None, storage: bool) -> None:
        """After a failed session: a resumed run gets its config.json back (the failed resume is
        not recorded); a new run the storage refused before its first checkpoint is removed
        (there is nothing to continue, and a half-made run directory would block ``--out``)."""
        with contextlib.suppress(OSError):
            if config_before is not None:
                path = self.out / "config.json"
                if path.read_bytes() != config_before:
                    try:
                        write_bytes_atomic(path, config_before)
                    except OSError:  # a full disk: in place, into the room the longer new file frees
                        path.write_bytes(config_before)
            elif storage and self._fresh and not has_checkpoint(self.out):
                for child in self.out.iterdir() if self.out.is_dir() else ():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
                if not self._existed:
                    self.out.rmdir()

    def _train(self, steps, callbacks, on_step, stop_on_nonfinite, certify) -> dict[str, Any]:
        certify = certify or (lambda: None)
        every = self.checkpoints.every
        with stop_requests() as stop:
            if self._written is not None:
                remove_stale_temps(self.out)
            if self.resumed_from is not None:
                remove_incomplete_checkpoints(self.out)
            metrics, rows = self._open_logs()  # a corrupt log is refused before config.json changes
            last = rows[-1] if rows else {}
            self._write_config(steps)
            for cb in callbacks:
                self.trainer.add_callback(cb)
            t0 = time.perf_counter()
            outcome = "completed"
            eval_every = self.trainer.config.eval_every
            budget = 4 * (steps - self.trainer.step) + 4  # a guard's rollbacks re-run steps, but not forever
            ran = discarded = 0
            losses: dict[int, Any] = {}
            for row in rows:  # the steps logged before: the state's trajectory so far
                _follow(losses, row)
            try:
                while self.trainer.step < steps and not stop:
                    if budget == 0:
                        outcome = "stalled"
                        break
                    budget -= 1
                    last = self.trainer.train_step()
                    ran += 1
                    discarded += bool(last.get("skipped"))
                    _follow(losses, last)
                    if eval_every and self.trainer.step % eval_every == 0:
                        last.update({f"eval_{k}": v for k, v in self.trainer.evaluate().items() if k != "step"})
                    with writing("the metrics log", metrics.path):
                        metrics.write(last)
                    if every and self.trainer.step % every == 0 and self.trainer.step < steps and not stop:
                        self._save_periodic(certify())
                    if on_step is not None:
                        on_step(last)
                    if last.get("stop"):  # a callback (a guard: stalled, a persistent fault) ends the run, saying why
                        outcome = "stalled"
                        break
                    if not math.isfinite(last["loss"]) and not last.get("skipped"):  # a discarded step is no crash
                        outcome = "crash"
                        if stop_on_nonfinite:
                            break
            finally:
                metrics.close()
            if outcome == "completed" and 2 * discarded > ran:  # vetoed more often than not: no training
                outcome = "stalled"
            interrupted = bool(stop) and self.trainer.step < steps
            self._finish(
                "interrupted" if interrupted and outcome == "completed" else outcome,
                last,
                time.perf_counter() - t0,
                discarded,
                certify(),
                losses,
            )
        if interrupted:
            raise Interrupted(stop[0], self.summary)
        return self.summary

    def _write_config(self, steps: int) -> None:
        """config.json with the target ``steps``; a resumed run appends what changed to ``resumes``."""
        if self._written is not None:
            self.config["checkpoints"] = self.checkpoints.to_dict()
            changed = {
                k: new
                for k, (_, new) in _differences(self._written, as_written(self.config)).items()
                if k not in ("steps", "resumes")
            }
            self.config["resumes"] = [
                *self.config.get("resumes", []),
                {"from_step": self.trainer.step, "steps": steps, **({"changed": changed} if changed else {})},
            ]
        self.config["steps"] = steps
        self.config["checkpoints"] = self.checkpoints.to_dict()
        with writing("the run configuration", self.out / "config.json"):
            write_json(self.out / "config.json", self.config)
        self._written = as_written(self.config)

    def _save_periodic(self, verified: bool | None) -> None:
        """``checkpoints/step-N/`` for the state after step N; older ones beyond the policy's
        ``keep`` are removed once the new one is complete."""
        save_checkpoint(
            self.trainer.snapshot(),
            periodic_dir(self.out, self.trainer.step),
            run=_identity(self.config),
            verified=verified,
        )
        prune_checkpoints(self.out, self.checkpoints.keep)

    def _open_logs(self) -> tuple[JsonlWriter, list[dict[str, Any]]]:
        """The metrics writer and the rows logged so far; a resumed run drops what it logged
        after its checkpoint (the steps are trained again)."""
        with writing("the run directory", self.out):
            self.out.mkdir(parents=True, exist_ok=True)
        for name in LOG_FILES:  # part of the contract, even when empty
            log = JsonlWriter(self.out / name)
            with writing(f"the log {name}", log.path):
                log.truncate_after("step", self.trainer.step)
                log.touch()
            log.close()
        return JsonlWriter(self.out / "metrics.jsonl"), read_jsonl(self.out / "metrics.jsonl")

    def _finish(
        self,
        outcome: str,
        last: dict[str, Any],
        wall: float,
        discarded: int = 0,
        verified: bool | None = None,
        losses: dict[int, Any] | None = None,
    ) -> None:
        """``discarded``: steps of this call whose update a guard vetoed or rolled back;
        ``losses``: the logged loss of each applied step the state it ends on went through
        (:func:`_follow`): the final train loss is the state's, not that of a step rolled back."""
        final_eval = self.trainer.evaluate()
        ends = self.trainer.step
        applied = [k for k in (losses or {}) if k < ends]
        final_loss = losses[max(applied)] if applied else last.get("loss") if ends else None
        save_checkpoint(
            self.trainer.snapshot(), self.out / CHECKPOINT_DIR, run=_identity(self.config), verified=verified
        )
        self.summary = {
            "outcome": outcome,
            "final_train_loss": final_loss,
            "final_val_loss": final_eval.get("val_loss"),
            **{f"final_{k}": v for k, v in final_eval.items() if k not in ("val_loss", "step")},
            "param_sha256": param_sha256(self.trainer.model),
            "steps": self.trainer.step,
            "discarded_steps": self.summary.get("discarded_steps", 0) + discarded,
            "wall_seconds": round(self.summary.get("wall_seconds", 0.0) + wall, 4),
            **({"stop_reason": last["stop"]} if outcome == "stalled" and last.get("stop") else {}),
            **({"stopped_at_step": last["step"]} if outcome == "stalled" and "step" in last else {}),
            **({} if verified is None else {"state_verified": verified}),
        }
        val_loss = self.summary["final_val_loss"]
        if val_loss is not None and not math.isfinite(val_loss):
            self.summary["outcome"] = "crash"
        with writing("the run summary", self.out / "summary.json"):
            write_json(self.out / "summary.json", self.summary)
