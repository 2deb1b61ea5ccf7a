"""Detection across data-parallel ranks: what one bad device looks like next to its peers.

The gradient all-reduce copies one rank's corruption into every replica, so comparing replicas
*after* it sees nothing. Three checks:

- :class:`CrossRankDetector` -- each rank's gradient signatures taken **before** the reduction
  (:mod:`sdcscope.detect.signatures`), gathered each sampled step without an extra collective;
  every rank runs the same test on the same numbers, so every rank reaches the same verdict (and
  vetoes the same step) without another message. Tests, in log2 of the norms across the healthy
  ranks:

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

  Shards differ, so norms differ naturally, heavily at small batch (``benchmarks/`` measures the
  spread): hence the wide ``min_ratio`` and the learned ``margin`` × spread. An exponent bit flip
  is a 2^16..2^128 outlier; finite, in-range corruption below the natural spread needs replay or
  ABFT, not statistics.
- :class:`ReplicaHashCheck` -- every N steps, checksums of each parameter and its optimizer state
  compared across replicas: catches a fault that desynchronizes one replica (a flipped Adam
  moment, a weight, a post-reduction bucket).
- Local verdicts of per-rank detectors (ABFT, replay, ...) passed to :meth:`CrossRankDetector.check`
  are shared with every rank in the same step, each naming the rank that found it; a finding that
  every healthy rank made alike (the all-reduced gradient is the same everywhere) becomes one
  event about the world (``rank`` None, every rank a candidate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from sdcscope.common.validate import check_positive
from sdcscope.detect.events import Event
from sdcscope.detect.signatures import Gathered, GradientSignatures, as_ints, fletcher
from sdcscope.engine.dist import gather_rows


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
    see :class:`~sdcscope.engine.buckets.BucketHook`); False: in a small all-reduce of their own,
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

    def __init__(
        self, model: nn.Module, config: CrossRankConfig | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.config = config or CrossRankConfig()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.signatures = GradientSignatures(
            self.names, next(model.parameters()).device, group, piggyback=self.config.piggyback
        )
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
        self.last = Gathered(step, torch.from_numpy(norm), torch.from_numpy(a[:, p : 2 * p]), buckets)
        finite = np.isfinite(norm).all(1)
        bad = [r for r in self.healthy() if not finite[r]]
        events += [self._nonfinite(step, r, norm[r]) for r in bad]
        if not bad:
            events += self._outliers(step, norm)
        if post_step is not None:
            events += self._post(step, post_step, a[:, 2 * p :])
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
        return Event(
            step,
            self.name,
            "nonfinite",
            module=_module(params[0]) if params else None,
            rank=rank,
            evidence={
                "what": "pre-reduction gradient",
                "count": len(params),
                "params": params[: self.config.max_listed],
            },
        )

    def _deviation(self, norm: np.ndarray, healthy: list[int]) -> np.ndarray:
        """``[healthy, P]``: |log2 norm − median| across the healthy ranks (a zero norm counts
        as 2^-1000)."""
        x = np.log2(np.maximum(norm if len(healthy) == len(norm) else norm[healthy], 2.0**-1000))
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
        return [
            self._outlier_event(step, healthy[i], healthy, score[i], norm, thr, z[i])
            for i in range(len(healthy))
            if flagged[i].any()
        ]

    def _outlier_event(self, step, rank, healthy, score, norm, thr, z) -> Event:
        j = int(score.argmax())
        flagged = [self.names[k] for k in np.argsort(-score, kind="stable") if score[k] > 0]
        col = norm[healthy, j]
        median = float(_median(col))
        evidence = {
            "param": self.names[j],
            "norms": dict(zip(healthy, col.tolist())),
            "median": median,
            "threshold_ratio": 2.0 ** float(thr[j]),
            "params": flagged[: self.config.max_listed],
        }
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
        return [
            Event(
                step,
                self.name,
                "reduce_mismatch",
                rank=r,
                evidence={
                    "reduced_at": post_step,
                    "bucket_params": params[: self.config.max_listed],
                    "majority": majority,
                    "candidates": list(healthy) if r is None else [r],
                },
            )
            for r in odd
        ]


def about_reduced_gradient(finding: dict) -> bool:
    """A finding on the all-reduced gradient, which every rank holds alike: its non-finite values
    or a spike of its norm (a rank's loss and GEMMs are its own)."""
    what = finding.get("evidence") or {}
    return (finding["detector"] == "nonfinite" and what.get("what") == "grad") or (
        finding["detector"] == "spike" and what.get("signal") == "grad_norm"
    )


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
            same = [
                {**same[0], "rank": None, "evidence": {**same[0]["evidence"], "ranks": ranks, "candidates": healthy}}
            ]
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

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 10,
        group: dist.ProcessGroup | None = None,
    ) -> None:
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
        return fletcher(torch.cat([as_ints(t).to(device) for t in tensors]))

    def digests(self, per_parameter: bool = False) -> torch.Tensor:
        """``[4]`` (``[4 · P]`` per parameter): fletcher of the parameters, then of the state."""
        with torch.no_grad():
            groups = [[p] for p in self.params] if per_parameter else [self.params]
            return torch.cat(
                [
                    torch.cat(
                        [self._digest([q.reshape(-1) for q in g]), self._digest([t for q in g for t in self._state(q)])]
                    )
                    for g in groups
                ]
            )

    def check(self, step: int, excluded: Sequence[int] = ()) -> list[Event]:
        ranks = [r for r in range(self.world) if r not in set(excluded)]
        if not _groups(gather_rows(self.digests(), self.group).cpu(), ranks)[1]:
            return []
        majority, differ = _groups(gather_rows(self.digests(per_parameter=True), self.group).cpu(), ranks)
        names = list(dict.fromkeys(self.names[k // 4] for k in differ))
        what = sorted({"param" if k % 4 < 2 else "optimizer_state" for k in differ})
        odd = [None] if majority is None else [r for r in ranks if r not in majority]
        return [
            Event(
                step,
                self.name,
                "replica_mismatch",
                module=_module(names[0]) if names else None,
                rank=r,
                evidence={
                    "params": names[:8],
                    "what": what,
                    "majority": majority,
                    "candidates": ranks if r is None else [r],
                },
            )
            for r in odd
        ]
