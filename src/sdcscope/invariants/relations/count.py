"""APICount and APICountRatio: how many times the APIs run in a training step (or an evaluation).

Catches what the order of first calls cannot show: ``optimizer.step`` or ``backward`` called
twice in a step, ``zero_grad`` inside a gradient-accumulation loop (more calls than micro-batch
boundaries allow), a scheduler stepped per micro-batch.  Both are learned per phase over the
records in which the APIs ran at all (absence is ``APISequence``'s business, and a step the
scaler skipped is no evidence); the calls a replay of the step superseded are not counted (see
``View.replays``).

- ``APICount``: the number of calls of an API that runs once per step, or a fixed number of
  times.  Kept only if every reference shows the same set of counts: one count in most loops, a
  set where a loop varies by design in every run (the last, partial accumulation of an epoch),
  and nothing where the count depends on the data or the run length.
- ``APICountRatio``: how the calls of the per-micro-batch APIs (``spec.MICRO_BATCH_APIS``)
  relate: as many backward passes as forward passes.  How *many* micro-batches a step (or an
  evaluation) has is a setting (gradient accumulation, the size of the evaluation set), so
  their counts are not learned: a run with another accumulation is no bug, a backward run twice
  per micro-batch is.  The ratio is an upper bound: *fewer* backward passes than forwards is a
  style (one backward over the summed losses of the micro-batches, a forward outside the loss
  such as a metric computed within the step); a backward that leaves some micro-batches' losses
  out shows in the loss it starts from (``InitialLoss``).
"""

from __future__ import annotations

import math
from collections import defaultdict

from sdcscope.common.validate import check_choice
from sdcscope.invariants.relations.base import Check, InferConfig, Relation, View, register
from sdcscope.invariants.spec import APIS, MICRO_BATCH_APIS, PHASES, Invariant, Precondition

PER = {"train": "training step", "eval": "evaluation"}
RATIO_BASE = MICRO_BATCH_APIS[0]
"""The other per-micro-batch APIs are related to the forward passes."""


@register
class APICount(Relation):
    name = "APICount"
    required = {"api": str, "counts": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_choice("APICount api", params["api"], APIS)
        counts = params["counts"]
        if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
            raise ValueError(f"APICount: counts {counts!r} must be a non-empty list of integers >= 1")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        out = []
        for phase in PHASES:
            per: dict[str, list[list[int]]] = defaultdict(lambda: [[] for _ in traces])
            for ti, t in enumerate(traces):
                for r in t.phase(phase):
                    for api, n in View(r).counts().items():
                        per[api][ti].append(n)
            for api in (a for a in APIS if a in per and a not in MICRO_BATCH_APIS):
                series = per[api]
                sets = [set(s) for s in series]
                support = sum(map(len, series))
                if not all(series) or any(s != sets[0] for s in sets) or support < config.min_support:
                    continue
                counts = sorted(sets[0])
                out.append(
                    Invariant(
                        id=f"count.{phase}.{api}",
                        relation=cls.name,
                        params={"api": api, "counts": counts},
                        precondition=Precondition(phase=phase, when=(api,)),
                        description=f"{api} runs {' or '.join(map(str, counts))} time(s) in each "
                        f"{PER[phase]} that runs it",
                        support=support,
                    )
                )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _CountCheck(inv)


class _CountCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        self.api, self.counts = inv.params["api"], inv.params["counts"]

    def needs(self):
        return {"input_fingerprint": True}  # tells a replay of the step from extra calls

    def check(self, view: View):
        n = view.counts()[self.api]
        if n == 0 or n in self.counts:  # 0: only superseded calls ran it
            return []
        return [(self.api, {"api": self.api, "expected": self.counts, "observed": n})]


@register
class APICountRatio(Relation):
    name = "APICountRatio"
    required = {"api": str, "per": str, "ratio": (int, float)}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        for key in ("api", "per"):
            check_choice(f"APICountRatio {key}", params[key], APIS)
        if not params["ratio"] > 0:
            raise ValueError(f"APICountRatio: ratio {params['ratio']!r} must be > 0")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        per = RATIO_BASE
        ratios: dict[str, list[set[float]]] = defaultdict(lambda: [set() for _ in traces])
        support: dict[str, int] = defaultdict(int)
        for ti, t in enumerate(traces):
            for r in t.phase("train"):
                counts = View(r).counts()
                for api in MICRO_BATCH_APIS:
                    if api != per and counts[api] and counts[per]:
                        ratios[api][ti].add(counts[api] / counts[per])
                        support[api] += 1
        out = []
        for api in (a for a in MICRO_BATCH_APIS if a in ratios):
            sets = ratios[api]
            if not all(sets) or len(set.union(*sets)) != 1 or support[api] < config.min_support:
                continue
            (ratio,) = sets[0]
            out.append(
                Invariant(
                    id=f"count.train.{api}.per.{per}",
                    relation=cls.name,
                    params={"api": api, "per": per, "ratio": ratio},
                    precondition=Precondition(phase="train", when=(api, per)),
                    description=f"{api} runs at most {ratio:g} time(s) per {per} in each training step",
                    support=support[api],
                )
            )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _RatioCheck(inv)


class _RatioCheck(Check):
    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        self.api, self.per, self.ratio = inv.params["api"], inv.params["per"], inv.params["ratio"]

    def needs(self):
        return {"input_fingerprint": True}  # tells a replay of the step from extra calls

    def check(self, view: View):
        counts = view.counts()
        n, m = counts[self.api], counts[self.per]
        # 0: only superseded calls ran it; fewer calls than the ratio allows: see the module doc
        if not n or not m or n < self.ratio * m or math.isclose(n, self.ratio * m):
            return []
        return [
            (
                self.api,
                {
                    "api": self.api,
                    "per": self.per,
                    "expected_ratio": self.ratio,
                    "observed": {self.api: n, self.per: m},
                },
            )
        ]
