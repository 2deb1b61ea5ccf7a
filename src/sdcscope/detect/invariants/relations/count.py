"""APICount: how many times each API runs in a training step (or an evaluation), when it runs.

Catches what the order of first calls cannot show: ``optimizer.step`` or ``backward`` called
twice in a step, ``zero_grad`` inside a gradient-accumulation loop (more calls than micro-batch
boundaries allow), a scheduler stepped per micro-batch.  Learned per phase over the records in
which the API ran at all (its absence is ``APISequence``'s business, and a step the scaler
skipped is no evidence); the calls a replay of the step superseded are not counted (see
``View.replays``).  The counts are kept only if every reference shows the same set of them:
one count in most loops, a set where a loop varies by design in every run (the last, partial
accumulation of an epoch), and nothing where the count depends on the data or the run length.
"""

from __future__ import annotations

from collections import defaultdict

from sdcscope._validate import check_choice
from sdcscope.detect.invariants.relations.base import Check, InferConfig, Relation, View, register
from sdcscope.detect.invariants.spec import APIS, PHASES, Invariant, Precondition

PER = {"train": "training step", "eval": "evaluation"}


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
            for api in (a for a in APIS if a in per):
                series = per[api]
                sets = [set(s) for s in series]
                support = sum(map(len, series))
                if not all(series) or any(s != sets[0] for s in sets) or support < config.min_support:
                    continue
                counts = sorted(sets[0])
                out.append(Invariant(
                    id=f"count.{phase}.{api}", relation=cls.name, params={"api": api, "counts": counts},
                    precondition=Precondition(phase=phase, when=(api,)),
                    description=f"{api} runs {' or '.join(map(str, counts))} time(s) in each "
                                f"{PER[phase]} that runs it",
                    support=support))
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
