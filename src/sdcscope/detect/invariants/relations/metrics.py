"""MetricBound: a logged training metric stays finite and within learned bounds.

Metrics come from ``log_metrics`` (the engine adapter passes the step's metrics: loss,
grad_norm, lr, and whatever the observe room adds).  Counters that grow every step in every
reference (step, tokens seen, data position) are skipped: bounds on them would only say how
long the reference runs were.
"""

from __future__ import annotations

from collections import defaultdict

from sdcscope.detect.invariants.relations.base import (
    APPLIED, Check, InferConfig, Relation, View, as_number, in_bounds, register, widen,
)
from sdcscope.detect.invariants.spec import PHASES, Invariant, Precondition


def _counter(series: list[float]) -> bool:
    return len(series) >= 3 and all(a < b for a, b in zip(series, series[1:]))


@register
class MetricBound(Relation):
    name = "MetricBound"
    required = {"metric": str, "bounds": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        b = params["bounds"]
        if len(b) != 2 or any(as_number(x) is None for x in b) or not b[0] <= b[1]:
            raise ValueError(f"MetricBound: bounds {b!r} must be two numbers, low <= high")

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
                if (not all(series) or len(values) < config.min_support or None in values
                        or any(v != v or abs(v) == float("inf") for v in values)
                        or all(_counter(s) for s in series)):
                    continue
                bounds = widen(min(values), max(values), config.margin, key)
                out.append(Invariant(
                    id=f"metric.{phase}.{key}", relation=cls.name,
                    params={"metric": key, "bounds": bounds},
                    precondition=Precondition(phase=phase, when=APPLIED if phase == "train" else ()),
                    description=f"the {'training' if phase == 'train' else 'evaluation'} metric "
                                f"{key} stays finite within [{bounds[0]:.4g}, {bounds[1]:.4g}]",
                    support=len(values)))
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
