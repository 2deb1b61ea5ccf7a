"""DDP's one communication hook, open to *stages*: fault injection, pre-reduction signatures and
rank exclusion plug into the same gradient all-reduce.

Stages see each bucket before (``before_reduce(view)``) and after (``after_reduce(view)``) the
reduction, through a :class:`BucketView`: fault injection (:mod:`sdcscope.inject.comm`),
signatures (:mod:`sdcscope.detect.crossrank`) and rank exclusion (:meth:`BucketHook.exclude`,
used by :mod:`sdcscope.mitigate.quarantine`). With nothing excluded it averages exactly like
DDP's default hook (divide, then all-reduce SUM).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.engine.dist import CHUNK_BITS, decode_chunks, decode_rows, encode_chunks, encode_rows, host_array


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
            assert all(g.untyped_storage().data_ptr() == storage for g in grads), (
                "DDP bucket gradients are not views of the bucket buffer"
            )
            self._views[key] = BucketView(
                bucket.index(),
                buffer,
                [self.names[id(p)] for p in bucket.parameters()],
                grads,
                bucket.is_last(),
                host_array(buffer),
            )
        return self._views[key]

    def reduce(self, state, bucket):  # unannotated: DDP checks annotations against real types
        buffer = bucket.buffer()
        view = self._view(bucket, buffer) if self.stages else None
        for stage in self.stages:
            stage.before_reduce(view)
        if self.rank in self.excluded:
            buffer.zero_()
        buffer.div_(self.world - len(self.excluded))
        rows = (
            [(s, r) for s in self.riders if (r := s.ride(view)) is not None] if view is not None and view.last else []
        )
        if not rows:
            fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        elif buffer.dtype in CHUNK_BITS:
            fut = self._reduce_with(buffer, view, torch.cat([r.to(torch.float64) for _, r in rows]))
        else:
            mat = torch.zeros((self.world, sum(r.numel() for _, r in rows)), dtype=torch.float64, device=buffer.device)
            mat[self.rank] = torch.cat([r.to(torch.float64) for _, r in rows])
            fut = torch.futures.collect_all(
                [
                    dist.all_reduce(buffer, group=self.group, async_op=True).get_future(),
                    dist.all_reduce(mat, group=self.group, async_op=True).get_future(),
                ]
            )
            fut = fut.then(lambda f: (f.value()[0].value()[0], mat))

        def reduced(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            if rows:
                out, mat = value
                start = 0
                for stage, row in rows:
                    stage.landed(mat[:, start : start + row.numel()])
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
            self._combined[key] = (combined, host_array(combined))
        combined, out = self._combined[key]
        own = slice(n + self.rank * size, n + (self.rank + 1) * size)
        row_host = host_array(row) if view.host is not None and out is not None else None
        if row_host is not None:  # the CPU: numpy views, no torch operation but the all-reduce
            out[:n] = view.host
            out[n:] = 0
            out[own] = encode_chunks(np.ascontiguousarray(row_host, dtype=np.float64).view(np.int64), b, np).reshape(-1)
        else:
            combined[:n].copy_(buffer)
            combined[n:].zero_()
            combined[own] = encode_rows(row, buffer.dtype)

        def unpack(f: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor]:
            if row_host is not None:
                view.host[:] = out[:n]
                chunks = out[n:].astype(np.int64).reshape(self.world, width, 64 // b)
                return buffer, torch.from_numpy(decode_chunks(chunks, b, np).view(np.float64))
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
