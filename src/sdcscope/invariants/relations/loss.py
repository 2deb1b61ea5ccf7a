"""InitialLoss and LossTrend: what the training loss is before any update, and that it goes down.

Both judge the **step loss**: the losses of the step's micro-batches added up, i.e. the losses
the backward passes start from (the unscaled losses given to ``GradScaler.scale`` where a
scaler is used; the calls a replay superseded are not counted, see ``View.replays``).  For a
loop that averages correctly over its micro-batches (each loss divided by their number, or one
backward over their mean), that is the mean loss of the step however many micro-batches it
has, so a run with another gradient accumulation than the references is no violation.

- ``InitialLoss``: the step loss of the run's first step (before any update: it depends on the
  model's initialization and the loss, not on the seed, the learning rate or the schedule; the
  "verify the loss at init" check) stays within a factor ``INIT_MARGIN`` of the references'.
  Breaks when micro-batch losses are added up instead of averaged (N x), a backward leaves
  micro-batches out (1/N x), a loss is scaled or reduced differently.  Learned only when at
  least two references start at the same step with positive losses that agree within
  ``AGREE``: one observation per run, so the agreement of independent runs is the evidence.
  A resumed run (see ``resumed``) is not judged: its first loss is a trained model's.
- ``LossTrend``: from a learned step on, the step loss averaged over the last ``window`` steps
  is lower than over the run's first ``window`` steps, as it was in every reference, and by at
  least half as much as the slowest reference improved it (``max_ratio``: the recent / first
  ratio stays below ``1 - TREND_SLACK x (1 - worst reference ratio)``).  Progress scales with
  the learning rate in effect: a window is judged only once the learning rates of the run's
  steps before it add up to as much as they did in the slowest reference at that step
  (``from_lr_sum``), so a lower learning rate or a longer warm-up is judged later, at the
  same progress, and a higher one no earlier than the references' step.  Breaks when training
  makes no progress or makes the model worse at a normal-looking loss: labels that do not
  belong to their inputs, gradient ascent, updates that never reach the weights.  Only the first
  window is the baseline (not the best one), so noise and a late plateau are no violation; losses
  that are not positive are not judged (the ratio needs a positive baseline).

  A resumed run (see ``resumed``) starts on the plateau its checkpoint reached, so its own first
  window is no baseline: it is judged against where training starts, the lowest first-window mean
  of the references (``first_mean``), once the run has made since the resume the progress (summed
  learning rates) the slowest reference needed.  A correct resume is far below it; a resumed run
  whose loss is back where training starts -- the model restarted from an untrained state, or
  labels that no longer belong to their inputs -- is flagged.  Without ``first_mean`` (files
  written before it), a resumed run is not judged.

A run is **resumed** when its first step is not the references' first step (a run resumed by the
engine continues its step numbers), or when the optimizer held state at the run's first update
(the recorder's ``resumed`` mark: a new process that counts steps from 0 again, a traced script).
"""

from __future__ import annotations

import math
from collections import deque

from sdcscope.invariants.relations.base import (
    Check,
    InferConfig,
    Relation,
    View,
    as_number,
    check_bounds,
    learn_min_step,
    register,
)
from sdcscope.invariants.spec import Invariant, Precondition

INIT_MARGIN = 1.5
"""Bounds of the initial loss: [lo / INIT_MARGIN, hi x INIT_MARGIN] of the references'.  The
mistakes it exists for are off by the number of micro-batches (2x and more) or far more."""
AGREE = 1.2
"""References' initial losses must agree within this factor for ``InitialLoss`` to be learned."""
WINDOW = 4
"""Steps averaged by ``LossTrend`` (per-batch losses are noisy)."""
TREND_SLACK = 0.5
"""A checked run must improve its loss at least this fraction as much as the slowest reference
did (another learning rate or seed learns slower; a run that does not learn improves ~0)."""


def step_loss(view: View) -> float | None:
    """The step's losses added up (see the module doc); None when no call recorded one."""
    superseded = view.replays()[1]
    for api in ("scaler.scale", "backward"):
        values = [
            as_number(f.get("loss")) for i, (a, f) in enumerate(view.rec["calls"]) if a == api and i not in superseded
        ]
        values = [v for v in values if v is not None]
        if values:
            return sum(values)
    return None


def resumed(view: View, start: int) -> bool:
    """Whether the run whose first record is ``view`` continues one that trained before it (see
    the module doc): it starts at another step than ``start``, or the recorder marked it."""
    return view.step != start or bool(view.rec.get("resumed"))


def step_lr(view: View) -> float:
    """The first param group's learning rate at the record's ``optimizer.step`` (0 without one:
    a step a GradScaler skipped moves nothing)."""
    calls = view.fields.get("optimizer.step")
    x = as_number(calls[0].get("lr")) if calls else None
    return x if x is not None and math.isfinite(x) and x > 0 else 0.0


def _series(trace) -> list[tuple[int, float]]:
    return [(step, x) for step, x, _ in _lr_series(trace)]


def _lr_series(trace) -> list[tuple[int, float, float]]:
    """(step, step loss, learning rate summed over the steps before it) per step with a loss."""
    out, tau = [], 0.0
    for r in trace.phase("train"):
        view = View(r)
        x = step_loss(view)
        if x is not None:
            out.append((r["step"], x, tau))
        tau += step_lr(view)
    return out


