"""Gradient signatures of each data-parallel rank, taken before the all-reduce: per parameter the
L2 norm (:func:`bucket_norms`), per bucket a bit checksum (:func:`bitsum`: the sum of the raw bits
as integers mod 2³², exact, order-free and changed by any single bit flip); gathered from every
rank in the last bucket's own all-reduce (:class:`GradientSignatures`). The tests over them are
:mod:`sdcscope.detect.crossrank`'s."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

MOD32 = 1 << 32
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(INT_VIEW[t.element_size()])


def _acc(t: torch.Tensor) -> torch.dtype:
    """Integer accumulator: int32 arithmetic wraps mod 2³², which is all a checksum keeps (and
    it is several times faster than int64 on CPU); 8-byte values accumulate in int64."""
    return torch.int32 if t.element_size() <= 4 else torch.int64


def _mod32(t: torch.Tensor) -> torch.Tensor:
    return (t.to(torch.int64) % MOD32).to(torch.float64)


def _wrapsum(t: torch.Tensor) -> torch.Tensor:
    """The integer sum of ``t``'s raw bits, wrapped in its accumulator (congruent mod 2³²)."""
    return as_ints(t).sum(dtype=_acc(t))


_NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _wrapsum_host(a: np.ndarray) -> int:
    """:func:`_wrapsum` of a flat numpy array, as a Python int."""
    acc = np.int32 if a.itemsize <= 4 else np.int64
    return int(a.view(_NP_INT[a.itemsize]).sum(dtype=acc))


def bitsum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the raw bits of ``t`` read as integers, mod 2³², as a float64 0-d tensor (exact)."""
    return _mod32(_wrapsum(t))


def fletcher(t: torch.Tensor) -> torch.Tensor:
    """``[Σ vᵢ, Σ (i+1)·vᵢ] mod 2³²`` of the raw bits: also sees elements that moved."""
    acc = _acc(t)
    v = as_ints(t).to(acc)
    w = torch.arange(1, v.numel() + 1, device=v.device, dtype=acc)
    return _mod32(torch.stack([v.sum(dtype=acc), (v * w).sum(dtype=acc)]))


ROW_MIN = 16
"""Shortest row worth a fused reduction: with shorter rows a bucket's norms are taken per tensor."""


@functools.lru_cache(maxsize=64)
def _row(sizes: tuple[int, ...]) -> int:
    """The row length that tiles every segment of a bucket: their gcd (0 when below ROW_MIN)."""
    g = math.gcd(*sizes)
    return g if g >= ROW_MIN else 0


