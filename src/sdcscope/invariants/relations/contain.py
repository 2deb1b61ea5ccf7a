"""EventContain: a per-parameter effect always happens within its parent event.

Three (parent, child) pairs carry the semantics of a training step:

- ``optimizer.step`` contains ``update``: the step changes every parameter it should (its
  bits, not just its version counter).  Breaks when a layer is frozen, a parameter was never
  registered with the optimizer, the optimizer holds stale copies of the parameters, or a param
  group's learning rate is 0.
- ``backward`` contains ``grad``: backward produces a gradient for every such parameter.
  Breaks when a layer is frozen or cut from the graph (a stray ``.detach()``).
- ``step`` contains ``cleared``: each gradient is cleared within the step before the first
  backward, so gradients of different steps do not add up (missing or misplaced ``zero_grad``).

Parameters are named by pattern, so the invariant states *which* tensors must be affected
(inferred: every parameter that was affected in every reference step).

ExclusiveWrite is the converse for ``update``: within a training step, only ``optimizer.step``
writes the parameters (the ``outside`` effect: a version counter that moved before the step or
after it).  Breaks when a weight decay is applied by hand on top of the optimizer's, or a
parameter is edited in place by mistake.  Inferred per parameter: a loop that edits some
parameters by design (a max-norm constraint, an embedding renormalized in its forward) keeps
the invariant for the others.
"""

from __future__ import annotations

from sdcscope.common.validate import check_choice
from sdcscope.invariants.names import compress, from_hex, mask_of, names_of, resolve
from sdcscope.invariants.relations.base import (
    Check,
    InferConfig,
    Relation,
    View,
    learn_min_step,
    register,
)
from sdcscope.invariants.spec import EFFECT_PARENT, Invariant, Precondition

WORDS = {
    "update": "optimizer.step changes every parameter in {t}",
    "grad": "backward produces a gradient for every parameter in {t}",
    "cleared": "every gradient of {t} is cleared (None or zeroed) in each step before the first backward",
}


def _when(parent: str) -> tuple[str, ...]:
    """The parent must have run; clearing is judged at the first backward of the step."""
    return ("backward",) if parent == "step" else (parent,)


def _per_tensor(
    traces, config: InferConfig, effect: str, when: tuple[str, ...], affected: bool
) -> tuple[list[str], int, int]:
    """The parameters (of every trace) that every reference step from a learned warm-up on shows
    ``affected`` (or not) by ``effect``, in the steps that ran ``when``; the largest warm-up,
    and the support."""
    names = traces[0].header["params"]
    common = set(names).intersection(*(t.header["params"] for t in traces[1:]))
    per_trace = []
    for t in traces:
        index = {n: i for i, n in enumerate(t.header["params"])}
        recs = [
            (r["step"], from_hex(r["effects"][effect]))
            for r in t.phase("train")
            if r["effects"].get(effect) is not None and all(a in View(r).first for a in when)
        ]
        per_trace.append((index, recs))
    kept, k_all, support = [], 0, 0
    for name in (n for n in names if n in common):
        obs = [[(step, bool(mask >> index[name] & 1) == affected) for step, mask in recs] for index, recs in per_trace]
        k = learn_min_step(obs, config)
        if k is not None:
            kept.append(name)
            k_all = max(k_all, k)
            support = max(support, sum(1 for o in obs for s, _ in o if s >= k))
    return kept, k_all, support


@register
class EventContain(Relation):
    name = "EventContain"
    required = {"parent": str, "child": str, "tensors": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        check_choice("EventContain child", params["child"], EFFECT_PARENT)
        parent = EFFECT_PARENT[params["child"]]
        if params["parent"] != parent:
            raise ValueError(
                f"EventContain: child {params['child']!r} happens within {parent!r}, not {params['parent']!r}"
            )
        if not params["tensors"] or not all(isinstance(t, str) for t in params["tensors"]):
            raise ValueError("EventContain: tensors must be a non-empty list of name patterns")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        out = []
        for child, parent in EFFECT_PARENT.items():
            when = _when(parent)
            kept, k_all, support = _per_tensor(traces, config, child, when, affected=True)
            if not kept:
                continue
            tensors = compress(kept, traces[0].header["params"])
            out.append(
                Invariant(
                    id=f"contain.{parent}.{child}",
                    relation=cls.name,
                    params={"parent": parent, "child": child, "tensors": tensors},
                    precondition=Precondition(phase="train", min_step=k_all, when=when),
                    description=WORDS[child].format(t=", ".join(tensors)),
                    support=support,
                )
            )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _ContainCheck(inv, header["params"])


class _ContainCheck(Check):
    def __init__(self, inv: Invariant, names: list[str]) -> None:
        super().__init__(inv)
        self.names = names
        self.child = inv.params["child"]
        chosen = resolve(inv.params["tensors"], names, f"invariant {inv.id!r}: tensor")
        self.target = mask_of(chosen, names)

    def needs(self):
        return {"confirm_updates": True} if self.child == "update" else {}

    def check(self, view: View):
        effect = view.rec["effects"][self.child]
        if effect is None:
            return []
        missing = self.target & ~from_hex(effect)
        if not missing:
            return []
        which = names_of(missing, self.names)
        return [
            (
                which[0],
                {
                    "parent": self.inv.params["parent"],
                    "child": self.child,
                    "missing": which[:10],
                    "n_missing": len(which),
                },
            )
        ]


@register
class ExclusiveWrite(Relation):
    name = "ExclusiveWrite"
    required = {"tensors": list}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        if not params["tensors"] or not all(isinstance(t, str) for t in params["tensors"]):
            raise ValueError("ExclusiveWrite: tensors must be a non-empty list of name patterns")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        kept, k_all, support = _per_tensor(traces, config, "outside", (), affected=False)
        if not kept:
            return []
        tensors = compress(kept, traces[0].header["params"])
        return [
            Invariant(
                id="exclusive.optimizer.step.write",
                relation=cls.name,
                params={"tensors": tensors},
                precondition=Precondition(phase="train", min_step=k_all),
                description=f"within a training step, only optimizer.step writes {', '.join(tensors)}",
                support=support,
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _ExclusiveCheck(inv, header["params"])


class _ExclusiveCheck(Check):
    def __init__(self, inv: Invariant, names: list[str]) -> None:
        super().__init__(inv)
        self.names = names
        self.target = mask_of(resolve(inv.params["tensors"], names, f"invariant {inv.id!r}: tensor"), names)

    def check(self, view: View):
        outside = view.rec["effects"].get("outside")
        written = self.target & from_hex(outside) if outside is not None else 0
        if not written:
            return []
        which = names_of(written, self.names)
        return [(which[0], {"written_outside_optimizer_step": which[:10], "n_written": len(which)})]