@register
class InitialLoss(Relation):
    name = "InitialLoss"
    required = {"step": int, "bounds": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_bounds("InitialLoss", params["bounds"])

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        firsts = [s[0] if (s := _series(t)) else None for t in traces]
        if len(traces) < 2 or None in firsts or len({step for step, _ in firsts}) != 1:
            return []
        values = [x for _, x in firsts]
        lo, hi = min(values), max(values)
        if not (math.isfinite(hi) and lo > 0 and hi <= lo * AGREE):
            return []
        step, bounds = firsts[0][0], [lo / INIT_MARGIN, hi * INIT_MARGIN]
        return [
            Invariant(
                id="loss.train.initial",
                relation=cls.name,
                params={"step": step, "bounds": bounds},
                precondition=Precondition(phase="train", when=("backward",)),
                description=f"the loss of the run's first step ({step}, before any update) is within "
                f"[{bounds[0]:.4g}, {bounds[1]:.4g}] (micro-batch losses added up)",
                support=len(values),
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _InitialCheck(inv)


class _InitialCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        self.step, self.bounds = inv.params["step"], inv.params["bounds"]
        self.done = False

    def check(self, view: View):
        x = step_loss(view)
        if self.done or x is None:
            return []
        self.done = True  # the run's first step with a loss, judged only if it starts training
        if resumed(view, self.step) or math.isfinite(x) and self.bounds[0] <= x <= self.bounds[1]:
            return []
        return [("loss", {"step_loss": x, "bounds": self.bounds})]


@register
class LossTrend(Relation):
    name = "LossTrend"
    required = {"start": int, "window": int, "from_step": int, "max_ratio": (int, float)}
    optional = {"from_lr_sum": (int, float), "first_mean": (int, float)}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        if params["window"] < 1 or params["from_step"] < 0 or not 0 < params["max_ratio"] <= 1:
            raise ValueError(f"LossTrend: window must be >= 1, from_step >= 0 and max_ratio in (0, 1], not {params!r}")
        if "first_mean" in params and not (math.isfinite(params["first_mean"]) and params["first_mean"] > 0):
            raise ValueError(f"LossTrend: first_mean={params['first_mean']!r} must be a positive number")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        series = [_lr_series(t) for t in traces]
        if not all(len(s) >= 2 * WINDOW for s in series) or len({s[0][0] for s in series}) != 1:
            return []
        ratios, bases = [], []  # per reference: (step, lr sum before the window, recent / first window mean)
        for s in series:
            losses = [x for _, x, _ in s]
            base = sum(losses[:WINDOW]) / WINDOW
            if not all(map(math.isfinite, losses)) or not base > 0:
                return []
            bases.append(base)
            ratios.append(
                [
                    (s[i][0], s[i - WINDOW + 1][2], sum(losses[i - WINDOW + 1 : i + 1]) / WINDOW / base)
                    for i in range(2 * WINDOW - 1, len(s))
                ]
            )
        k = learn_min_step([[(step, r < 1) for step, _, r in rs] for rs in ratios], config)
        if k is None:
            return []
        worst = max(r for rs in ratios for step, _, r in rs if step >= k)
        tau = min(next(t for step, t, _ in rs if step >= k) for rs in ratios)  # the slowest reference's
        bound = 1 - TREND_SLACK * (1 - worst)
        start = series[0][0][0]
        return [
            Invariant(
                id="trend.train.loss",
                relation=cls.name,
                params={
                    "start": start,
                    "window": WINDOW,
                    "from_step": k,
                    "max_ratio": bound,
                    "from_lr_sum": tau,
                    "first_mean": min(bases),
                },
                precondition=Precondition(phase="train", when=("backward",)),
                description=f"from step {k} on, once the learning rates summed over the steps reach {tau:.4g}, "
                f"the training loss averaged over {WINDOW} steps is below {bound:.4g} x its average over the "
                f"run's first {WINDOW} steps (a resumed run: below {bound:.4g} x {min(bases):.4g}, the "
                "references' lowest first-window average, once it made that progress since the resume)",
                support=sum(1 for rs in ratios for step, _, _ in rs if step >= k),
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _TrendCheck(inv)


class _TrendCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        p = inv.params
        self.start, self.window, self.from_step = p["start"], p["window"], p["from_step"]
        self.max_ratio, self.from_tau = p["max_ratio"], p.get("from_lr_sum", 0.0)
        self.fresh_start = p.get("first_mean")  # the baseline of a resumed run
        self.first: list[float] = []  # the run's first window: the baseline
        self.recent: deque[float] = deque(maxlen=self.window)
        self.taus: deque[float] = deque(maxlen=self.window)  # the lr sum before each step of the window
        self.tau = 0.0  # summed from the run's (or the resume's) first step
        self.n = 0
        self.resumed = False
        self.judged = True  # False: a resumed run, and no first_mean to judge it against

    def check(self, view: View):
        x = step_loss(view)
        if not self.judged:
            return []
        if x is None:
            self.tau += step_lr(view)
            return []
        if not self.n and resumed(view, self.start):
            self.resumed, self.judged = True, self.fresh_start is not None
            if not self.judged:
                return []
        self.n += 1
        if len(self.first) < self.window:
            self.first.append(x)
        self.recent.append(x)
        self.taus.append(self.tau)
        self.tau += step_lr(view)
        w = self.window
        # A fresh run needs its first window and a recent one; a resumed run only a recent one.
        if self.n < (w if self.resumed else 2 * w) or view.step < self.from_step or self.taus[0] < self.from_tau:
            return []
        base = self.fresh_start if self.resumed else sum(self.first) / w
        recent = sum(self.recent) / w
        if not base > 0 or recent < base * self.max_ratio:  # NaN compares False: no improvement
            return []
        return [
            (
                "loss",
                {
                    "recent_mean": recent,
                    "first_mean": base,
                    "ratio": recent / base,
                    "max_ratio": self.max_ratio,
                    "window": w,
                    "from_step": self.from_step,
                    "resumed": self.resumed,
                },
            )
        ]
