"""Data-parallel training under ``torch.distributed`` (gloo on CPU, nccl on GPU).

A world is formed from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); :func:`launch` starts one (``sdcscope train --nproc N``), and
``torchrun --nproc-per-node N -m sdcscope.engine.ddp --out DIR ...`` is the same thing by hand.
``--guard`` watches every rank with the Guard (:mod:`sdcscope.guard.ranks`); without it the rank
guard alone (:mod:`sdcscope.mitigate.quarantine`) runs, unless ``--no-crossrank``.

- **Shards.** Rank r trains micro-batch ``m`` of a step on ``workload.batch(seed, data_pos,
  r * grad_accum + m)``: a pure function, so reruns are bitwise identical, a rank's batch can be
  recomputed anywhere, and one rank reproduces the single-process :class:`Trainer`.
- **One comm hook.** DDP takes a single communication hook; :class:`BucketHook` is it, and other
  rooms plug *stages* into it (``before_reduce(view)`` / ``after_reduce(view)`` with a
  :class:`BucketView`): fault injection (:mod:`sdcscope.inject.comm`), pre-reduction signatures
  (:mod:`sdcscope.detect.crossrank`), and rank exclusion (:meth:`BucketHook.exclude`, the
  re-weighted all-reduce of :mod:`sdcscope.mitigate.quarantine`). With nothing excluded it
  averages exactly like DDP's default hook (divide, then all-reduce SUM), bit for bit at 2 ranks
  (see :class:`BucketHook` on rows that ride along with the last bucket).
- **Run directory.** Rank 0 writes ``config.json``, ``metrics.jsonl`` (world-mean ``loss`` and
  ``rank_loss``), ``summary.json`` (with every replica's ``param_sha256``) and the checkpoint.
  Each rank logs its fired faults to ``injections.rank{r}.jsonl`` as they happen; rank 0 merges
  them into ``injections.jsonl`` at the end. A rank that loses the world writes
  ``failure.rank{r}.json`` and raises :class:`DistributedError`; nothing written is removed.
- **Signals.** SIGINT or SIGTERM on any rank stops every rank after the same step (the request
  rides along with the per-step all-reduce of the losses): rank 0 writes a summary with outcome
  ``interrupted`` (no checkpoint: a distributed run is not resumed) and :class:`Interrupted` is
  raised; the entry point then exits 0 quietly. :func:`launch` forwards SIGINT, SIGTERM and
  SIGHUP to the ranks, waits for them (bounded) and raises :class:`Interrupted`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope import __version__
from sdcscope.engine.run import Interrupted, _stop_requests
from sdcscope.engine.rundir import JsonlWriter, check_new_run_dir, read_json, read_jsonl, write_json
from sdcscope.engine.state import param_sha256, save_checkpoint
from sdcscope.engine.trainer import TrainConfig, Trainer
from sdcscope.faults import FaultSpec, load_specs
from sdcscope.inject import Injector, reexecution, validate_specs
from sdcscope.inject.comm import CommInjector, check_comm_specs
from sdcscope.inject.targets import evaluated, probe_model
from sdcscope.workloads import Workload, WorkloadConfig, make_workload

BACKENDS = ("gloo", "nccl")
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CHECKPOINT_DIR = "checkpoint"
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})
"""The workloads' buffers (masks, constants) are alike on every rank: no broadcast before each forward."""


class DistributedError(RuntimeError):
    """The world could not be formed, or a rank lost it (a peer died or hung)."""


@dataclass(kw_only=True)
class DistConfig:
    backend: str | None = None
    """``gloo`` or ``nccl``; ``None``: nccl when CUDA is available, else gloo."""
    timeout_s: float = 300.0
    """Rendezvous and collective timeout: a dead or hung rank surfaces as an error after this."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
        for name in ("timeout_s", "bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")


def init_distributed(config: DistConfig | None = None) -> tuple[int, int]:
    """Join the world described by torchrun's environment; return ``(rank, world_size)``."""
    config = config or DistConfig()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [v for v in ENV_VARS if v not in os.environ]
    if missing:
        raise DistributedError(
            f"not inside a torch.distributed launch (missing {', '.join(missing)}): start it with "
            "`sdcscope train --nproc N ...` or `torchrun --nproc-per-node N -m sdcscope.engine.ddp ...`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if config.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        dist.init_process_group(config.backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=config.timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedError(
            f"rank {rank} could not form a world of {world} ranks at {where} within "
            f"{config.timeout_s:g} s (backend {config.backend}): {str(exc).splitlines()[0]}") from exc
    return rank, world


