"""The relation contract, the registry, and the inference helpers every relation shares.

A relation is a template (``Consistent(A, B)``, ``EventContain(A, B)``, ...).  Its class:

- ``validate(params)`` rejects malformed parameters when an invariants file is loaded;
- ``infer(traces, config)`` returns the instances that hold in *every* reference trace;
- ``bind(invariant, header)`` resolves names against one model (a trace header) and returns a
  :class:`Check`, whose ``check(view)`` yields ``(module, evidence)`` per violation;
- ``Check.needs()`` says what the recorder must collect beyond its cheap defaults.

Preconditions (phase, learned warm-up step, APIs that must have run) are evaluated by the
checker before ``check`` is called, so relations only state the relation itself.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from sdcscope.common.validate import check_choice, check_positive
from sdcscope.invariants.spec import Invariant

RELATIONS: dict[str, type[Relation]] = {}
APPLIED = ("optimizer.step",)
"""Precondition of numeric bounds on training values: the step's update was applied.  A step
that a GradScaler (or a guard) skipped because gradients were not finite is handled, not silent."""


@dataclass(kw_only=True)
class InferConfig:
    """How strict inference is."""

    margin: float = 10.0
    """Learned numeric bounds [lo, hi] are widened to [lo/margin, hi·margin] (or by
    (margin-1)·span when they straddle 0).  References never show the full range of clean runs:
    gradient norms of a clean run spike to several times the references' maximum, so bounds are
    order-of-magnitude; the bugs they exist for (a loss summed instead of averaged, an unscaled
    loss, non-finite values) are off by far more."""
    min_support: int = 3
    """An invariant needs at least this many observations over all references."""
    max_warmup: float = 0.5
    """A learned warm-up (min_step) may cover at most this fraction of a reference run."""
    relations: tuple[str, ...] = ()
    """Only these relations (empty: all)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.margin, (int, float)) and self.margin >= 1.0):
            raise ValueError(f"margin={self.margin!r} must be a number >= 1")
        check_positive("min_support", self.min_support)
        if not 0.0 <= self.max_warmup <= 1.0:
            raise ValueError(f"max_warmup={self.max_warmup!r} must be in [0, 1]")
        self.relations = tuple(self.relations)
        for name in self.relations:
            check_choice("relation", name, RELATIONS)


class View:
    """A record indexed once for all checks: each API's first position and its calls' fields;
    on demand, the replays of the step in it and how many times each API ran."""

    __slots__ = ("rec", "first", "fields", "step", "phase", "_replays", "_counts")

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec, self.step, self.phase = rec, rec["step"], rec["phase"]
        first: dict[str, int] = {}
        fields: dict[str, list[dict[str, Any]]] = {}
        for i, (api, f) in enumerate(rec["calls"]):
            if api not in first:
                first[api] = i
                fields[api] = [f]
            else:
                fields[api].append(f)
        self.first, self.fields = first, fields
        self._replays: tuple[set[int], set[int]] | None = None
        self._counts: Counter[str] | None = None

    def replays(self) -> tuple[set[int], set[int]]:
        """Call indices of the forwards that replay the step, and of the calls they supersede.

        A re-execution of the step (a guard's replay) always zeroes the gradients first, then
        runs a forward on an input the step already saw (inputs are known when fingerprinted),
        before the update; it supersedes the calls from that input's earlier forward up to that
        ``zero_grad``.  After an ``optimizer.step``, the same input again is training on it twice.
        """
        if self._replays is None:
            seen: dict[int, int] = {}
            zeroed = -1
            replaying: set[int] = set()
            superseded: set[int] = set()
            for i, (api, f) in enumerate(self.rec["calls"]):
                if api == "zero_grad":
                    zeroed = i
                elif api == "optimizer.step":
                    seen.clear()
                elif api == "forward" and (x := f.get("input")) is not None:
                    if seen.get(x, zeroed) < zeroed:
                        replaying.add(i)
                        superseded.update(range(seen[x], zeroed + 1))
                    seen[x] = i
            self._replays = replaying, superseded
        return self._replays

    def counts(self) -> Counter[str]:
        """How many times each API ran, not counting the calls a replay superseded."""
        if self._counts is None:
            superseded = self.replays()[1]
            self._counts = Counter(c[0] for i, c in enumerate(self.rec["calls"]) if i not in superseded)
        return self._counts


