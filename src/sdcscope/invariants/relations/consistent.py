"""Consistent(A, B): two tensors that change during training yet stay bitwise equal.

The typical case is data-parallel replicas (``replicas.0.*`` and ``replicas.1.*``), also a buffer
and its copy, or an EMA kept in lock-step.  Equality is judged on exact full-tensor checksums
taken after every step, so a single flipped bit anywhere in a replica is a violation, and pairs
are matched by *name*: two same-shaped tensors of different layers are never compared.

Pairs that are always equal because they never change, or because they are the same tensor
(tied weights are listed once), are not invariants and are not inferred.
"""

from __future__ import annotations

from collections import defaultdict

from sdcscope.invariants.names import pair_up
from sdcscope.invariants.relations.base import (
    Check,
    InferConfig,
    Relation,
    View,
    learn_min_step,
    register,
)
from sdcscope.invariants.spec import Invariant, Precondition


def _candidates(trace) -> dict[tuple[str, str], list[tuple[int, bool]]]:
    """Same-shape, same-dtype pairs equal at the end of the trace and changing over it."""
    h = trace.header
    recs = [r for r in trace.phase("train") if r.get("checksums")]
    if len(recs) < 2:
        return {}
    names = h["watched"]
    series = list(zip(*(r["checksums"] for r in recs)))
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (shape, dtype) in enumerate(zip(h["shapes"], h["dtypes"])):
        if len(set(series[i])) > 1:
            groups[(tuple(shape), dtype)].append(i)
    steps = [r["step"] for r in recs]
    out = {}
    for members in groups.values():
        for a, i in enumerate(members):
            for j in members[a + 1 :]:
                if series[i][-1] == series[j][-1]:
                    out[(names[i], names[j])] = [(s, x == y) for s, x, y in zip(steps, series[i], series[j])]
    return out


def _prefixes(a: str, b: str) -> tuple[str, str] | None:
    """The differing module prefixes of two names with a common suffix (``replicas.0``...)."""
    xs, ys = a.split("."), b.split(".")
    c = 0
    while c < min(len(xs), len(ys)) - 1 and xs[-1 - c] == ys[-1 - c]:
        c += 1
    return (".".join(xs[:-c]), ".".join(ys[:-c])) if c else None


def _pairs_exactly(a: str, b: str, watched: list[str], members: list[tuple[str, str]]) -> bool:
    try:
        return set(pair_up(a, b, watched, "Consistent")) == set(members)
    except ValueError:
        return False


@register
class Consistent(Relation):
    name = "Consistent"
    required = {"a": str, "b": str}

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        per_trace = [_candidates(t) for t in traces]
        pairs = set(per_trace[0]).intersection(*per_trace[1:])
        learned = {}
        for pair in sorted(pairs):
            k = learn_min_step([c[pair] for c in per_trace], config)
            if k is not None:
                learned[pair] = k
        groups: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
        for pair in learned:
            groups[_prefixes(*pair) or pair].append(pair)
        watched = traces[0].header["watched"]
        out = []
        for (pa, pb), members in sorted(groups.items()):
            a, b = pa + ".*", pb + ".*"
            if _pairs_exactly(a, b, watched, members):
                specs = [(members, (a, b))]
            else:  # not a clean prefix pairing: state the pairs one by one
                specs = [([p], p) for p in sorted(members)]
            for covered, (a, b) in specs:
                k = max(learned[p] for p in covered)
                out.append(
                    Invariant(
                        id=f"consistent.{a}=={b}",
                        relation=cls.name,
                        params={"a": a, "b": b},
                        precondition=Precondition(phase="train", min_step=k),
                        description=f"{a} and {b} change during training but stay bitwise equal after every step",
                        support=sum(1 for c in per_trace for s, _ in c[covered[0]] if s >= k),
                    )
                )
        return out

    @classmethod
    def bind(cls, inv, header):
        return _ConsistentCheck(inv, header["watched"])


class _ConsistentCheck(Check):
    def __init__(self, inv: Invariant, watched: list[str]) -> None:
        super().__init__(inv)
        index = {n: i for i, n in enumerate(watched)}
        self.pairs = [
            (index[x], index[y], x, y)
            for x, y in pair_up(inv.params["a"], inv.params["b"], watched, f"invariant {inv.id!r}")
        ]

    def needs(self):
        return {"checksums": sorted({n for *_, x, y in self.pairs for n in (x, y)})}

    def check(self, view: View):
        sums = view.rec.get("checksums")
        if not sums:
            return []
        differ = [[x, y] for i, j, x, y in self.pairs if sums[i] != sums[j]]
        if not differ:
            return []
        return [(differ[0][1], {"differing": differ[:10], "n_differing": len(differ), "n_pairs": len(self.pairs)})]
