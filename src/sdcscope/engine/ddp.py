"""Data-parallel training under ``torch.distributed`` (gloo on CPU, nccl on GPU): the DDP trainer
and a run bound to a run directory.

- **Shards.** Rank r trains its own shard of every step (:func:`~sdcscope.engine.dist.shard`);
  one rank reproduces the single-process :class:`Trainer`.
- **Faults.** Each rank arms the fault specs bound to it: site ``comm`` through the bucket hook
  (:mod:`sdcscope.engine.buckets`), every other site through an :class:`Injector`.
- **Run directory.** Rank 0 writes ``config.json``, ``metrics.jsonl`` (world-mean ``loss`` and
  ``rank_loss``), ``summary.json`` (with every replica's ``param_sha256``) and the checkpoint.
  Each rank logs its fired faults to ``injections.rank{r}.jsonl``; rank 0 merges them into
  ``injections.jsonl`` at the end. A rank that loses the world writes ``failure.rank{r}.json``
  and raises :class:`DistributedError`; nothing written is removed.
- **Signals.** SIGINT or SIGTERM on any rank stops every rank after the same step (the request
  rides along with the per-step all-reduce of the losses): rank 0 writes a summary with outcome
  ``interrupted`` (no checkpoint: a distributed run is not resumed) and :class:`Interrupted` is
  raised. The torchrun job and its launcher live in :mod:`sdcscope.jobs.torchrun`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope import __version__
from sdcscope.engine.buckets import bucket_hook
from sdcscope.engine.dist import DistConfig, DistributedError, device_for, gather_rows, shard
from sdcscope.engine.run import Interrupted, stop_requests
from sdcscope.engine.rundir import (
    CHECKPOINT_DIR,
    JsonlWriter,
    check_new_run_dir,
    merge_injection_logs,
    rank_injections_file,
    write_json,
)
from sdcscope.engine.state import param_sha256, save_checkpoint
from sdcscope.engine.trainer import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, reexecution
from sdcscope.inject.comm import CommInjector
from sdcscope.workloads import Workload, WorkloadConfig, make_workload

NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else {"broadcast_buffers": False}
)
"""The workloads' buffers (masks, constants) are alike on every rank: no broadcast before each forward."""


class DDPTrainer(Trainer):
    """:class:`Trainer` over a DDP-wrapped model; call inside an initialized process group.

    ``self.model`` stays the plain module (names, snapshots and hashes as in one process);
    ``self.ddp`` wraps it. ``specs`` are this world's fault specs: each rank arms those bound to
    it (site ``comm`` through the bucket hook, every other site through an :class:`Injector`).
    """

    def __init__(
        self,
        workload: Workload,
        config: TrainConfig | None = None,
        callbacks: Iterable[object] = (),
        *,
        dist_config: DistConfig | None = None,
        specs: Sequence[FaultSpec] = (),
        injection_log: Callable[[dict], None] | None = None,
    ) -> None:
        super().__init__(workload, config, callbacks)
        self.dist_config = dist_config or DistConfig()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device_for(self.dist_config)
        self.model.to(self.device)
        self.ddp = DDP(self.model, bucket_cap_mb=self.dist_config.bucket_cap_mb, **NO_BUFFER_SYNC)
        self.hook = bucket_hook(self.ddp)
        self.injector: Injector | None = None
        self.comm_injector: CommInjector | None = None
        self._attach_faults(list(specs), injection_log)

    def _attach_faults(self, specs: list[FaultSpec], log: Callable[[dict], None] | None) -> None:
        comm = [(i, s) for i, s in enumerate(specs) if s.site == "comm"]
        other = [(i, s) for i, s in enumerate(specs) if s.site != "comm"]
        if comm:
            self.comm_injector = CommInjector(
                self.model,
                [s for _, s in comm],
                rank=self.rank,
                world_size=self.world,
                log=log,
                spec_ids=[i for i, _ in comm],
            )
            self.hook.add(self.comm_injector, first=True)
            self.callbacks.insert(0, self.comm_injector.callback())
        if other:
            ids = [i for i, _ in other]
            sink = None if log is None else (lambda rec: log({**rec, "spec": ids[rec["spec"]]}))
            self.injector = Injector(
                self.model, [s for _, s in other], self.optimizer, rank=self.rank, world_size=self.world, log=sink
            ).attach()
            self.callbacks.insert(0, self.injector.callback())

    def batch_for(self, data_pos: int, micro_batch: int, rank: int | None = None):
        """Micro-batch ``micro_batch`` of rank ``rank``'s shard (default: this rank's), on this
        rank's device."""
        rank = self.rank if rank is None else rank
        batch = self.workload.batch(self.config.seed, data_pos, shard(rank, self.config.grad_accum, micro_batch))
        return tuple(t.to(self.device) for t in batch)

    @contextlib.contextmanager
    def micro_step(self, micro_batch: int, accum: int) -> Iterator[nn.Module]:
        """Run the DDP wrapper; gradients are all-reduced on the last micro-batch only."""
        with self.ddp.no_sync() if micro_batch + 1 < accum else contextlib.nullcontext():
            yield self.ddp

    def local_gradients(self, rank: int, step: int, data_pos: int) -> torch.Tensor:
        """Recompute rank ``rank``'s local (pre-reduction) gradient of ``step`` into ``.grad`` and
        return its mean loss.

        Runs on the plain module (no all-reduce, no callbacks), so any rank can replay any rank's
        shard. It is a re-execution (:func:`sdcscope.inject.reexecution`): only permanent faults
        act again, as a unit that stays broken would.
        """
        accum = self.config.grad_accum
        for p in self.model.parameters():
            p.grad = None
        total = torch.zeros((), device=self.device)
        with reexecution():
            for m in range(accum):
                if self.injector is not None:
                    self.injector.set_position(step, m)
                loss = self.workload.loss(self.model, self.batch_for(data_pos, m, rank))
                (loss / accum).backward()
                total = total + loss.detach()
        return total / accum

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """As :meth:`Trainer.evaluate` (not a collective: rank 0 alone calls it in a run). The
        workloads keep their evaluation data on the CPU, so a GPU model is evaluated as a copy."""
        if self.device.type == "cpu":
            return super().evaluate()
        model, self.model = self.model, copy.deepcopy(self.model).cpu()
        try:
            return super().evaluate()
        finally:
            self.model = model

    def close(self) -> None:
        for inj in (self.injector, self.comm_injector):
            if inj is not None:
                inj.close()


