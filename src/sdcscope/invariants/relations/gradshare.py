"""GradShare: how a step's gradient is spread over the parameters (gradient flow).

Judged on the per-parameter gradient norms the recorder takes when ``optimizer.step`` returns
(the gradients the update used: every micro-batch in, after clipping and a GradScaler's
unscaling; see ``TraceConfig.grad_norms``).  A parameter's **share** is ``‖g_p‖ / ‖g‖``, its
gradient's norm over the norm of all the step's gradients together.  A share is a ratio within
one step, so whatever scales every gradient alike changes none: the loss scale, a GradScaler,
clipping, the number of micro-batches averaged, the size of the gradients early in training
versus late.  What it follows is where the backward pass sends the loss's gradient: how much
reaches each layer.  That depends on the architecture, and far less on the seed, the learning
rate or the data order.

- Learned per parameter: the references' range of its share over every recorded step, widened
  by ``InferConfig.margin`` (``[lo / margin, min(1, hi x margin x PROGRESS)]``: see
  ``PROGRESS``).  Only parameters that got
  a gradient at every recorded step of every reference and whose share never fell below
  ``MIN_SHARE`` are bounded: a gradient at the level of rounding noise (the bias of attention
  keys, which the softmax makes exactly 0 in theory) says nothing about the flow.
- Violated when a parameter's share stays out of its bounds on ``PERSIST`` consecutive checked
  steps (a parameter that got a gradient in every reference step and gets none counts as share
  0).  A single step is not enough: a clean run's shares spike now and then (to ~9x outside the
  references' range on one step in the silent-bugs benchmark; three steps in a row, never more
  than 2.5x).

Breaks when gradient flow is broken while the forward, the loss and the update look normal: a
residual stream detached in every block (the layers below are reached only through the branches,
whose Jacobians are small: their share falls ~10x at the first step and 1e3-1e4x within a few), a
``.detach()`` in the middle of a model, a layer whose gradient is scaled wrongly (a loss term or a
hook multiplying one layer's gradient), a module whose output no longer reaches the loss.  A
gradient scaled by less than the margin is not seen; the bugs it exists for are off by far more.
"""

from __future__ import annotations

import math

from sdcscope.invariants.names import close_matches, from_hex, names_of
from sdcscope.invariants.relations.base import (
    APPLIED,
    Check,
    InferConfig,
    Relation,
    View,
    as_number,
    register,
)
from sdcscope.invariants.spec import Invariant, Precondition

MIN_SHARE = 1e-6
"""The smallest reference share a parameter may have to be bounded.  float32 rounding leaves a
gradient that is 0 in exact arithmetic at ~1e-11..1e-9 of the total; real shares of the
benchmark's models are 1e-6..1."""
PERSIST = 3
"""Consecutive checked steps a share must stay out of bounds for a violation."""
PROGRESS = 10
"""Extra widening of the upper bounds.  A share that starts near 0 (attention keys, whose
gradient is ~0 while attention is uniform) grows as training proceeds, and a run with a higher
learning rate or a larger batch gets further in as many steps than the references did; the
lower bounds need no such allowance (a slower run stays nearer its first steps, which the
references showed), and broken gradient flow shows there (1e3-1e4x below)."""


def shares(rec: dict, names: list[str]) -> dict[str, float] | None:
    """Each parameter's share of the record's gradient norm (0 for a parameter without a
    gradient); None when the record has no gradient norms, or their total is 0 or not finite
    (no gradient at all is another relation's business, a non-finite one ``MetricBound``'s)."""
    entry = rec.get("grad_norms")
    if not entry:
        return None
    norms = [as_number(x) for x in entry["norms"]]
    if None in norms:
        return None
    total = math.sqrt(sum(x * x for x in norms))
    if not (math.isfinite(total) and total > 0):
        return None
    out = dict.fromkeys(names, 0.0)
    out.update(zip(names_of(from_hex(entry["params"]), names), (x / total for x in norms)))
    return out


@register
class GradShare(Relation):
    name = "GradShare"
    required = {"shares": dict}
    optional = {"persist": int}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        bounds = params["shares"]
        if not bounds:
            raise ValueError("GradShare: shares must name at least one parameter")
        for key, b in bounds.items():
            if (
                not isinstance(key, str)
                or not isinstance(b, list)
                or len(b) != 2
                or any(as_number(x) is None for x in b)
                or not 0 <= b[0] <= b[1]
            ):
                raise ValueError(f"GradShare: shares[{key!r}] = {b!r} must be two numbers, 0 <= low <= high")
        if params.get("persist", PERSIST) < 1:
            raise ValueError(f"GradShare: persist={params['persist']!r} must be >= 1 (consecutive steps)")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        names = traces[0].header["params"]
        if len(names) < 2 or any(t.header["params"] != names for t in traces):
            return []  # one parameter has all the gradient; other models: nothing in common
        per = [[s for r in t.phase("train") if (s := shares(r, names)) is not None] for t in traces]
        n = sum(map(len, per))
        if not all(per) or n < config.min_support:
            return []
        bounds = {}
        for name in names:
            values = [s[name] for obs in per for s in obs]
            lo, hi = min(values), max(values)
            if lo >= MIN_SHARE:  # math.isfinite holds: shares are in [0, 1]
                bounds[name] = [lo / config.margin, min(1.0, hi * config.margin * PROGRESS)]
        if not bounds:
            return []
        return [
            Invariant(
                id="gradshare.train",
                relation=cls.name,
                params={"shares": bounds, "persist": PERSIST},
                precondition=Precondition(phase="train", when=APPLIED),
                description=f"each of {len(bounds)} parameters keeps its share of the step's gradient "
                f"norm (|g_p| / |g|) within the references' range widened {config.margin:g}x "
                f"({config.margin * PROGRESS:g}x above) "
                f"(out of it {PERSIST} steps in a row: broken gradient flow)",
                support=n,
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _ShareCheck(inv, header["params"])


class _ShareCheck(Check):
    def __init__(self, inv: Invariant, names: list[str]) -> None:
        super().__init__(inv)
        known = set(names)
        for name in inv.params["shares"]:
            if name not in known:
                raise ValueError(
                    f"invariant {inv.id!r}: parameter {name!r} does not exist in the "
                    f"model being checked{close_matches(name, names)}"
                )
        self.names, self.bounds = names, inv.params["shares"]
        self.persist = inv.params.get("persist", PERSIST)
        self.streaks: dict[str, list[int]] = {}  # parameter out of bounds: [since step, steps]

    def needs(self):
        return {"grad_norms": True}

    def check(self, view: View):
        s = shares(view.rec, self.names)
        if s is None:  # no gradients to judge: a streak neither ends nor grows
            return []
        found = []
        for name, (lo, hi) in self.bounds.items():
            x = s[name]
            if lo <= x <= hi:
                self.streaks.pop(name, None)
                continue
            streak = self.streaks.setdefault(name, [view.step, 0])
            streak[1] += 1
            since, n = streak
            if n >= self.persist:
                side = "below" if x < lo else "above"
                found.append(
                    (
                        name,
                        {
                            "share": x,
                            "bounds": [lo, hi],
                            "steps_out": n,
                            "since_step": since,
                            "meaning": f"{name} got {x:.3g} of the step's gradient norm, {side} "
                            f"[{lo:.3g}, {hi:.3g}], for {n} steps in a row: "
                            f"{'too little' if x < lo else 'too much'} gradient reaches it",
                        },
                    )
                )
        return found
