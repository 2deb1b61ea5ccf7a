"""APISequence: the training-step APIs that always run, always run in the same order.

Catches a missing ``zero_grad``, a scheduler that is never stepped, a scaler that is bypassed,
clipping moved after ``optimizer.step``, ``zero_grad`` moved between backward and step.
``forward`` is left out on purpose: "forward before backward" is enforced by autograd itself,
and whether ``zero_grad`` comes before or after the forward is a matter of style, not
correctness, so including it would only overfit the references (TrainCheck's main noise source).

Two more matters of style are not held against a loop:

- where the step begins: a training loop is a cycle, and a loop that clears the gradients at
  the end of the step (after ``optimizer.step``) runs the same cycle as one that clears them
  first, so the order is compared cyclically (``zero_grad`` between backward and step is still
  out of order);
- how the gradients are cleared: a step without ``zero_grad`` whose every gradient was cleared
  anyway (``p.grad = None`` by hand) is complete.  On a run's first step every gradient counts
  as cleared (there is nothing before it), so a missing ``zero_grad`` shows from the second;
- whether the run clips its gradients (``spec.OPTIONAL``): a run that never clips is complete.
  The run's first checked step says whether it clips; a run that clips on some steps only is
  reported at the first step that breaks the pattern (clipping begun late, or dropped).
"""

from __future__ import annotations

from sdcscope.common.validate import check_choice
from sdcscope.invariants.names import from_hex
from sdcscope.invariants.relations.base import (
    Check,
    InferConfig,
    Relation,
    View,
    learn_min_step,
    register,
)
from sdcscope.invariants.spec import APIS, OPTIONAL, SKIPPABLE, Invariant, Precondition

EXCLUDED = frozenset({"forward"})
CLEARING = "zero_grad"


def _expected(apis: list[str], view: View, everything: int) -> list[str]:
    """The APIs this record must show: all, less those legitimately skipped (see SKIPPABLE),
    less ``zero_grad`` when every parameter's gradient was cleared without it (``everything``:
    the mask of all parameters)."""
    first = view.first
    cleared = view.rec["effects"]["cleared"]
    by_hand = CLEARING not in first and cleared is not None and from_hex(cleared) == everything
    return [a for a in apis if (a in first or SKIPPABLE.get(a) not in first) and not (by_hand and a == CLEARING)]


def _cyclic(pos: list[int]) -> bool:
    """Positions that increase but for one wrap-around: a rotation of the expected order."""
    return sum(a > b for a, b in zip(pos, pos[1:] + pos[:1])) <= 1


def _in_order(apis: list[str], view: View, everything: int) -> bool:
    pos = [view.first.get(a) for a in _expected(apis, view, everything)]
    return None not in pos and _cyclic(pos)


def _everything(header: dict) -> int:
    return (1 << len(header["params"])) - 1


@register
class APISequence(Relation):
    name = "APISequence"
    required = {"apis": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        apis = params["apis"]
        if len(apis) < 2 or len(set(apis)) != len(apis):
            raise ValueError(f"APISequence: apis {apis!r} must name at least 2 distinct APIs")
        for api in apis:
            check_choice("APISequence api", api, APIS)

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        per_trace = [t.phase("train") for t in traces]
        if not all(per_trace):
            return []
        common: set[str] | None = None
        for recs in per_trace:
            median = recs[len(recs) // 2]["step"]
            for r in recs:
                if r["step"] >= median:
                    seen = {c[0] for c in r["calls"]} - EXCLUDED
                    seen |= {a for a, guard in SKIPPABLE.items() if guard in seen}
                    common = seen if common is None else common & seen
        if not common or len(common) < 2:
            return []
        firsts = (View(r).first for r in reversed(per_trace[0]))
        template = next((f for f in firsts if common <= set(f)), None)
        if template is None:
            return []
        apis = sorted(common, key=template.__getitem__)
        obs = [
            [(r["step"], _in_order(apis, View(r), _everything(t.header))) for r in recs]
            for t, recs in zip(traces, per_trace)
        ]
        k = learn_min_step(obs, config)
        if k is None:
            return []
        return [
            Invariant(
                id="sequence.train",
                relation=cls.name,
                params={"apis": apis},
                precondition=Precondition(phase="train", min_step=k),
                description=f"every training step calls {', '.join(apis)}, in this order (or a "
                "rotation of it: where the step begins is the loop's choice)",
                support=sum(1 for o in obs for s, _ in o if s >= k),
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _SequenceCheck(inv, _everything(header))


class _SequenceCheck(Check):
    def __init__(self, inv: Invariant, everything: int) -> None:
        super().__init__(inv)
        self.apis = list(inv.params["apis"])
        self.everything = everything
        self.optional: dict[str, int | None] = {}  # optional API -> None: the run calls it; else
        # the first step it did not (the run does without it)

    def check(self, view: View):
        first = view.first
        apis = _expected(self.apis, view, self.everything)
        for api in OPTIONAL.intersection(apis):
            without = self.optional.setdefault(api, None if api in first else view.step)
            if without is not None and api in first:  # a run without it calls it after all
                self.optional[api] = None
                meaning = f"{api} runs at step {view.step} but did not from step {without}: on some steps only"
                return [(api, {"absent_since": without, "expected": self.apis, "meaning": meaning})]
        apis = [a for a in apis if self.optional.get(a) is None]
        missing = [a for a in apis if a not in first]
        if missing:
            return [
                (missing[0], {"missing": missing, "expected": self.apis, "observed": [c[0] for c in view.rec["calls"]]})
            ]
        if _cyclic([first[a] for a in apis]):
            return []
        observed = sorted(apis, key=first.__getitem__)
        start = apis.index(observed[0])  # the expected order, begun where this step began
        culprit = next(a for a, b in zip(observed, apis[start:] + apis[:start]) if a != b)
        return [(culprit, {"expected": self.apis, "observed": observed})]
