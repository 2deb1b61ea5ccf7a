"""MetricBound and MetricTrend: logged metrics stay within learned bounds, and training improves them.

Metrics come from ``log_metrics`` (the engine adapter passes the step's metrics: loss,
grad_norm, lr, and whatever the observe room adds).

- ``MetricBound``: a metric stays finite and within learned bounds.  Counters that grow every
  step in every reference (step, tokens seen, data position) are skipped: bounds on them would
  only say how long the reference runs were.
- ``MetricTrend``: an evaluation metric that every evaluation of every reference found better
  than the run's first evaluation (a validation loss lower, an accuracy higher) is never found
  worse than it.  Breaks when training makes the model worse: gradient ascent
  (``maximize=True``, a loss with its sign flipped), targets that teach nothing.  Only the first
  evaluation is the baseline, not the best one, so the noise and the overfitting of a late
  evaluation are no violation; it takes ``MIN_EVALS`` evaluations in every reference, and
  training metrics (noisy per batch) are not judged.
"""

from __future__ import annotations

import math
from collections import defaultdict

from sdcscope.common.validate import check_choice
from sdcscope.invariants.relations.base import (
    APPLIED,
    Check,
    InferConfig,
    Relation,
    View,
    as_number,
    check_bounds,
    in_bounds,
    register,
    widen,
)
from sdcscope.invariants.spec import PHASES, Invariant, Precondition

MIN_EVALS = 3
"""Evaluations each reference needs for a trend: one baseline, and at least two that beat it."""
SIGN = {"down": -1.0, "up": 1.0}


def _counter(series: list[float]) -> bool:
    return len(series) >= 3 and all(a < b for a, b in zip(series, series[1:]))


@register
class MetricBound(Relation):
    name = "MetricBound"
    required = {"metric": str, "bounds": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_bounds("MetricBound", params["bounds"])

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        out = []
        for phase in PHASES:
            per: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in traces])
            for ti, t in enumerate(traces):
                for r in t.phase(phase):
                    for key, v in r["metrics"].items():
                        per[key][ti].append(as_number(v))
            for key, series in sorted(per.items()):
                values = [v for s in series for v in s]
                if (
                    not all(series)
                    or len(values) < config.min_support
                    or None in values
                    or any(v != v or abs(v) == float("inf") for v in values)
                    or all(_counter(s) for s in series)
                ):
                    continue
                bounds = widen(min(values), max(values), config.margin, key)
                out.append(
                    Invariant(
                        id=f"metric.{phase}.{key}",
                        relation=cls.name,
                        params={"metric": key, "bounds": bounds},
                        precondition=Precondition(phase=phase, when=APPLIED if phase == "train" else ()),
                        description=f"the {'training' if phase == 'train' else 'evaluation'} metric "
                        f"{key} stays finite within [{bounds[0]:.4g}, {bounds[1]:.4g}]",
                        support=len(values),
                    )
                )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _BoundCheck(inv)


class _BoundCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        self.metric, self.bounds = inv.params["metric"], inv.params["bounds"]

    def check(self, view: View):
        v = view.rec["metrics"].get(self.metric)
        if v is None:
            return []
        x = as_number(v)
        if x is not None and in_bounds(x, self.bounds):
            return []
        return [(self.metric, {"metric": self.metric, "value": v, "bounds": self.bounds})]


def _trend(series: list[float]) -> str | None:
    """``down`` (``up``) when every value after the first is below (above) the first."""
    for direction, sign in SIGN.items():
        if all((v - series[0]) * sign > 0 for v in series[1:]):
            return direction
    return None


@register
class MetricTrend(Relation):
    name = "MetricTrend"
    required = {"metric": str, "direction": str}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_choice("MetricTrend direction", params["direction"], SIGN)

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        per: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in traces])
        for ti, t in enumerate(traces):
            for r in t.phase("eval"):
                for key, v in r["metrics"].items():
                    x = as_number(v)
                    if x is not None and math.isfinite(x):
                        per[key][ti].append(x)
        out = []
        for key, series in sorted(per.items()):
            trends = {_trend(s) if len(s) >= MIN_EVALS else None for s in series}
            if len(trends) != 1 or None in trends:
                continue
            (direction,) = trends
            out.append(
                Invariant(
                    id=f"trend.eval.{key}",
                    relation=cls.name,
                    params={"metric": key, "direction": direction},
                    precondition=Precondition(phase="eval"),
                    description=f"every evaluation finds {key} {'lower' if direction == 'down' else 'higher'} "
                    "than the run's first evaluation did",
                    support=sum(map(len, series)),
                )
            )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _TrendCheck(inv)


class _TrendCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        self.metric, self.sign = inv.params["metric"], SIGN[inv.params["direction"]]
        self.first: tuple[int, float] | None = None  # the run's first evaluation: step, value

    def check(self, view: View):
        x = as_number(view.rec["metrics"].get(self.metric))
        if x is None or not math.isfinite(x):  # non-finite values are MetricBound's
            return []
        if self.first is None:
            self.first = view.step, x
            return []
        step, first = self.first
        if (x - first) * self.sign < 0:
            return [
                (
                    self.metric,
                    {
                        "metric": self.metric,
                        "value": x,
                        "first_value": first,
                        "first_step": step,
                        "direction": self.inv.params["direction"],
                    },
                )
            ]
        return []