def bucket_norms(flat: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The L2 norm of each consecutive segment of the flat ``flat`` (``sizes`` elements each), as
    float64 on ``flat``'s device: a pure function of the bits and the segmentation, so the
    signature sent before the reduction and a replay of the same gradients agree exactly.

    Float32 on the CPU: one fused reduction over rows of ``gcd(sizes)`` elements (no row straddles
    two segments) and a float64 sum of squared row norms per segment, instead of one kernel per
    tensor (the kernel calls, not the arithmetic, dominate a CPU hook). A row that overflows
    float32 is recomputed in float64, so a finite gradient has a finite norm (an exponent-bit flip
    reaches 2^128). Elsewhere (GPUs: no host sync in the comm hook), one fused ``foreach`` norm in
    float64.
    """
    sizes = tuple(int(n) for n in sizes)
    flat = flat.detach()
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and _row(sizes):
        return torch.from_numpy(_row_norms(flat, sizes))
    return torch.stack(torch._foreach_norm(list(flat.split(sizes)), 2, dtype=torch.float64))


@functools.lru_cache(maxsize=64)
def _starts(sizes: tuple[int, ...], g: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([n // g for n in sizes[:-1]], dtype=np.int64)])


def _row_norms(flat: torch.Tensor, sizes: tuple[int, ...]) -> np.ndarray:
    """:func:`bucket_norms` of a float32 CPU tensor whose segments tile into rows (numpy result)."""
    g = _row(sizes)
    grid = flat.view(-1, g)
    rows = torch.linalg.vector_norm(grid, dim=1).numpy().astype(np.float64)
    overflow = np.flatnonzero(np.isinf(rows))  # overflowed in float32 (or a real inf: stays inf)
    if overflow.size:
        rows[overflow] = torch.linalg.vector_norm(grid[overflow.tolist()].double(), dim=1).numpy()
    return np.sqrt(np.add.reduceat(rows * rows, _starts(sizes, g)))


def grad_signatures(
    grads: Sequence[torch.Tensor | None], buckets: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """``[2, P]``: :func:`bucket_norms` and :func:`bitsum` of each gradient (nan where ``None``).

    ``buckets``: the slots of each DDP bucket, to take the norms exactly as the comm hook did
    (default: every tensor its own bucket; a missing gradient is left out of its bucket).
    """
    out = torch.full((2, len(grads)), math.nan, dtype=torch.float64)
    present = [i for i, g in enumerate(grads) if g is not None]
    for slots in buckets if buckets is not None else [[i] for i in present]:
        slots = [i for i in slots if grads[i] is not None]
        if slots:
            flat = torch.cat([grads[i].detach().reshape(-1) for i in slots])
            out[0, slots] = bucket_norms(flat, tuple(grads[i].numel() for i in slots)).cpu()
    if present:
        out[1, present] = torch.stack([bitsum(grads[i]) for i in present]).cpu()
    return out


class GradientSignatures:
    """Bucket-hook stage: this rank's signatures, gathered without an extra collective.

    Before each bucket's reduction: the norm of each of its parameters and one bit checksum
    of the whole bucket (written into each of its parameters' slots). At the step's last bucket
    the row ``[norms, checksums, reduced checksums of the previous sampled step]`` rides along
    in the bucket's own all-reduce (:class:`~sdcscope.engine.buckets.BucketHook` riders), or with
    ``piggyback=False`` in an asynchronous all-reduce of its own issued next to it. After each
    reduction: the bit checksum of the reduced bucket, sent with the next sampled step (so a
    corrupted reduction is seen one step late).
    """

    def __init__(
        self,
        names: Sequence[str],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        *,
        piggyback: bool = True,
    ) -> None:
        self.index = {n: i for i, n in enumerate(names)}
        self.group, self.piggyback = group, piggyback
        p, self.rank, self.world = len(names), dist.get_rank(group), dist.get_world_size(group)
        # This rank's row of [norms, checksums (wrapped; reduced mod 2³² after the gather), reduced
        # checksums of the previous sampled step]; ``rows``: every rank's, once gathered.
        self.row = torch.zeros(3 * p, dtype=torch.float64, device=device)
        self.norm, self.pre, self.post = self.row.split(p)
        self.post.fill_(math.nan)
        self.rows: torch.Tensor | None = None
        self.post_step: int | None = None  # the step whose reduced checksums ``post`` holds
        self._post_next = torch.full_like(self.norm, math.nan)
        # On the CPU the hook writes through numpy views (a few microseconds, not tens, per write).
        self._host = (self.norm.numpy(), self.pre.numpy(), self._post_next.numpy()) if device.type == "cpu" else None
        self._reduced_step: int | None = None
        self.buckets: list[list[int]] = []  # parameter slots of each bucket, this step
        self.step, self.sampled = 0, False
        self.pending: tuple[int, int | None, list[list[int]], Any] | None = None  # step, post step, buckets, work
        self._slots: dict[tuple, tuple[list[int], torch.Tensor, tuple[int, ...]]] = {}

    def begin(self, step: int, sampled: bool) -> None:
        if self.pending is not None and self.pending[-1] is not None:  # never collected: let it land
            self.pending[-1].wait()
        if self._reduced_step is not None:
            if self._host is not None:
                self.post.numpy()[:] = self._host[2]
            else:
                self.post.copy_(self._post_next)
            self.post_step, self._reduced_step = self._reduced_step, None
        self.step, self.sampled, self.pending, self.buckets = step, sampled, None, []

    def _slot(self, view) -> tuple[list[int], torch.Tensor, tuple[int, ...]]:
        """A bucket's parameter slots (as a list and an index tensor) and segment sizes."""
        key = (view.index, *view.names)
        if key not in self._slots:
            slots = [self.index[n] for n in view.names]
            sizes = tuple(g.numel() for g in view.grads)
            assert sum(sizes) == view.buffer.numel(), "a DDP bucket holds more than its gradients"
            self._slots[key] = (slots, torch.tensor(slots, device=view.buffer.device), sizes)
        return self._slots[key]

    def before_reduce(self, view) -> None:
        if not self.sampled:
            return
        slots, idx, sizes = self._slot(view)
        self.buckets.append(slots)
        host = getattr(view, "host", None)
        if self._host is not None and host is not None and view.buffer.dtype == torch.float32 and _row(sizes):
            self._host[0][slots] = _row_norms(view.buffer, sizes)
            self._host[1][slots] = _wrapsum_host(host)
        else:
            self.norm[idx] = bucket_norms(view.buffer, sizes).to(self.norm.device)
            self.pre[idx] = _wrapsum(view.buffer).to(self.pre.device, torch.float64)
        if view.last and not self.piggyback:
            self.rows = torch.zeros((self.world, self.row.numel()), dtype=torch.float64, device=self.row.device)
            self.rows[self.rank] = self.row
            work = dist.all_reduce(self.rows, group=self.group, async_op=True)  # as gather_rows does
            self.pending = (self.step, self.post_step, self.buckets, work)

    def ride(self, view) -> torch.Tensor | None:
        """The row to gather with the last bucket of a sampled step (piggyback mode)."""
        if not (self.piggyback and self.sampled and view.last):
            return None
        self.pending, self.rows = (self.step, self.post_step, self.buckets, None), None
        return self.row

    def landed(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def after_reduce(self, view) -> None:
        if self.sampled:
            slots, idx, _ = self._slot(view)
            host = getattr(view, "host", None)
            if self._host is not None and host is not None:
                self._host[2][slots] = _wrapsum_host(host)
            else:
                self._post_next[idx] = _wrapsum(view.buffer).to(self._post_next.device, torch.float64)
            self._reduced_step = self.step

    def collect(self, step: int) -> tuple[torch.Tensor, int | None, list[list[int]]] | None:
        """``(rows, step of the reduced checksums, buckets)`` gathered at ``step``, or ``None``."""
        if self.pending is None or self.pending[0] != step:
            return None
        _, post_step, buckets, work = self.pending
        if work is not None:
            work.wait()
        self.pending = None
        assert self.rows is not None, "the last bucket of a sampled step was reduced without its signatures"
        rows = self.rows.numpy().copy() if self.rows.device.type == "cpu" else self.rows.cpu().numpy()
        rows[:, self.pre.numel() :] %= MOD32  # exact: float64 holds these integers
        return torch.from_numpy(rows), post_step, buckets


@dataclass
class Gathered:
    """The world's signatures of one sampled step, as every rank holds them (CPU, float64)."""

    step: int
    norm: torch.Tensor  # [world, P] L2 norm of each local (pre-reduction) gradient
    pre: torch.Tensor  # [world, P] bit checksum of the bucket holding each parameter
    buckets: list[list[int]]
    """The parameter slots of each bucket."""