def device_for(config: DistConfig) -> torch.device:
    if config.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(rank: int, grad_accum: int, micro_batch: int) -> int:
    """The workload micro-batch index rank ``rank`` trains as its micro-batch ``micro_batch``."""
    return rank * grad_accum + micro_batch


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D float64 ``row``, as ``[world, len(row)]`` on every rank.

    One all-reduce (SUM) of a zero matrix holding the row at this rank's index: adding zeros is
    exact (also for inf and nan), so every rank receives every row bit for bit.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = torch.zeros((world, row.numel()), dtype=torch.float64, device=row.device)
    rows[rank] = row.to(torch.float64)
    dist.all_reduce(rows, group=group)
    return rows


CHUNK_BITS = {torch.float64: 16, torch.float32: 16, torch.float16: 8, torch.bfloat16: 8}
"""Bits of a float64 that travel in one element of a bucket of this dtype: integers below 2^16
(2^8) are exact in float32 (float16, bfloat16), and so is their sum with zeros."""
_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def _host(t: torch.Tensor) -> np.ndarray | None:
    """``t`` as a numpy view when it lives on the CPU in a numpy dtype: the hook's bookkeeping on
    a few hundred numbers costs a few microseconds per numpy call, tens per torch operation."""
    return t.detach().numpy() if t.device.type == "cpu" and t.dtype in _NUMPY else None


def _encode(bits: Any, b: int, xp: Any) -> Any:
    """``[len(bits), 64 / b]`` chunks of int64 ``bits`` (numpy or torch, ``xp`` the module)."""
    if xp is np:
        return (bits[:, None] >> np.arange(0, 64, b, dtype=np.int64)) & ((1 << b) - 1)
    return (bits[:, None] >> torch.arange(0, 64, b, device=bits.device, dtype=torch.int64)) & ((1 << b) - 1)


def _decode(c: Any, b: int, xp: Any) -> Any:
    """int64 bits from ``[..., 64 / b]`` int64 chunks (modified in place)."""
    n = 64 // b
    top = c[..., -1]
    top -= (top >> (b - 1)) << b  # the highest chunk carries the sign of the int64: [-2^(b-1), 2^(b-1))
    weights = [1 << (b * i) for i in range(n)]
    weights = np.array(weights, dtype=np.int64) if xp is np else torch.tensor(weights, dtype=torch.int64, device=c.device)
    return (c * weights).sum(-1)  # every partial sum fits in an int64: exact


