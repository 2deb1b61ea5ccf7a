"""A distributed run bound to a run directory, in the world its
:class:`~sdcscope.engine.topology.Topology` builds (call inside an initialized process group).

- **Run directory.** Rank 0 writes ``config.json`` (the topology under ``parallel``),
  ``metrics.jsonl`` (the world-mean ``loss`` over the ranks not excluded, and ``rank_loss``) and
  ``summary.json`` (every rank's ``param_sha256`` of the full parameters). Each rank logs its fired
  faults to ``injections.rank{r}.jsonl``; rank 0 merges them into ``injections.jsonl`` at the end.
  A rank that loses the world writes ``failure.rank{r}.json`` and raises :class:`DistributedError`.
- **Checkpoints.** In every world (DDP and sharded) the ranks write their state through
  ``torch.distributed.checkpoint`` (:mod:`~sdcscope.engine.shardckpt`: a DDP world's replicated
  tensors are written once, each rank's RNG and position beside them): periodic
  ``checkpoints/step-N/`` (the policy recorded in config.json's ``checkpoints``) and
  ``checkpoint/`` at the end of a session; ``resume=True`` continues from the newest verified one
  on the same layout, bitwise as if uninterrupted.
- **Every rank ends after the same step.** Each step's one gather carries every rank's loss,
  whether it discarded its update, a signal it received and whether its guard stopped the run
  (``stop`` in the step's metrics: :attr:`Guard.stop_reason <sdcscope.guard.Guard.stop_reason>`).
  A guard's stop ends the run with outcome ``stopped`` and its reason, as a stop, not a signal;
  SIGINT or SIGTERM with ``interrupted`` and :class:`~sdcscope.engine.run.Interrupted`. A
  non-finite loss of an applied step makes the outcome ``crash``; one a guard discarded does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdcscope import __version__
from sdcscope.common.world import unsupported
from sdcscope.engine.dist import DistConfig, DistributedError, gather_rows
from sdcscope.engine.distributed import DistTrainer
from sdcscope.engine.run import Interrupted, _differences, _identity, stop_requests
from sdcscope.engine.rundir import (
    CHECKPOINT_DIR,
    LOG_FILES,
    CheckpointPolicy,
    JsonlWriter,
    as_written,
    check_new_run_dir,
    merge_injection_logs,
    periodic_dir,
    prune_checkpoints,
    rank_injections_file,
    read_json,
    remove_incomplete_checkpoints,
    write_json,
)
from sdcscope.engine.shardckpt import choose_sharded, layout_of, load_sharded, remove_sharded_temps, save_sharded
from sdcscope.engine.state import CheckpointError, param_sha256
from sdcscope.engine.topology import Topology
from sdcscope.engine.trainer import TrainConfig
from sdcscope.faults import FaultSpec
from sdcscope.workloads import WorkloadConfig, make_workload


class DistRun:
    """A distributed run bound to ``out``. ``checkpoints``: the periodic checkpoint policy;
    ``resume``: continue the run in ``out`` (its config.json describes the same run) from its
    newest complete, certified checkpoint."""

    def __init__(
        self,
        out: str | Path,
        workload: WorkloadConfig,
        train: TrainConfig,
        *,
        topology: Topology | None = None,
        specs: Sequence[FaultSpec] = (),
        dist_config: DistConfig | None = None,
        extra_config: dict[str, Any] | None = None,
        checkpoints: CheckpointPolicy | None = None,
        resume: bool = False,
    ) -> None:
        self.topology = topology or Topology()
        kind = self.topology.world_kind
        if train.eval_every and (why := unsupported("train.eval_every", kind)):
            raise ValueError(f"--eval-every with --parallel {self.topology.kind}: {why}; drop --eval-every")
        self.out = Path(out)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        if resume:
            if not (self.out / "config.json").is_file():
                raise ValueError(f"--resume {str(self.out)!r} is not a run directory (no config.json)")
        else:
            check_new_run_dir(self.out)  # every rank, before any rank writes (barrier below)
        self.workload = make_workload(workload)
        self._injections = JsonlWriter(rank_injections_file(self.out, self.rank))
        self.trainer = DistTrainer(
            self.workload,
            train,
            topology=self.topology,
            dist_config=dist_config,
            specs=specs,
            injection_log=self._injections.write,
        )
        self.config = {
            "sdcscope_version": __version__,
            "workload": workload.to_dict(),
            "train": train.to_dict(),
            "data": self.workload.describe(),
            "world_size": self.size,
            "backend": self.trainer.dist_config.backend,
            "faults": [s.to_dict() for s in specs],
            "parallel": self.topology.to_dict(),
            **(extra_config or {}),
        }
        self.checkpoints = checkpoints or CheckpointPolicy()
        self.config["checkpoints"] = self.checkpoints.to_dict()
        self.certify: Callable[[], bool | None] | None = None
        """Whether this rank's state is verified (a guard's ``state_verified``), for each
        checkpoint's certification; None: no guard watched."""
        self.summary: dict[str, Any] = {}
        self.stop_reason: str | None = None
        """Why a guard stopped the run, as every rank learnt it (None: it did not)."""
        self.resumed_from: Path | None = None
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        self._stop_signal = 0
        """The signal some rank was stopped by, as every rank learnt it in the last step (0: none)."""
        self._crashed = False
        self._target = 0
        self._session = False
        dist.barrier()
        if resume:
            self._resume()

    @property
    def layout(self) -> dict[str, Any]:
        return layout_of(self.topology.kind, self.topology.inner, self.size)

    def _resume(self) -> None:
        """Load the checkpoint rank 0 chose (every rank the same one); drop what the logs hold
        after it (those steps are trained again); take config.json's configuration."""
        recorded = read_json(self.out / "config.json")
        choice: list[Any] = [None, None, None]
        if self.rank == 0:
            try:
                remove_sharded_temps(self.out)
                remove_incomplete_checkpoints(self.out)
                data = _differences(recorded.get("data"), as_written(self.workload.describe()))
                if "data" in recorded and data:
                    raise CheckpointError(
                        f"{str(self.out / 'config.json')!r} does not match the workload it describes: "
                        f"{', '.join(f'data.{k}' for k in data)} differ (a resumed run needs the same model and data)"
                    )
                path, manifest, skipped = choose_sharded(self.out, self.layout, _identity(recorded))
                choice = [str(path), manifest, [(str(p), why) for p, why in skipped]]
            except (CheckpointError, OSError) as exc:
                choice = [None, str(exc), None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            raise CheckpointError(choice[1])
        path, manifest = Path(choice[0]), choice[1]
        injector = self.trainer.injector
        if injector is not None:  # loading steps the optimizer once (lr 0) to build its state: no fault there
            injector.detach()
        load_sharded(self.trainer, path, manifest)
        if injector is not None:  # the permanent memory faults restored in place are not applied again
            injector.resumed_at = self.trainer.step
            injector.attach()
        self.resumed_from, self.skipped_checkpoints = path, [(Path(p), why) for p, why in choice[2]]
        step = self.trainer.step
        own = [f"injections.rank{self.rank}.jsonl", f"events.rank{self.rank}.jsonl"]
        for name in [*own, *(LOG_FILES if self.rank == 0 else ())]:
            JsonlWriter(self.out / name).truncate_after("step", step)
        if self.rank == 0:  # a summary of an earlier session: this one writes its own
            (self.out / "summary.json").unlink(missing_ok=True)
        self.config = {k: v for k, v in recorded.items() if k != "steps"}
        self.config["checkpoints"] = self.checkpoints.to_dict()  # the policy from here on
        dist.barrier()

    def train(
        self,
        steps: int,
        *,
        callbacks: Iterable[object] = (),
        on_step: Callable[[dict[str, Any]], None] | None = None,
        stop: list[int] | None = None,
    ) -> dict[str, Any]:
        """Train to ``steps`` steps in total; every rank ends after the same step (see the module
        docstring). SIGINT or SIGTERM on any rank (or a signal number in ``stop``, the caller's own
        list of received signals) ends it as ``interrupted``: rank 0 writes the summary (a sharded
        world also its checkpoint), then :class:`Interrupted` is raised on every rank. Returns the
        summary on rank 0 (``{}`` elsewhere)."""
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0")
        if steps < self.trainer.step:
            raise ValueError(f"steps={steps} is below the {self.trainer.step} steps this run already has")
        if stop is None:
            with stop_requests() as received:
                return self.train(steps, callbacks=callbacks, on_step=on_step, stop=received)
        self._target = steps
        if self.resumed_from is not None and not self._session:
            self._session = True
            self.config["resumes"] = [*self.config.get("resumes", []), {"from_step": self.trainer.step, "steps": steps}]
        lead = self.rank == 0
        if lead:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(self.out / "config.json", {**self.config, "steps": steps})
        for cb in callbacks:
            self.trainer.add_callback(cb)
        metrics = JsonlWriter(self.out / "metrics.jsonl")
        if lead:
            metrics.touch()
        t0, last, interrupted = time.perf_counter(), {}, False
        try:
            while self.trainer.step < steps and not self._stop_signal and self.stop_reason is None:
                last = self._step(metrics if lead else None, stop)
                if on_step is not None:
                    on_step(last)
            interrupted = bool(self._stop_signal) and self.trainer.step < steps and self.stop_reason is None
            self._finish(last, time.perf_counter() - t0, interrupted=interrupted)
        except RuntimeError as exc:
            if not is_comm_error(exc):
                raise
            raise failure(self.out, self.rank, self.trainer.step, exc) from exc
        finally:
            metrics.close()
            self._injections.close()
            self.trainer.close()
        if interrupted:
            raise Interrupted(self._stop_signal, self.summary or {"outcome": "interrupted", "steps": self.trainer.step})
        return self.summary

    def _step(self, metrics: JsonlWriter | None, stop: Sequence[int] = ()) -> dict[str, Any]:
        m = self.trainer.train_step()
        # what every rank must agree on rides along with the losses: one gather per step
        row = [m["loss"], float(m["skipped"]), float(stop[0] if stop else 0), float(bool(m.get("stop")))]
        rows = gather_rows(torch.tensor(row, dtype=torch.float64, device=self.trainer.world.comm_device())).cpu()
        self._stop_signal = int(rows[:, 2].max().item())
        if len(set(rows[:, 1].tolist())) != 1:
            raise DistributedError(f"ranks disagree on vetoing step {m['step']}: {rows[:, 1].tolist()}")
        if rows[:, 3].any():  # a guard stopped the run: every rank ends after this step, with its reason
            reasons: list[Any] = [None] * self.size
            dist.all_gather_object(reasons, m.get("stop"))
            self.stop_reason = m["stop"] = next(r for r in reasons if r)
        rank_loss = rows[:, 0].tolist()
        owners = self.trainer.world.loss_ranks  # a pipeline's loss is its last stage's
        live = [v for r, v in enumerate(rank_loss) if r in owners and r not in self.trainer.excluded]
        m.update(loss=math.fsum(live) / len(live), rank_loss=rank_loss)
        self._crashed |= not math.isfinite(m["loss"]) and not m["skipped"]  # a discarded step is no crash
        every = self.trainer.config.eval_every
        if metrics is not None:
            if every and self.trainer.step % every == 0:
                m.update({f"eval_{k}": v for k, v in self.trainer.evaluate().items() if k != "step"})
            metrics.write(m)
        step, every = self.trainer.step, self.checkpoints.every
        if every and step % every == 0 and step < self._target and not self._stop_signal and not self.stop_reason:
            self.save_checkpoint(periodic_dir(self.out, step))
            if self.rank == 0:
                prune_checkpoints(self.out, self.checkpoints.keep)
        return m

    def save_checkpoint(self, directory: str | Path) -> None:
        """The state now, to ``directory``, through torch.distributed.checkpoint on every rank (a
        collective): a sharded world's shards, a data-parallel world's replicated state (written
        once) and every rank's own RNG and position."""
        verified = None if self.certify is None else self.certify()
        save_sharded(self.trainer, directory, layout=self.layout, run=_identity(self.config), verified=verified)

    def _outcome(self, interrupted: bool) -> str:
        if self.stop_reason is not None:
            return "stopped"
        return "interrupted" if interrupted else "crash" if self._crashed else "completed"

    def _finish(self, last: dict[str, Any], wall: float, *, interrupted: bool) -> None:
        sharded = self.trainer.world.split
        self.save_checkpoint(self.out / CHECKPOINT_DIR)  # a session resumes from it, also when interrupted
        hashes: list[str | None] = [None] * self.size
        dist.all_gather_object(hashes, param_sha256(self.trainer.model))  # a collective when sharded
        final = self.trainer.evaluate() if sharded or self.rank == 0 else {}
        if self.rank == 0:
            self.summary = {
                "outcome": self._outcome(interrupted),
                **({"stop_reason": self.stop_reason} if self.stop_reason else {}),
                "final_train_loss": last.get("loss"),
                "final_val_loss": final.get("val_loss"),
                **{f"final_{k}": v for k, v in final.items() if k not in ("val_loss", "step")},
                "param_sha256": hashes[0],
                "replica_sha256": hashes,
                "replicas_identical": _replicas_identical(self.trainer.world, hashes),
                "steps": self.trainer.step,
                "world_size": self.size,
                "parallel": self.topology.kind,
                "wall_seconds": round(wall, 4),
            }
        dist.barrier()  # every rank's injection log is complete
        if self.rank == 0:
            merge_injection_logs(self.out, self.size)
            write_json(self.out / "summary.json", self.summary)


def _replicas_identical(world: Any, hashes: list[str | None]) -> bool:
    """Every rank holding the same model part ends with the same bits: all ranks, or in a pipeline
    the ranks of each stage (the stages hold different layers)."""
    if not world.pipeline:
        return len(set(hashes)) == 1
    info = world.stage
    return all(len({hashes[info.rank_of(s, d)] for d in range(info.dp)}) == 1 for s in range(info.stages))


def _doing(exc: BaseException) -> str:
    """What the rank was doing when ``exc`` was raised: its innermost sdcscope frame."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sdcscope" in f.filename]
    if not frames:
        return "in a collective"
    f = frames[-1]
    return f"in {f.name} ({Path(f.filename).name}:{f.lineno}), waiting for its peers"


def failure(out: Path, rank: int, step: int, exc: BaseException) -> DistributedError:
    """The error of a rank that lost the world at ``step``, recorded in ``failure.rank{r}.json``."""
    message = (
        f"rank {rank} lost the world at step {step}: a peer rank died, hung or could not "
        f"be reached ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    )
    record = {"rank": rank, "step": step, "error": message, "doing": f"step {step}, {_doing(exc)}"}
    write_json(out / f"failure.rank{rank}.json", record)
    return DistributedError(message)


_COMM_WORDS = ("gloo", "nccl", "connection", "pair closure", "timed out", "timeout", "socket", "peer", "collective")


def is_comm_error(exc: RuntimeError) -> bool:
    """A collective failed: NCCL raises DistError; gloo a plain RuntimeError from its transport
    ("Connection closed by peer", "Application timeout caused pair closure", ...)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(w in text for w in _COMM_WORDS)


__all__ = ["DistRun", "failure", "is_comm_error"]
