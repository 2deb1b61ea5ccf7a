"""Causal: a sequence model's outputs at positions < t do not depend on its inputs at positions >= t.

Judged on the causality probe the recorder runs every ``TraceConfig.causal_probe`` steps (see
``probe``): the leak ratio ``causal_leak`` of a training forward on token ids, i.e. how much
the outputs before a cut t changed when the tokens from t on were replaced, relative to how
much the outputs from t on changed.  Learned only when every reference was probed and never
leaked (every ratio <= ``LEAK_TOL``): an autoregressive model gets the relation, a model that
looks both ways (a bidirectional encoder, a model that pools over the sequence) does not, so it
raises nothing.  Breaks under any causal-mask bug: a mask of ones, a mask off by one diagonal, a
mask applied along the wrong axis, anything that lets a position see later tokens; the loss of
such a run looks normal (better, even), and no fact of the loop changes.
"""

from __future__ import annotations

import math

from sdcscope.invariants.relations.base import (
    Check,
    InferConfig,
    Relation,
    View,
    as_number,
    register,
)
from sdcscope.invariants.spec import Invariant, Precondition

LEAK_TOL = 1e-3
"""The largest leak ratio of a causal model.  Its outputs before the cut are computed from the
same tokens, by the same kernels, in the same forward as the unchanged row's, so the ratio is
exactly 0 (the references' always are); what could make it nonzero without a leak is a
reduction order that differs between rows: a few ulps of the outputs, ~1e-6 of the change from
the cut on in float32.  A leak moves the outputs before the cut by the attention weight given to
the replaced tokens: ~1/2 at cut 1 under a mask of ones or off by one diagonal (position 0 then
sees 2 tokens), ~1e-1 in the benchmark's GPT.  1e-3 sits orders of magnitude from both."""
CHECK_EVERY = 50
"""Steps between two probes while checking (the invariant's ``every``; references are probed
every ``TraceConfig.causal_probe`` steps).  A causal-mask bug is in the model from its first
step, which is always probed; later probes catch a mask that changes mid-run (a corrupted mask
buffer).  Probing every 50 steps keeps its cost small (``benchmarks/bench_invariants_overhead.py``)."""


def _observations(trace) -> list[tuple[int, float]]:
    """(step, leak ratio) of every probed training forward; NaN (a model with non-finite
    outputs: no verdict on causality) left out."""
    out = []
    for r in trace.phase("train"):
        for api, fields in r["calls"]:
            x = as_number(fields.get("causal_leak")) if api == "forward" else None
            if x is not None and not math.isnan(x):
                out.append((r["step"], x))
    return out


@register
class Causal(Relation):
    name = "Causal"
    required = {"tolerance": (int, float)}
    optional = {"every": int}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        tol = params["tolerance"]
        if not (math.isfinite(tol) and 0 < tol < 1):
            raise ValueError(f"Causal: tolerance={tol!r} must be a number in (0, 1)")
        if params.get("every", 1) < 1:
            raise ValueError(f"Causal: every={params['every']!r} must be >= 1 (steps between two probes)")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        per = [_observations(t) for t in traces]
        ratios = [x for obs in per for _, x in obs]
        if not all(per) or len(ratios) < config.min_support or not max(ratios) <= LEAK_TOL:
            return []
        return [
            Invariant(
                id="causal.train.forward",
                relation=cls.name,
                params={"tolerance": LEAK_TOL, "every": CHECK_EVERY},
                precondition=Precondition(phase="train", when=("forward",)),
                description="a training forward on token ids is causal: its outputs at positions < t "
                f"do not change when its tokens from t on are replaced (leak ratio <= {LEAK_TOL:g})",
                support=len(ratios),
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _CausalCheck(inv, header)


class _CausalCheck(Check):
    def __init__(self, inv: Invariant, header) -> None:
        super().__init__(inv)
        self.tol, self.every = inv.params["tolerance"], inv.params.get("every", CHECK_EVERY)
        self.module = header.get("model", "model")

    def needs(self):
        return {"causal_probe": self.every}

    def check(self, view: View):
        for fields in view.fields.get("forward", ()):
            leak = as_number(fields.get("causal_leak"))
            if leak is not None and leak > self.tol:  # NaN: no verdict; inf: a leak
                cut, pos, n = fields.get("causal_cut"), fields.get("causal_pos"), fields.get("causal_len")
                last = n - 1 if isinstance(n, int) else "?"
                return [
                    (
                        self.module,
                        {
                            "leak_ratio": leak,
                            "tolerance": self.tol,
                            "cut": cut,
                            "position": pos,
                            "seq_len": n,
                            "meaning": f"replacing the tokens at positions {cut}..{last} changed the output at "
                            f"position {pos} by {leak:.3g} x the largest change at positions >= {cut}",
                        },
                    )
                ]
        return []