def encode_rows(row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bits of the float64 ``row`` as ``len(row) * 64 / b`` integers in ``[0, 2^b)``, stored in
    ``dtype`` (``b`` = :data:`CHUNK_BITS`): a row that survives any all-reduce SUM with zeros."""
    b = CHUNK_BITS[dtype]
    row = row.to(torch.float64).contiguous()
    if row.device.type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(_encode(row.numpy().view(np.int64), b, np).reshape(-1).astype(_NUMPY[dtype]))
    return _encode(row.view(torch.int64), b, torch).reshape(-1).to(dtype)


def decode_rows(chunks: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`encode_rows` for ``[world, width * 64 / b]`` chunks: ``[world, width]`` float64."""
    b = CHUNK_BITS[chunks.dtype]
    host = _host(chunks)
    if host is not None:
        c = host.astype(np.int64).reshape(chunks.shape[0], width, 64 // b)
        return torch.from_numpy(_decode(c, b, np).view(np.float64))
    c = chunks.to(torch.int64).view(chunks.shape[0], width, 64 // b)
    return _decode(c, b, torch).view(torch.float64)


# ---------------------------------------------------------------------------- the comm hook


@dataclass
class BucketView:
    """What a stage sees of one gradient bucket: ``buffer`` (flat), and per parameter its
    qualified ``names`` and ``grads`` (views into ``buffer``, shaped like the parameter).
    Buckets are seen in index order; after the reduction, ``buffer`` holds the reduced values."""

    index: int
    buffer: torch.Tensor
    names: list[str]
    grads: list[torch.Tensor]
    last: bool
    """The step's last bucket: every bucket before it has been seen."""
    host: np.ndarray | None = None
    """``buffer`` as a numpy view (CPU buckets of a numpy dtype): cheap bookkeeping for stages."""


class BucketHook:
    """DDP's communication hook, open to stages; averages over the ranks not excluded.

    Before the all-reduce, stages see this rank's local bucket in the order added (add fault
    stages first: the hardware corrupts a value before anyone observes it); after it, the
    reduced bucket. An excluded rank sends zeros (``zero_()``, so a nan cannot leak through a
    multiplication) and every rank divides by the number of contributors: the result is the
    average of the healthy ranks, identical bit for bit on every rank, and an excluded rank
    keeps computing and receives it, so its replica stays equal to the others.

    **Riders.** A stage with ``ride(view)`` may return, for the step's last bucket, a 1-D float64
    row of its own (e.g. gradient signatures); the hook gathers every rank's row in the same
    all-reduce as the bucket -- no extra collective -- and hands ``[world, len(row)]`` to the
    stage's ``landed(rows)`` before ``after_reduce``. The rows travel bit-exactly as small
    integers appended to the bucket (see :func:`encode_rows`); the bucket part is reduced as
    before (at 2 ranks bit for bit like DDP's own hook; at more ranks the summation order of a
    longer message may differ, still identical on every rank and from run to run). A bucket of
    another dtype sends the rows in a second all-reduce instead.
    """

    def __init__(self, ddp: DDP, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self._views: dict[tuple, BucketView] = {}
        self.stages: list[Any] = []
        self.riders: list[Any] = []
        self.excluded: frozenset[int] = frozenset()
        self._combined: dict[tuple, torch.Tensor] = {}

    def add(self, stage: Any, *, first: bool = False) -> None:
        self.stages.insert(0, stage) if first else self.stages.append(stage)
        self.riders = [s for s in self.stages if callable(getattr(s, "ride", None))]

    def exclude(self, ranks: Iterable[int]) -> None:
        """From the next bucket on, leave ``ranks``' gradients out of the average."""
        ranks = frozenset(int(r) for r in ranks)
        bad = sorted(r for r in ranks if not 0 <= r < self.world)
        if bad:
            raise ValueError(f"cannot exclude ranks {bad}; allowed: 0..{self.world - 1}")
        if len(ranks) >= self.world:
            raise ValueError(f"cannot exclude every rank ({sorted(ranks)}): no gradient would be left")
        self.excluded = ranks

    def _view(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> BucketView:
        """The view of a bucket, built once per bucket buffer: DDP keeps a bucket's flat buffer
        across steps and allocates new ones when it rebuilds its buckets (after the first step);
        the cache holds the buffer, so its address cannot be reused while cached."""
        key = (bucket.index(), buffer.data_ptr(), buffer.numel())
        if key not in self._views:
            grads = bucket.gradients()
            storage = buffer.untyped_storage().data_ptr()
            assert all(g.untyped_storage().data_ptr() == storage for g in grads), \
                "DDP bucket gradients are not views of the bucket buffer"
            self._views[key] = BucketView(bucket.index(), buffer, [self.names[id(p)] for p in bucket.parameters()],
                                          grads, bucket.is_last(), _host(buffer))
        return self._views[key]

    def reduce(self, state, bucket):  # unannotated: DDP checks annotations against real types
        buffer = bucket.buffer()
        view = self._view(bucket, buffer) if self.stages else None
        for stage in self.stages:
            stage.before_reduce(view)
        if self.rank in self.excluded:
            buffer.zero_()
        buffer.div_(self.world - len(self.excluded))
        rows = [(s, r) for s in self.riders if (r := s.ride(view)) is not None] if view is not None and view.last else []
        if not rows:
            fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        elif buffer.dtype in CHUNK_BITS:
            fut = self._reduce_with(buffer, view, torch.cat([r.to(torch.float64) for _, r in rows]))
        else:
            mat = torch.zeros((self.world, sum(r.numel() for _, r in rows)), dtype=torch.float64, device=buffer.device)
            mat[self.rank] = torch.cat([r.to(torch.float64) for _, r in rows])
            fut = torch.futures.collect_all([
                dist.all_reduce(buffer, group=self.group, async_op=True).get_future(),
                dist.all_reduce(mat, group=self.group, async_op=True).get_future()])
            fut = fut.then(lambda f: (f.value()[0].value()[0], mat))

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            if rows:
                out, mat = value
                start = 0
                for stage, row in rows:
                    stage.landed(mat[:, start:start + row.numel()])
                    start += row.numel()
            else:
                out = value[0]
            for stage in self.stages:
                stage.after_reduce(view)
            return out
        return fut.then(reduced)

    def _reduce_with(self, buffer: torch.Tensor, view: BucketView, row: torch.Tensor) -> torch.futures.Future:
        """All-reduce ``buffer`` with every rank's float64 ``row`` appended (bit-exact chunks);
        the future's value is ``(buffer, [world, len(row)] rows)``."""
        n, b, width = buffer.numel(), CHUNK_BITS[buffer.dtype], row.numel()
        size = width * (64 // b)
        key = (view.index, buffer.data_ptr(), n, size)
        if key not in self._combined:
            self._combined = {k: v for k, v in self._combined.items() if k[0] != view.index}  # DDP rebuilt its buckets
            combined = torch.empty(n + self.world * size, dtype=buffer.dtype, device=buffer.device)
            self._combined[key] = (combined, _host(combined))
        combined, out = self._combined[key]
        own = slice(n + self.rank * size, n + (self.rank + 1) * size)
        row_host = _host(row) if view.host is not None and out is not None else None
        if row_host is not None:  # the CPU: numpy views, no torch operation but the all-reduce
            out[:n] = view.host
            out[n:] = 0
            out[own] = _encode(np.ascontiguousarray(row_host, dtype=np.float64).view(np.int64), b, np).reshape(-1)
        else:
            combined[:n].copy_(buffer)
            combined[n:].zero_()
            combined[own] = encode_rows(row, buffer.dtype)

        def unpack(f: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor]:
            if row_host is not None:
                view.host[:] = out[:n]
                chunks = out[n:].astype(np.int64).reshape(self.world, width, 64 // b)
                return buffer, torch.from_numpy(_decode(chunks, b, np).view(np.float64))
            buffer.copy_(combined[:n])
            return buffer, decode_rows(combined[n:].view(self.world, size), width)
        return dist.all_reduce(combined, group=self.group, async_op=True).get_future().then(unpack)


def bucket_hook(ddp: DDP) -> BucketHook:
    """The :class:`BucketHook` of ``ddp``, registered on first use (before the first backward)."""
    hook = getattr(ddp, "_sdcscope_bucket_hook", None)
    if hook is None:
        hook = BucketHook(ddp, ddp.process_group)
        ddp.register_comm_hook(None, hook.reduce)
        ddp._sdcscope_bucket_hook = hook
    return hook


# ---------------------------------------------------------------------------- the trainer


class DDPTrainer(Trainer):
    """:class:`Trainer` over a DDP-wrapped model; call inside an initialized process group.

    ``self.model`` stays the plain module (names, snapshots and hashes as in one process);
    ``self.ddp`` wraps it. ``specs`` are this world's fault specs: each rank arms those bound to
    it (site ``comm`` through the bucket hook, every other site through an :class:`Injector`).
    """

    def __init__(self, workload: Workload, config: TrainConfig | None = None, callbacks: Iterable[object] = (),
                 *, dist_config: DistConfig | None = None, specs: Sequence[FaultSpec] = (),
                 injection_log: Callable[[dict], None] | None = None) -> None:
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
            self.comm_injector = CommInjector(self.model, [s for _, s in comm], rank=self.rank,
                                              world_size=self.world, log=log, spec_ids=[i for i, _ in comm])
            self.hook.add(self.comm_injector, first=True)
            self.callbacks.insert(0, self.comm_injector.callback())
        if other:
            ids = [i for i, _ in other]
            sink = None if log is None else (lambda rec: log({**rec, "spec": ids[rec["spec"]]}))
            self.injector = Injector(self.model, [s for _, s in other], self.optimizer, rank=self.rank,
                                     world_size=self.world, log=sink).attach()
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


def _failure(out: Path, rank: int, step: int, exc: BaseException) -> DistributedError:
    message = (f"rank {rank} lost the world at step {step}: a peer rank died, hung or could not "
               f"be reached ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    write_json(out / f"failure.rank{rank}.json", {"rank": rank, "step": step, "error": message})
    return DistributedError(message)


class DDPRun:
    """A distributed run bound to a run directory (call inside an initialized process group)."""

    def __init__(self, out: str | Path, workload: WorkloadConfig, train: TrainConfig, *,
                 specs: Sequence[FaultSpec] = (), dist_config: DistConfig | None = None,
                 extra_config: dict[str, Any] | None = None) -> None:
        self.out = Path(out)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        check_new_run_dir(self.out)  # every rank, before any rank writes (barrier below)
        self.workload = make_workload(workload)
        self._injections = JsonlWriter(self.out / f"injections.rank{self.rank}.jsonl")
        self.trainer = DDPTrainer(self.workload, train, dist_config=dist_config, specs=specs,
                                  injection_log=self._injections.write)
        self.config = {
            "sdcscope_version": __version__, "workload": workload.to_dict(), "train": train.to_dict(),
            "data": self.workload.describe(), "world_size": self.world,
            "backend": self.trainer.dist_config.backend, "faults": [s.to_dict() for s in specs],
            **(extra_config or {}),
        }
        self.summary: dict[str, Any] = {}
        self._stop_signal = 0
        """The signal some rank was stopped by, as every rank learnt it in the last step (0: none)."""
        dist.barrier()

    def train(self, steps: int, *, callbacks: Iterable[object] = (),
              on_step: Callable[[dict[str, Any]], None] | None = None,
              stop: list[int] | None = None) -> dict[str, Any]:
        """Train to ``steps`` steps. SIGINT or SIGTERM on any rank (or a signal number in ``stop``,
        the caller's own list of received signals) stops every rank after the same step: rank 0
        writes a summary with outcome ``interrupted`` (no checkpoint), then :class:`Interrupted` is
        raised on every rank."""
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0")
        if stop is None:
            with _stop_requests() as received:
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
        rows = gather_rows(torch.tensor([m["loss"], float(m["skipped"]), float(stop[0] if stop else 0)],
                                        dtype=torch.float64))
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
                "outcome": "crash" if not finite else "interrupted" if interrupted else "completed",
                "final_train_loss": last.get("loss"), "final_val_loss": final.get("val_loss"),
                **{f"final_{k}": v for k, v in final.items() if k not in ("val_loss", "step")},
                "param_sha256": hashes[0], "replica_sha256": hashes,
                "replicas_identical": len(set(hashes)) == 1,
                "steps": self.trainer.step, "world_size": self.world, "wall_seconds": round(wall, 4),
            }
        dist.barrier()  # every rank's injection log is complete
        if self.rank == 0:
            self._merge_injections()
            write_json(self.out / "summary.json", self.summary)

    def _merge_injections(self) -> None:
        records = [r for k in range(self.world) for r in read_jsonl(self.out / f"injections.rank{k}.jsonl")]
        records.sort(key=lambda r: (r["step"], r["micro_batch"] or 0, r["rank"]))
        writer = JsonlWriter(self.out / "injections.jsonl")
        writer.touch()
        for r in records:
            writer.write(r)
        writer.close()


def _is_comm_error(exc: RuntimeError) -> bool:
    """A collective failed: NCCL raises DistError; gloo a plain RuntimeError from its transport."""
    return isinstance(exc, dist.DistError) or "gloo" in str(exc)


# ---------------------------------------------------------------------------- entry points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sdcscope.engine.ddp",
                                description="Data-parallel training of a reference workload (run under torchrun).")
    p.add_argument("--out", required=True, type=Path, help="New run directory.")
    p.add_argument("--workload", default="gpt")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None)
    p.add_argument("--max-corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--batch-size", type=int, default=None, help="Per rank and micro-batch.")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--faults", type=Path, default=None, help="YAML/JSON list of fault specs (with ranks).")
    p.add_argument("--backend", default=None, choices=BACKENDS)
    p.add_argument("--timeout", type=float, default=300.0, help="Rendezvous/collective timeout, seconds.")
    p.add_argument("--no-crossrank", action="store_true",
                   help="Train without cross-rank detection, localization and quarantine.")
    p.add_argument("--hash-every", type=int, default=None,
                   help="Replica hash check every N steps (0: off; default: the rank guard's, 10).")
    p.add_argument("--guard", action="store_true",
                   help="Watch every rank with the Guard (its detectors per rank, one shared verdict, the rank guard).")
    p.add_argument("--guard-config", type=Path, default=None, help="YAML guard settings (implies --guard).")
    p.add_argument("--ledger", type=Path, default=None,
                   help="Device ledger shared across jobs (default: OUT/ledger.json).")
    return p


@dataclass
class Job:
    """A validated distributed job (what every rank runs)."""

    out: Path
    steps: int
    workload: WorkloadConfig
    train: TrainConfig
    dist: DistConfig
    specs: list[FaultSpec]
    crossrank: bool
    hash_every: int | None
    ledger: Path | None
    guard: Any = None
    """A :class:`sdcscope.guard.GuardConfig` (``--guard``), or None."""


def parse_job(argv: Sequence[str], world_size: int) -> Job:
    """Parse and validate; raises ValueError/FileNotFoundError before anything is started."""
    try:
        a = build_parser().parse_args(list(argv))
    except SystemExit as exc:
        raise ValueError(f"bad arguments for sdcscope.engine.ddp: {' '.join(argv)}") from exc
    if a.steps < 0:
        raise ValueError(f"--steps {a.steps} must be >= 0")
    if a.hash_every is not None and a.hash_every < 0:
        raise ValueError(f"--hash-every {a.hash_every} must be >= 0")
    guard = None
    if a.guard or a.guard_config is not None:
        if a.no_crossrank:
            raise ValueError("--guard needs the cross-rank checks (every rank must take the same decision); "
                             "drop --no-crossrank")
        # The entry point is a composition root: it may reach right in the room order.
        from sdcscope.guard import GuardConfig
        from sdcscope.guard.ranks import check_config

        guard = GuardConfig.load(a.guard_config) if a.guard_config is not None else GuardConfig()
        check_config(guard)
        if a.hash_every is not None:
            guard.ranks.hash_every = a.hash_every
    if a.faults is not None and not a.faults.is_file():
        raise FileNotFoundError(f"--faults {str(a.faults)!r} does not exist")
    specs = load_specs(a.faults) if a.faults is not None else []
    for i, s in enumerate(specs):
        if s.rank is not None and s.rank >= world_size:
            raise ValueError(f"fault spec #{i}: rank {s.rank} does not exist; allowed: 0..{world_size - 1}")
    check_new_run_dir(a.out)
    return Job(out=a.out, steps=a.steps,
               workload=WorkloadConfig(workload=a.workload, preset=a.preset, batch_size=a.batch_size, lr=a.lr,
                                       corpus=a.corpus, max_corpus_bytes=a.max_corpus_bytes),
               train=TrainConfig(seed=a.seed, grad_accum=a.grad_accum, eval_every=a.eval_every),
               dist=DistConfig(backend=a.backend, timeout_s=a.timeout), specs=specs,
               crossrank=not a.no_crossrank, hash_every=a.hash_every, ledger=a.ledger, guard=guard)


def check_job(job: Job, world_size: int) -> None:
    """Validate the fault specs and the guard's target patterns (ABFT, metrics) against the model,
    as every rank will (without a world), so a mistake is refused before any rank starts."""
    workload = make_workload(job.workload)
    torch.manual_seed(job.train.seed)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    comm = [(i, s) for i, s in enumerate(job.specs) if s.site == "comm"]
    check_comm_specs(model, [s for _, s in comm], world_size=world_size, steps=job.steps,
                     grad_accum=job.train.grad_accum, spec_ids=[i for i, _ in comm])
    other = [s for s in job.specs if s.site != "comm"]
    batch = workload.batch(job.train.seed, 0, 0)
    validate_specs(model, other, optimizer, world_size=world_size, steps=job.steps, grad_accum=job.train.grad_accum,
                   probe=probe_model(model, lambda m: workload.loss(m, batch),
                                     evaluate=workload.evaluate if evaluated(other) else None))
    if job.guard is not None:  # built, never attached: no hooks; no metrics file (path dropped)
        from sdcscope.guard import Guard

        metrics = job.guard.metrics and replace(job.guard.metrics, path=None)
        Guard(model, optimizer, replace(job.guard, metrics=metrics)).close()


def run_job(job: Job, stop: list[int] | None = None) -> dict[str, Any]:
    """Run ``job`` on this rank (the process group must be initialized); ``stop``: see :meth:`DDPRun.train`."""
    extra = {"crossrank": job.crossrank, "hash_every": job.hash_every,
             "guard": None if job.guard is None else job.guard.to_dict()}
    run = DDPRun(job.out, job.workload, job.train, specs=job.specs, dist_config=job.dist, extra_config=extra)
    if not job.crossrank:
        return run.train(job.steps, stop=stop)
    # The entry point is a composition root: it may reach right in the room order.
    if job.guard is not None:
        from sdcscope.guard import Guard

        guard = Guard(run.trainer.model, run.trainer.optimizer, job.guard, ddp=run.trainer.ddp, run_dir=job.out,
                      ledger=job.ledger)
        callback = guard.callback()
    else:
        from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig

        config = RankGuardConfig() if job.hash_every is None else RankGuardConfig(hash_every=job.hash_every)
        guard = callback = RankGuard(run.trainer.ddp, run.trainer.optimizer, run_dir=job.out, ledger=job.ledger,
                                     config=config)
    try:
        return run.train(job.steps, callbacks=[callback], stop=stop)
    finally:
        guard.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdcscope.engine.ddp ...`` on every rank; exit code 0, 1 (world) or 2 (usage).

    SIGINT or SIGTERM stops every rank after the same step (summary outcome ``interrupted``); the
    ranks then exit 0 without a word (the launcher reports it); a second signal acts at once."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with _stop_requests() as stop:  # from here on, also while the world forms
        return _main(argv, stop)


def _main(argv: list[str], stop: list[int]) -> int:
    try:
        job = parse_job(argv, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        rank, _ = init_distributed(job.dist)
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second signal before the world formed
        return 128 + signal.SIGINT
    try:
        try:
            summary = run_job(job, stop)
        except Interrupted:  # every rank stopped after the same step; rank 0 saved the summary
            dist.barrier()
            return 0
        dist.barrier()  # leave together (see _spawned)
        if rank == 0:
            print(f"{summary['outcome']} after {summary['steps']} steps on {summary['world_size']} ranks: "
                  f"train loss {summary['final_train_loss']:.4f}, val loss {summary['final_val_loss']:.4f}, "
                  f"replicas identical: {summary['replicas_identical']}; run directory: {job.out}")
        return 0
    except (ValueError, TypeError) as exc:  # a spec that does not fit the model: same on every rank
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second SIGINT: stop at once, quietly
        return 128 + signal.SIGINT
    finally:
        leave_world()


def leave_world() -> None:
    """Destroy the process group while the interpreter is whole.

    DDP reducers, comm-hook futures and guards sit in reference cycles that keep the group and
    its gloo work alive; freed late, during interpreter shutdown, a gloo worker thread that drops
    the last reference to a Python object aborts the process ("terminate called without an
    active exception"). Collect them first, then destroy the group, so its threads are joined now.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple, errors) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()  # leave together: a peer tearing down early can abort a rank still in gloo
    except BaseException as exc:
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        leave_world()


def spawn(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``nproc`` fresh local processes (spawn start method)
    whose environment describes one world on 127.0.0.1 (``fn`` calls :func:`init_distributed`).

    Unlike ``torch.multiprocessing.spawn``, a failing rank does not get its peers killed: they
    meet the broken world themselves (and may record it). Raises :class:`DistributedError`
    naming every failed rank, or when the world has not finished within ``timeout_s`` (then
    the remaining processes are terminated).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(r, fn, nproc, port, args, errors)) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in late:
        procs[r].terminate()
        procs[r].join(5)
    messages = {}
    while not errors.empty():
        rank, message = errors.get()
        messages[rank] = message
    failed = [f"rank {r}: {messages.get(r, f'exited with code {p.exitcode}')}"
              for r, p in enumerate(procs) if r not in late and p.exitcode != 0]
    if late:
        failed.append(f"ranks {late} did not finish within {timeout_s:g} s")
    if failed:
        raise DistributedError("; ".join(failed))


LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals :func:`launch` catches and forwards to the ranks (SIGHUP as SIGTERM)."""


@contextlib.contextmanager
def _held_signals() -> Iterator[list[int] | None]:
    """Collect :data:`LAUNCHER_SIGNALS` (every one received, in order) instead of dying of them;
    None where handlers cannot be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in LAUNCHER_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _children(pid: int) -> list[int] | None:
    """The live child processes of ``pid`` (torchrun's: the ranks), from /proc; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's children (the ranks), then torchrun, and reap it."""
    for pid in _children(proc.pid) or ():
        _signal(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _stop(proc: subprocess.Popen, stop: list[int], grace_s: float) -> int:
    """Forward the stop request to the ranks (torchrun itself without /proc), wait up to
    ``grace_s`` for the job to end, and kill what is left (at once on a second signal)."""
    forward = stop[0] if stop[0] in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM
    deadline, told = time.monotonic() + grace_s, set()
    while proc.poll() is None:
        if len(stop) > 1 or time.monotonic() > deadline:
            _kill(proc)
            break
        ranks = _children(proc.pid)
        for pid in ([proc.pid] if ranks is None else ranks):  # ranks started late are told too
            if pid not in told:
                _signal(pid, forward)
                told.add(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.2)
    return proc.returncode


def _interrupted_summary(out: Path, world: int) -> dict[str, Any]:
    """Rank 0's summary of an interrupted run; where it wrote none (the ranks were killed, or
    stopped before training), one from metrics.jsonl, written to ``out`` if it exists."""
    summary = _read_summary(out)
    if "steps" in summary:
        return summary
    rows = []
    with contextlib.suppress(OSError, ValueError):
        rows = read_jsonl(out / "metrics.jsonl")
    last = rows[-1] if rows else {}
    summary = {"outcome": "interrupted", "final_train_loss": last.get("loss"), "final_val_loss": None,
               "steps": last["step"] + 1 if "step" in last else 0, "world_size": world}
    if out.is_dir():
        write_json(out / "summary.json", summary)
    return summary


def _read_summary(out: Path) -> dict[str, Any]:
    """``out/summary.json``, or {} where there is none (or it does not read)."""
    with contextlib.suppress(OSError, ValueError):
        return read_json(out / "summary.json")
    return {}


def launch(nproc: int, argv: Sequence[str], *, timeout_s: float | None = None, grace_s: float = 30.0) -> int:
    """Validate ``argv`` here, then run ``python -m sdcscope.engine.ddp argv`` on ``nproc`` local
    ranks through torchrun; return its exit code (0 when every rank succeeded). Past
    ``timeout_s`` the ranks are terminated (torchrun forwards the signal) and
    :class:`DistributedError` is raised.

    SIGINT, SIGTERM or SIGHUP (torchrun runs in its own session, so a terminal's Ctrl-C reaches
    this process only) is forwarded to the ranks, which stop after the same step; past ``grace_s``,
    or on a second signal, they are killed. Then :class:`Interrupted` is raised with the run's
    summary (outcome ``interrupted``; written here from metrics.jsonl if rank 0 could not), and so
    it is when the ranks were stopped by a signal from elsewhere."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be an integer >= 1")
    job = parse_job(argv, nproc)
    check_job(job, nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "-m", "sdcscope.engine.ddp", *argv]
    with _held_signals() as stop:
        proc = subprocess.Popen(cmd, start_new_session=stop is not None)
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while proc.poll() is None and not stop:
                if deadline is not None and time.monotonic() > deadline:
                    raise DistributedError(f"the world of {nproc} ranks did not finish within {timeout_s:g} s")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.2)
            rc = _stop(proc, stop, grace_s) if stop else proc.returncode
        finally:
            if proc.poll() is None:
                proc.terminate()  # torchrun forwards it to the ranks
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    _kill(proc)
    if stop or _read_summary(job.out).get("outcome") == "interrupted":
        summary = _interrupted_summary(job.out, nproc)
        if summary.get("outcome") == "interrupted":  # not a run that completed before the signal took effect
            raise Interrupted(stop[0] if stop else signal.SIGTERM, summary)
    return rc


if __name__ == "__main__":
    from sdcscope.engine import ddp as _module  # run the importable copy: one set of classes, not two

    code = _module.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter shutdown: no gloo thread can meet a half-finalized interpreter
