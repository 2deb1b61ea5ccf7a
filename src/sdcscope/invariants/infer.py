"""Inference: keep the relation instances that hold in every clean reference run.

Each relation proposes instances from the traces and keeps those that hold in all of them, have
enough support, and are not trivially true (see the relation modules).  More references of
different seeds and configurations make the result more general: a fact that only one
configuration shows (a learning-rate value, a batch shape) is not kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sdcscope.invariants.relations import RELATIONS, InferConfig
from sdcscope.invariants.spec import Invariant
from sdcscope.invariants.tracefile import Trace, load_trace


def infer_invariants(traces: Iterable[Trace | str | Path], config: InferConfig | None = None) -> list[Invariant]:
    """Invariants that hold in all given traces (``Trace`` objects or run directories)."""
    config = config or InferConfig()
    traces = [t if isinstance(t, Trace) else load_trace(t) for t in traces]
    if not traces:
        raise ValueError("give at least one reference run to infer invariants from")
    for t in traces:
        if not t.phase("train"):
            raise ValueError(f"{t.source!r} holds no training steps to infer from")
    out: list[Invariant] = []
    for name, relation in RELATIONS.items():
        if not config.relations or name in config.relations:
            out.extend(relation.infer(traces, config))
    return out