# ---------------------------------------------------------------------------- the run


def _doing(exc: BaseException) -> str:
    """What the rank was doing when ``exc`` was raised: its innermost sdcscope frame."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sdcscope" in f.filename]
    if not frames:
        return "in a collective"
    f = frames[-1]
    return f"in {f.name} ({Path(f.filename).name}:{f.lineno}), waiting for its peers"


def _failure(out: Path, rank: int, step: int, exc: BaseException) -> DistributedError:
    message = (
        f"rank {rank} lost the world at step {step}: a peer rank died, hung or could not "
        f"be reached ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    )
    record = {"rank": rank, "step": step, "error": message, "doing": f"step {step}, {_doing(exc)}"}
    write_json(out / f"failure.rank{rank}.json", record)
    return DistributedError(message)


class DDPRun:
    """A distributed run bound to a run directory (call inside an initialized process group)."""

    def __init__(
        self,
        out: str | Path,
        workload: WorkloadConfig,
        train: TrainConfig,
        *,
        specs: Sequence[FaultSpec] = (),
        dist_config: DistConfig | None = None,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        self.out = Path(out)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._check_out()  # every rank, before any rank writes (barrier below)
        self.workload = make_workload(workload)
        self._injections = JsonlWriter(rank_injections_file(self.out, self.rank))
        self.trainer = self.make_trainer(train, dist_config, specs, self._injections.write)
        self.config = {
            "sdcscope_version": __version__,
            "workload": workload.to_dict(),
            "train": train.to_dict(),
            "data": self.workload.describe(),
            "world_size": self.world,
            "backend": self.trainer.dist_config.backend,
            "faults": [s.to_dict() for s in specs],
            **(extra_config or {}),
        }
        self.summary: dict[str, Any] = {}
        self._stop_signal = 0
        """The signal some rank was stopped by, as every rank learnt it in the last step (0: none)."""
        dist.barrier()

    def _check_out(self) -> None:
        """Refuse an ``out`` that holds another run (a resumed sharded run checks its own)."""
        check_new_run_dir(self.out)

    def make_trainer(
        self, train: TrainConfig, dist_config: DistConfig | None, specs: Sequence[FaultSpec], log: Callable
    ) -> DDPTrainer:
        """This run's trainer (a sharded run builds its own: :mod:`sdcscope.engine.parallel`)."""
        return DDPTrainer(self.workload, train, dist_config=dist_config, specs=specs, injection_log=log)

    def train(
        self,
        steps: int,
        *,
        callbacks: Iterable[object] = (),
        on_step: Callable[[dict[str, Any]], None] | None = None,
        stop: list[int] | None = None,
    ) -> dict[str, Any]:
        """Train to ``steps`` steps. SIGINT or SIGTERM on any rank (or a signal number in ``stop``,
        the caller's own list of received signals) stops every rank after the same step: rank 0
        writes a summary with outcome ``interrupted`` (no checkpoint), then :class:`Interrupted` is
        raised on every rank."""
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0")
        if stop is None:
            with stop_requests() as received:
                return self.train(steps, callbacks=callbacks, on_step=on_step, stop=received)
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
            while self.trainer.step < steps and not self._stop_signal:
                last = self._step(metrics if lead else None, stop)
                if on_step is not None:
                    on_step(last)
                if last.get("stop"):  # a guard stopped training: a world decision, every rank ends here
                    break
            interrupted = bool(self._stop_signal) and self.trainer.step < steps
            self._finish(last, time.perf_counter() - t0, interrupted=interrupted)
        except RuntimeError as exc:
            if not _is_comm_error(exc):
                raise
            raise _failure(self.out, self.rank, self.trainer.step, exc) from exc
        finally:
            metrics.close()
            self._injections.close()
            self.trainer.close()
        if interrupted:
            raise Interrupted(self._stop_signal, self.summary or {"outcome": "interrupted", "steps": self.trainer.step})
        return self.summary

    def _step(self, metrics: JsonlWriter | None, stop: Sequence[int] = ()) -> dict[str, Any]:
        m = self.trainer.train_step()
        # A stop request rides along with the losses: every rank learns it in the same step.
        rows = gather_rows(
            torch.tensor([m["loss"], float(m["skipped"]), float(stop[0] if stop else 0)], dtype=torch.float64)
        )
        self._stop_signal = int(rows[:, 2].max().item())
        if len(set(rows[:, 1].tolist())) != 1:
            raise DistributedError(f"ranks disagree on vetoing step {m['step']}: {rows[:, 1].tolist()}")
        rank_loss = rows[:, 0].tolist()
        live = [v for r, v in enumerate(rank_loss) if r not in self.trainer.hook.excluded]
        m.update(loss=math.fsum(live) / len(live), rank_loss=rank_loss)
        every = self.trainer.config.eval_every
        if metrics is not None:
            if every and self.trainer.step % every == 0:
                m.update({f"eval_{k}": v for k, v in self.trainer.evaluate().items() if k != "step"})
            metrics.write(m)
        return m

    def _finish(self, last: dict[str, Any], wall: float, *, interrupted: bool = False) -> None:
        hashes: list[str | None] = [None] * self.world
        dist.all_gather_object(hashes, param_sha256(self.trainer.model))
        if self.rank == 0:
            final = self.trainer.evaluate()
            if not interrupted:  # an interrupted distributed run is not resumed: no checkpoint
                save_checkpoint(self.trainer.snapshot(), self.out / CHECKPOINT_DIR)
            finite = math.isfinite(last.get("loss", 0.0))
            self.summary = {
                "outcome": "crash"
                if not finite
                else "interrupted"
                if interrupted
                else "stalled"
                if last.get("stop")
                else "completed",
                **({"stop_reason": last["stop"]} if last.get("stop") else {}),
                "final_train_loss": last.get("loss"),
                "final_val_loss": final.get("val_loss"),
                **{f"final_{k}": v for k, v in final.items() if k not in ("val_loss", "step")},
                "param_sha256": hashes[0],
                "replica_sha256": hashes,
                "replicas_identical": len(set(hashes)) == 1,
                "steps": self.trainer.step,
                "world_size": self.world,
                "wall_seconds": round(wall, 4),
            }
        dist.barrier()  # every rank's injection log is complete
        if self.rank == 0:
            merge_injection_logs(self.out, self.world)
            write_json(self.out / "summary.json", self.summary)


_COMM_WORDS = ("gloo", "nccl", "connection", "pair closure", "timed out", "timeout", "socket", "peer", "collective")


def _is_comm_error(exc: RuntimeError) -> bool:
    """A collective failed: NCCL raises DistError; gloo a plain RuntimeError from its transport
    ("Connection closed by peer", "Application timeout caused pair closure", ...)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(w in text for w in _COMM_WORDS)
