"""Cross-rank plumbing of a data-parallel run: joining a torchrun world, bit-exact row gathers,
and a local multi-process world for tests and benchmarks (:func:`spawn`).

A world is formed from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). Rank r trains micro-batch ``m`` of a step on ``workload.batch(seed, data_pos,
shard(r, grad_accum, m))``: a pure function, so reruns are bitwise identical and a rank's batch
can be recomputed anywhere.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
            "`sdcscope train --nproc N ...` or `torchrun --nproc-per-node N -m sdcscope.jobs.torchrun JOB.json`"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if config.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        dist.init_process_group(
            config.backend, rank=rank, world_size=world, timeout=timedelta(seconds=config.timeout_s)
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise DistributedError(
            f"rank {rank} could not form a world of {world} ranks at {where} within "
            f"{config.timeout_s:g} s (backend {config.backend}): {str(exc).splitlines()[0]}"
        ) from exc
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


def host_array(t: torch.Tensor) -> np.ndarray | None:
    """``t`` as a numpy view when it lives on the CPU in a numpy dtype: the hook's bookkeeping on
    a few hundred numbers costs a few microseconds per numpy call, tens per torch operation."""
    return t.detach().numpy() if t.device.type == "cpu" and t.dtype in _NUMPY else None


def encode_chunks(bits: Any, b: int, xp: Any) -> Any:
    """``[len(bits), 64 / b]`` chunks of int64 ``bits`` (numpy or torch, ``xp`` the module)."""
    if xp is np:
        return (bits[:, None] >> np.arange(0, 64, b, dtype=np.int64)) & ((1 << b) - 1)
    return (bits[:, None] >> torch.arange(0, 64, b, device=bits.device, dtype=torch.int64)) & ((1 << b) - 1)


def decode_chunks(c: Any, b: int, xp: Any) -> Any:
    """int64 bits from ``[..., 64 / b]`` int64 chunks (modified in place)."""
    n = 64 // b
    top = c[..., -1]
    top -= (top >> (b - 1)) << b  # the highest chunk carries the sign of the int64: [-2^(b-1), 2^(b-1))
    weights = [1 << (b * i) for i in range(n)]
    weights = (
        np.array(weights, dtype=np.int64) if xp is np else torch.tensor(weights, dtype=torch.int64, device=c.device)
    )
    return (c * weights).sum(-1)  # every partial sum fits in an int64: exact


def encode_rows(row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bits of the float64 ``row`` as ``len(row) * 64 / b`` integers in ``[0, 2^b)``, stored in
    ``dtype`` (``b`` = :data:`CHUNK_BITS`): a row that survives any all-reduce SUM with zeros."""
    b = CHUNK_BITS[dtype]
    row = row.to(torch.float64).contiguous()
    if row.device.type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(encode_chunks(row.numpy().view(np.int64), b, np).reshape(-1).astype(_NUMPY[dtype]))
    return encode_chunks(row.view(torch.int64), b, torch).reshape(-1).to(dtype)


def decode_rows(chunks: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`encode_rows` for ``[world, width * 64 / b]`` chunks: ``[world, width]`` float64."""
    b = CHUNK_BITS[chunks.dtype]
    host = host_array(chunks)
    if host is not None:
        c = host.astype(np.int64).reshape(chunks.shape[0], width, 64 // b)
        return torch.from_numpy(decode_chunks(c, b, np).view(np.float64))
    c = chunks.to(torch.int64).view(chunks.shape[0], width, 64 // b)
    return decode_chunks(c, b, torch).view(torch.float64)


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
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
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
    failed = [
        f"rank {r}: {messages.get(r, f'exited with code {p.exitcode}')}"
        for r, p in enumerate(procs)
        if r not in late and p.exitcode != 0
    ]
    if late:
        failed.append(f"ranks {late} did not finish within {timeout_s:g} s")
    if failed:
        raise DistributedError("; ".join(failed))