class Check:
    """An invariant bound to one model; ``check`` returns ``[(module, evidence), ...]``."""

    def __init__(self, inv: Invariant) -> None:
        self.inv = inv

    def check(self, view: View) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def needs(self) -> dict[str, Any]:
        """What the recorder must collect beyond its defaults (``TraceConfig`` fields)."""
        return {}

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """Violations only the end of the run shows (a warm-up still rising when it ended)."""
        return []


class Relation:
    name: ClassVar[str]
    required: ClassVar[dict[str, type | tuple[type, ...]]] = {}
    optional: ClassVar[dict[str, type | tuple[type, ...]]] = {}

    @classmethod
    def validate(cls, params: Any) -> None:
        if not isinstance(params, dict):
            raise ValueError(f"{cls.name} params must be a mapping, not {params!r}")
        allowed = {**cls.required, **cls.optional}
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"{cls.name}: unknown param(s) {unknown}; allowed: {', '.join(allowed)}")
        for key, kind in allowed.items():
            if key not in params:
                if key in cls.required:
                    raise ValueError(f"{cls.name}: missing param {key!r}")
                continue
            if not isinstance(params[key], kind) or isinstance(params[key], bool) and kind in (int, float):
                raise ValueError(f"{cls.name}: param {key}={params[key]!r} has the wrong type")

    @classmethod
    def infer(cls, traces: list, config: InferConfig) -> list[Invariant]:
        raise NotImplementedError

    @classmethod
    def bind(cls, inv: Invariant, header: dict[str, Any]) -> Check:
        raise NotImplementedError


def register(cls: type[Relation]) -> type[Relation]:
    RELATIONS[cls.name] = cls
    return cls


def validate_invariant(inv: Invariant) -> None:
    check_choice("relation", inv.relation, RELATIONS)
    RELATIONS[inv.relation].validate(inv.params)


# -- inference helpers -----------------------------------------------------------------------
def learn_min_step(observations: list[list[tuple[int, bool]]], config: InferConfig) -> int | None:
    """The warm-up precondition: the smallest k such that the relation held on every observed
    step >= k of every reference; ``None`` when that leaves a reference without support, needs
    more than ``max_warmup`` of a run, or leaves fewer than ``min_support`` observations."""
    k = 0
    for obs in observations:
        for step, ok in obs:
            if not ok:
                k = max(k, step + 1)
    total = 0
    for obs in observations:
        if not obs:
            return None
        kept = sum(1 for step, _ in obs if step >= k)
        if kept == 0 or k > config.max_warmup * max(step for step, _ in obs):
            return None
        total += kept
    return k if total >= config.min_support else None


def as_number(value: Any) -> float | None:
    """A float for JSON numbers (and the "nan"/"inf" strings traces store), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def decays_to_zero(name: str) -> bool:
    """Learning rates: schedules legitimately end at (almost) 0, so only an upper bound holds."""
    return name == "lr" or name.endswith(("_lr", ".lr", "learning_rate"))


def widen(lo: float, hi: float, margin: float, name: str = "") -> list[float]:
    """Bounds that admit clean runs the references did not show (see ``InferConfig.margin``)."""
    if lo >= 0 and decays_to_zero(name):
        return [0.0, hi * margin]
    if lo > 0:
        return [lo / margin, hi * margin]
    if hi < 0:
        return [lo * margin, hi / margin]
    span = (hi - lo) * (margin - 1)
    return [lo - span, hi + span]


def check_bounds(name: str, bounds: Any) -> None:
    """``bounds`` of relation ``name`` are two numbers, low <= high; else ValueError naming them."""
    if len(bounds) != 2 or any(as_number(x) is None for x in bounds) or not bounds[0] <= bounds[1]:
        raise ValueError(f"{name}: bounds {bounds!r} must be two numbers, low <= high")


def in_bounds(value: float, bounds: list[float]) -> bool:
    """False for NaN and ±inf as well as for values outside [lo, hi]."""
    return math.isfinite(value) and bounds[0] <= value <= bounds[1]
