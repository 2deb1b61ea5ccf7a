"""Detection across data-parallel ranks: what one bad device looks like next to its peers.

The gradient all-reduce copies one rank's corruption into every replica, so comparing replicas
*after* it sees nothing (style_ecosystem.md B4; production_sdc.md §7 gap 3). Three checks:

- :class:`CrossRankDetector` -- each rank's gradient signatures taken **before** the reduction
  (a stage of the DDP bucket hook): per parameter the L2 norm (:func:`bucket_norms`), per bucket a bit checksum
  (the sum of the raw bits as integers, mod 2³²: exact, order-free, and changed by any single bit
  flip). Each sampled step, every rank's row of norms and checksums rides along in the last
  bucket's own all-reduce (no extra collective, no extra synchronization point),
  and every rank runs the same test on the same numbers, so every rank reaches the same verdict
  (and vetoes the same step) without another message. Tests, in log2 of the norms across the
  healthy ranks:

  * a non-finite local gradient on a rank (its norm is not finite): that rank;
  * ≥ 3 ranks: robust z = |x − median| / (1.4826·MAD + 0.05) > ``z_threshold``, and the rank is
    more than ``min_ratio`` (and ``margin`` × the largest spread seen on clean steps) away from
    the median: that rank;
  * 2 ranks: median and MAD of two values cannot say which one is off; the same distance test
    flags the pair and the event lists both as ``candidates`` -- a replay on a peer
    (:mod:`sdcscope.localize.ranks`) then names the rank;
  * after the reduction every rank must hold the same bits: a checksum of each reduced bucket
    travels with the next sampled step, and a rank that differs from the majority was corrupted
    after (or in) the all-reduce (seen one step late; its replica has diverged by then).

  Shards differ, so norms differ naturally, and heavily at small batch: the tiny GPT's
  per-parameter spread across 3 ranks reached 2^7.3 (157×) at batch 2 and 2^5.5 at batch 8 in
  the first 300 steps (the CNN: 2^2.4). So a rank must be ``min_ratio`` (1024×) away from the
  median, and ``margin`` × the largest spread seen on clean steps (learned as training goes, and
  from every step a replay proved natural). An exponent bit flip is a 2^16..2^128 outlier;
  finite, in-range corruption below the natural spread needs replay or ABFT, not statistics.
- :class:`ReplicaHashCheck` -- every N steps, checksums of each parameter and its optimizer state
  compared across replicas: catches a fault that desynchronizes one replica (a flipped Adam
  moment, a weight, a post-reduction bucket).
- Local verdicts of per-rank detectors (ABFT, replay, ...) passed to :meth:`CrossRankDetector.check`
  are shared with every rank in the same step, each naming the rank that found it; a finding that
  every healthy rank made alike (the all-reduced gradient is the same everywhere) becomes one
  event about the world (``rank`` None, every rank a candidate).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sdcscope._validate import check_positive
from sdcscope.detect.events import Event
from sdcscope.engine.ddp import gather_rows

MOD32 = 1 << 32
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(kw_only=True)
class CrossRankConfig:
    every: int = 1
    """Gather and test signatures every N steps (1: every step); other steps cost nothing."""
    z_threshold: float = 6.0
    """Robust z a rank must exceed (with 3 or more healthy ranks)."""
    min_ratio: float = 1024.0
    """A rank's gradient norm must differ from the median by at least this factor ..."""
    margin: float = 1.5
    """... and by ``margin`` × the largest natural log2-spread seen so far for that parameter."""
    max_listed: int = 8
    piggyback: bool = True
    """Gather the signatures in the last gradient bucket's own all-reduce (no extra collective;
    see :class:`~sdcscope.engine.ddp.BucketHook`); False: in a small all-reduce of their own,
    which leaves the bucket's reduction exactly as without the check at any world size."""

    def __post_init__(self) -> None:
        if not isinstance(self.piggyback, bool):
            raise ValueError(f"piggyback={self.piggyback!r} must be True or False")
        check_positive("every", self.every)
        check_positive("max_listed", self.max_listed)
        for name, low in (("z_threshold", 0.0), ("min_ratio", 1.0), ("margin", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ValueError(f"{name}={value!r} must be a number > {low:g}")


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(INT_VIEW[t.element_size()])


def _acc(t: torch.Tensor) -> torch.dtype:
    """Integer accumulator: int32 arithmetic wraps mod 2³², which is all a checksum keeps (and
    it is several times faster than int64 on CPU); 8-byte values accumulate in int64."""
    return torch.int32 if t.element_size() <= 4 else torch.int64


def _mod32(t: torch.Tensor) -> torch.Tensor:
    return (t.to(torch.int64) % MOD32).to(torch.float64)


def _wrapsum(t: torch.Tensor) -> torch.Tensor:
    """The integer sum of ``t``'s raw bits, wrapped in its accumulator (congruent mod 2³²)."""
    return _ints(t).sum(dtype=_acc(t))


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
    v = _ints(t).to(acc)
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


def grad_signatures(grads: Sequence[torch.Tensor | None], buckets: Sequence[Sequence[int]] | None = None
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
    in the bucket's own all-reduce (:class:`~sdcscope.engine.ddp.BucketHook` riders), or with
    ``piggyback=False`` in an asynchronous all-reduce of its own issued next to it. After each
    reduction: the bit checksum of the reduced bucket, sent with the next sampled step (so a
    corrupted reduction is seen one step late).
    """

    def __init__(self, names: Sequence[str], device: torch.device, group: dist.ProcessGroup | None = None,
                 *, piggyback: bool = True) -> None:
        self.index = {n: i for i, n in enumerate(names)}
        self.group, self.piggyback = group, piggyback
        p, self.rank, self.world = len(names), dist.get_rank(group), dist.get_world_size(group)
        # This rank's row of [norms, checksums (wrapped; reduced mod 2³² after the gather), reduced
        # checksums of the previous sampled step]; ``rows``: every rank's, once gathered.
        self.row = torch.zeros(3 * p, dtype=torch.float64, device=device)
        self.norm, self.pre, self.post = self.row.split(p)
        self.post.fill_(math.nan)
        self.rows: torch.Tensor | None = None
        self.post_step: int | None = None                  # the step whose reduced checksums ``post`` holds
        self._post_next = torch.full_like(self.norm, math.nan)
        # On the CPU the hook writes through numpy views (a few microseconds, not tens, per write).
        self._host = (self.norm.numpy(), self.pre.numpy(), self._post_next.numpy()) if device.type == "cpu" else None
        self._reduced_step: int | None = None
        self.buckets: list[list[int]] = []                 # parameter slots of each bucket, this step
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
        rows[:, self.pre.numel():] %= MOD32  # exact: float64 holds these integers
        return torch.from_numpy(rows), post_step, buckets


@dataclass
class Gathered:
    """The world's signatures of one sampled step, as every rank holds them (CPU, float64)."""

    step: int
    norm: torch.Tensor   # [world, P] L2 norm of each local (pre-reduction) gradient
    pre: torch.Tensor    # [world, P] bit checksum of the bucket holding each parameter
    buckets: list[list[int]]
    """The parameter slots of each bucket."""


def _groups(rows: torch.Tensor, ranks: Sequence[int]) -> tuple[list[int] | None, list[int]]:
    """``(majority ranks or None when there is no unique largest group, columns that differ)``."""
    keys: dict[tuple, list[int]] = {}
    for r in ranks:
        keys.setdefault(tuple(rows[r].tolist()), []).append(r)
    sizes = sorted((len(v) for v in keys.values()), reverse=True)
    majority = max(keys.values(), key=len) if len(sizes) == 1 or sizes[0] > sizes[1] else None
    sub = rows[list(ranks)]
    differ = (sub != sub[0]).any(0).nonzero().flatten().tolist()
    return majority, differ


def _median(x: np.ndarray) -> np.ndarray:
    """Median over axis 0 (the mean of the two middle values for an even count)."""
    v = np.sort(x, axis=0)
    n = v.shape[0]
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _module(param: str) -> str:
    return param.rpartition(".")[0] or param


class CrossRankDetector:
    """Per-rank gradient signatures before the reduction, tested across ranks each sampled step.

    Use: add ``signatures`` to the DDP bucket hook; ``begin(step)`` before the forward pass;
    ``check(step)`` after the backward and before ``optimizer.step()``, on **every** rank.
    ``excluded``: quarantined ranks, left out of every test.
    """

    name = "crossrank"

    def __init__(self, model: nn.Module, config: CrossRankConfig | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.config = config or CrossRankConfig()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.signatures = GradientSignatures(self.names, next(model.parameters()).device, group,
                                             piggyback=self.config.piggyback)
        self.excluded: frozenset[int] = frozenset()
        self._healthy: tuple[frozenset[int] | None, list[int]] = (None, [])
        # The per-step statistics run on a few numbers per parameter: numpy, not torch (whose
        # per-operation dispatch cost would dominate on arrays this small).
        self.spread = np.zeros(len(self.names))
        """Largest natural |log2 norm − median| seen per parameter."""
        self.threshold = np.full_like(self.spread, math.log2(self.config.min_ratio))
        """log2 distance from the median that flags a rank: max(log2 min_ratio, margin × spread)."""
        self.last: Gathered | None = None

    def sampled(self, step: int) -> bool:
        return step % self.config.every == 0

    def begin(self, step: int) -> None:
        self.signatures.begin(step, self.sampled(step))

    def healthy(self) -> list[int]:
        if self._healthy[0] is not self.excluded:
            self._healthy = (self.excluded, [r for r in range(self.world) if r not in self.excluded])
        return self._healthy[1]

    def check(self, step: int, local_events: Sequence[Event] | None = None) -> list[Event]:
        """The world's findings at ``step``. ``local_events``: this rank's own detectors' findings
        to share with every rank (``None``: nothing to share, no collective for it)."""
        events = [] if local_events is None else self._shared(local_events)
        got = self.signatures.collect(step)
        if got is None:
            return events
        rows, post_step, buckets = got
        p = len(self.names)
        a = rows.numpy()
        norm = a[:, :p]
        self.last = Gathered(step, torch.from_numpy(norm), torch.from_numpy(a[:, p:2 * p]), buckets)
        finite = np.isfinite(norm).all(1)
        bad = [r for r in self.healthy() if not finite[r]]
        events += [self._nonfinite(step, r, norm[r]) for r in bad]
        if not bad:
            events += self._outliers(step, norm)
        if post_step is not None:
            events += self._post(step, post_step, a[:, 2 * p:])
        return events

    def _shared(self, local: Sequence[Event]) -> list[Event]:
        """Local verdicts of every rank, on every rank (object gather only when there are any)."""
        counts = gather_rows(torch.tensor([float(len(local))], dtype=torch.float64), self.group)
        if not counts.any():
            return []
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, [{**e.to_dict(), "rank": self.rank} for e in local], group=self.group)
        return merge_findings(gathered, self.healthy())

    def _nonfinite(self, step: int, rank: int, norm: np.ndarray) -> Event:
        params = [self.names[i] for i in np.flatnonzero(~np.isfinite(norm))]
        return Event(step, self.name, "nonfinite", module=_module(params[0]) if params else None, rank=rank,
                     evidence={"what": "pre-reduction gradient", "count": len(params),
                               "params": params[:self.config.max_listed]})

    def _deviation(self, norm: np.ndarray, healthy: list[int]) -> np.ndarray:
        """``[healthy, P]``: |log2 norm − median| across the healthy ranks (a zero norm counts
        as 2^-1000)."""
        x = np.log2(np.maximum(norm if len(healthy) == len(norm) else norm[healthy], 2.0 ** -1000))
        return np.abs(x - _median(x))

    def learn(self, dev: np.ndarray | None = None) -> None:
        """Fold a step's spread (default: the last sampled step's) into the natural spread: a
        clean step, or one a replay proved natural."""
        healthy = self.healthy()
        if dev is None and self.last is not None and len(healthy) >= 2:
            dev = self._deviation(self.last.norm.numpy(), healthy)
        if dev is not None:
            np.maximum(self.spread, dev.max(0), out=self.spread)
            np.maximum(self.config.margin * self.spread, math.log2(self.config.min_ratio), out=self.threshold)

    def _outliers(self, step: int, norm: np.ndarray) -> list[Event]:
        healthy = self.healthy()
        if len(healthy) < 2:
            return []
        dev = self._deviation(norm, healthy)
        flagged = dev > self.threshold
        z = None
        if len(healthy) >= 3:
            z = dev / (1.4826 * _median(dev) + 0.05)
            flagged &= z > self.config.z_threshold
        if not flagged.any():
            self.learn(dev)
            return []
        thr = self.threshold
        score = np.where(flagged, dev / thr, 0.0)
        if z is None:
            return [self._outlier_event(step, None, healthy, score.max(0), norm, thr, z=None)]
        return [self._outlier_event(step, healthy[i], healthy, score[i], norm, thr, z[i])
                for i in range(len(healthy)) if flagged[i].any()]

    def _outlier_event(self, step, rank, healthy, score, norm, thr, z) -> Event:
        j = int(score.argmax())
        flagged = [self.names[k] for k in np.argsort(-score, kind="stable") if score[k] > 0]
        col = norm[healthy, j]
        median = float(_median(col))
        evidence = {"param": self.names[j], "norms": dict(zip(healthy, col.tolist())), "median": median,
                    "threshold_ratio": 2.0 ** float(thr[j]), "params": flagged[:self.config.max_listed]}
        if rank is None:
            evidence["candidates"] = list(healthy)
        else:
            evidence.update(ratio=float(norm[rank, j]) / median if median else math.inf, z=float(z[j]))
        return Event(step, self.name, "grad_outlier", module=_module(self.names[j]), rank=rank, evidence=evidence)

    def _post(self, step: int, post_step: int, post: np.ndarray) -> list[Event]:
        """The reduced buckets of ``post_step`` must have been equal on every rank."""
        healthy = self.healthy()
        if (post[healthy] == post[healthy[0]]).all():  # the common case: one comparison
            return []
        majority, differ = _groups(torch.from_numpy(post), healthy)
        params = [self.names[k] for k in differ]
        odd = [None] if majority is None else [r for r in healthy if r not in majority]
        return [Event(step, self.name, "reduce_mismatch", rank=r,
                      evidence={"reduced_at": post_step, "bucket_params": params[:self.config.max_listed],
                                "majority": majority, "candidates": list(healthy) if r is None else [r]})
                for r in odd]


def about_reduced_gradient(finding: dict) -> bool:
    """A finding on the all-reduced gradient, which every rank holds alike: its non-finite values
    or a spike of its norm (a rank's loss and GEMMs are its own)."""
    what = finding.get("evidence") or {}
    return (finding["detector"] == "nonfinite" and what.get("what") == "grad") or \
        (finding["detector"] == "spike" and what.get("signal") == "grad_norm")


def merge_findings(gathered: Sequence[list[dict]], healthy: Sequence[int]) -> list[Event]:
    """The world's events from every rank's local findings (``gathered[r]``: rank r's, as dicts
    carrying their rank; quarantined ranks are left out). A finding about the world -- one every
    healthy rank made alike, or one about the all-reduced gradient (a rank that voided its step on
    other evidence did not look) -- becomes one event with ``rank`` None and every healthy rank a
    candidate: a replay of each decides whose it is, if anyone's. Others keep their rank."""
    healthy = sorted(healthy)
    found: dict[tuple, list[dict]] = {}
    for rank in healthy:
        for d in gathered[rank]:
            key = (d["detector"], d["verdict"], d["module"], d["gemm"], str(d["index"]))
            found.setdefault(key, []).append(d)
    events = []
    for same in found.values():
        ranks = sorted({d["rank"] for d in same})
        if len(healthy) > 1 and (ranks == healthy or about_reduced_gradient(same[0])):
            same = [{**same[0], "rank": None,
                     "evidence": {**same[0]["evidence"], "ranks": ranks, "candidates": healthy}}]
        events += [Event(**{**d, "index": None if d["index"] is None else tuple(d["index"])}) for d in same]
    return events


class ReplicaHashCheck:
    """Every ``every`` steps, checksums of the parameters and the optimizer state compared across
    replicas (a collective: call on every rank). Replicas of a data-parallel run must be bitwise
    equal; a mismatch names the minority rank(s) -- none when there is no majority -- and, from a
    second, per-parameter round (only then), the parameters that differ.

    The common path is two :func:`fletcher` checksums over all parameters and two over all
    optimizer state, one small all-reduce: cheap enough to run often (Megatron's SHA-1 on the CPU
    "is not meant to run often").
    """

    name = "replica_hash"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 every: int = 10, group: dist.ProcessGroup | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"replica hash every={every!r} must be an integer >= 0 (0: off)")
        self.every, self.group = every, group
        self.world = dist.get_world_size(group)
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.optimizer = optimizer

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _state(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
        return [state[k].reshape(-1) for k in sorted(state) if isinstance(state[k], torch.Tensor)]

    def _digest(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        device = self.params[0].device
        if not tensors:
            return torch.zeros(2, dtype=torch.float64, device=device)
        return fletcher(torch.cat([_ints(t).to(device) for t in tensors]))

    def digests(self, per_parameter: bool = False) -> torch.Tensor:
        """``[4]`` (``[4 · P]`` per parameter): fletcher of the parameters, then of the state."""
        with torch.no_grad():
            groups = [[p] for p in self.params] if per_parameter else [self.params]
            return torch.cat([torch.cat([self._digest([q.reshape(-1) for q in g]),
                                         self._digest([t for q in g for t in self._state(q)])])
                              for g in groups])

    def check(self, step: int, excluded: Sequence[int] = ()) -> list[Event]:
        ranks = [r for r in range(self.world) if r not in set(excluded)]
        if not _groups(gather_rows(self.digests(), self.group).cpu(), ranks)[1]:
            return []
        majority, differ = _groups(gather_rows(self.digests(per_parameter=True), self.group).cpu(), ranks)
        names = list(dict.fromkeys(self.names[k // 4] for k in differ))
        what = sorted({"param" if k % 4 < 2 else "optimizer_state" for k in differ})
        odd = [None] if majority is None else [r for r in ranks if r not in majority]
        return [Event(step, self.name, "replica_mismatch", module=_module(names[0]) if names else None, rank=r,
                      evidence={"params": names[:8], "what": what, "majority": majority,
                                "candidates": ranks if r is None else [r]})
                for r in odd]
