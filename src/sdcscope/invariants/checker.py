"""Checking: online, step by step, inside the training process; offline, over a recorded trace.

Online, :class:`InvariantChecker` records only what its invariants need (e.g. checksums only of
the tensors named by ``Consistent`` invariants, batch checksums only if an invariant uses them,
bit sums of updated parameters only if an ``update`` containment is checked, the causality
probe only for a ``Causal`` invariant, as often as it asks, per-parameter gradient norms only
for a ``GradShare`` invariant) and evaluates each
record when the step ends, in the same process, on a few scalars and bit masks.  Offline,
:func:`check_trace` evaluates the same checks over ``trace.jsonl``.

A violation is an event in the run-directory contract (``events.jsonl``)::

    {"step": 7, "detector": "invariant", "verdict": "contain.optimizer.step.update",
     "module": "blocks.0.attn.q_proj.weight", "rank": 0, "action": null,
     "evidence": {"relation": "EventContain", "phase": "train", "description": ..., ...}}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.engine.rundir import JsonlWriter
from sdcscope.invariants.files import load_invariants
from sdcscope.invariants.recorder import EngineCallbacks, TraceRecorder
from sdcscope.invariants.relations import RELATIONS, Check, View, validate_invariant
from sdcscope.invariants.spec import Invariant
from sdcscope.invariants.traceconfig import TraceConfig
from sdcscope.invariants.tracefile import Trace, load_trace

EVENTS_FILE = "events.jsonl"
DETECTOR = "invariant"


def bind_invariants(invariants: Iterable[Invariant], header: dict[str, Any]) -> list[Check]:
    """Validate and resolve every invariant against one model (a trace header)."""
    checks, seen = [], set()
    for inv in invariants:
        if inv.id in seen:
            raise ValueError(f"duplicate invariant id {inv.id!r}")
        seen.add(inv.id)
        validate_invariant(inv)
        checks.append(RELATIONS[inv.relation].bind(inv, header))
    return checks


class Evaluator:
    """Preconditions, then checks, over a stream of records; turns violations into events.

    With ``every_step=False`` a given (invariant, module) is reported at its first violation
    only (later ones are counted in ``counts``), so a bug present at every step is one event.
    """

    def __init__(self, checks: list[Check], rank: int = 0, every_step: bool = False) -> None:
        self.rank, self.every_step = rank, every_step
        self.counts: Counter[tuple[str, str]] = Counter()
        self.last_step: dict[str, int] = {}  # per phase, of the last record seen
        self._by_phase: dict[str, list] = {}
        for c in checks:
            p = c.inv.precondition
            self._by_phase.setdefault(p.phase, []).append((p.min_step, p.when, c.check, c))

    def run(self, records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for rec in records:
            view = View(rec)
            first = view.first
            self.last_step[view.phase] = view.step
            for min_step, when, judge, check in self._by_phase.get(view.phase, ()):
                if view.step < min_step or when and any(api not in first for api in when):
                    continue
                for module, evidence in judge(view):
                    self._add(events, check, module, evidence, view.step, view.phase)
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The violations only the end of the run shows (``Check.finish``), at its last step."""
        events: list[dict[str, Any]] = []
        for phase, entries in self._by_phase.items():
            for *_, check in entries:
                for module, evidence in check.finish():
                    self._add(events, check, module, evidence, self.last_step.get(phase, 0), phase)
        return events

    def _add(self, events: list, check: Check, module: str, evidence: dict, step: int, phase: str) -> None:
        inv, key = check.inv, (check.inv.id, module)
        self.counts[key] += 1
        if self.every_step or self.counts[key] == 1:
            events.append(
                {
                    "step": step,
                    "detector": DETECTOR,
                    "verdict": inv.id,
                    "module": module,
                    "rank": self.rank,
                    "action": None,
                    "evidence": {"relation": inv.relation, "phase": phase, "description": inv.description, **evidence},
                }
            )


def check_trace(
    trace: Trace | str | Path, invariants: Iterable[Invariant] | str | Path, *, every_step: bool = True
) -> list[dict[str, Any]]:
    """Offline: every violation of ``invariants`` in a recorded trace (a run dir or file)."""
    trace = trace if isinstance(trace, Trace) else load_trace(trace)
    invs = load_invariants(invariants) if isinstance(invariants, (str, Path)) else list(invariants)
    evaluator = Evaluator(bind_invariants(invs, trace.header), trace.header.get("rank", 0), every_step)
    return evaluator.run(trace.records) + evaluator.finish()


class InvariantChecker(EngineCallbacks):
    """Online checking of one model + optimizer; usable from any loop or as an engine callback.

    ``step_end()`` returns the violations of the step just ended (and of an evaluation run
    since the previous step) as events, and appends them to ``RUN_DIR/events.jsonl`` when
    ``run_dir`` is given.  Construction fails with ``ValueError`` if an invariant does not fit
    the model (a pattern that matches nothing, a module class the model does not have).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        invariants: Iterable[Invariant] | str | Path,
        *,
        schedulers: Iterable[Any] = (),
        scaler: Any = None,
        run_dir: str | Path | None = None,
        rank: int = 0,
        every_step: bool = False,
    ) -> None:
        invs = load_invariants(invariants) if isinstance(invariants, (str, Path)) else list(invariants)
        full = TraceRecorder(model, optimizer, config=TraceConfig(rank=rank)).header()
        checksums: set[str] = set()
        flags = {"input_fingerprint": False, "confirm_updates": False, "target_shift": False, "grad_norms": False}
        causal = []  # the probe intervals Causal invariants ask for
        for check in bind_invariants(invs, full):
            need = check.needs()
            checksums.update(need.get("checksums", ()))
            for key in flags:
                flags[key] |= need.get(key, False)
            if need.get("causal_probe"):
                causal.append(need["causal_probe"])
        config = TraceConfig(
            checksums=tuple(n for n in full["watched"] if n in checksums),
            rank=rank,
            causal_probe=min(causal, default=0),
            **flags,
        )
        self.invariants = invs
        self.recorder = TraceRecorder(model, optimizer, schedulers=schedulers, scaler=scaler, config=config)
        self.evaluator = Evaluator(bind_invariants(invs, self.recorder.header()), rank, every_step)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.violations: list[dict[str, Any]] = []
        self._events: JsonlWriter | None = None

    def attach(self) -> InvariantChecker:
        self.recorder.attach()
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._events = JsonlWriter(self.run_dir / EVENTS_FILE)
        return self

    def detach(self) -> list[dict[str, Any]]:
        """Stop checking; return the violations of records that detaching completed."""
        events = self._report(self.recorder.detach())
        events += self._report_found(self.evaluator.finish())
        if self._events is not None:
            self._events.close()
            self._events = None
        return events

    def __enter__(self) -> InvariantChecker:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def step_begin(self, step: int | None = None) -> None:
        self.recorder.step_begin(step)

    def step_end(self) -> list[dict[str, Any]]:
        return self._report(self.recorder.step_end())

    def abandon_step(self) -> None:
        """End the step without checking it (its effects were discarded: a vetoed or rolled-back step)."""
        self.recorder.abandon_step()

    def eval_end(self) -> list[dict[str, Any]]:
        return self._report(self.recorder.eval_end())

    def log_metrics(self, metrics: dict[str, Any] | None = None, **more: Any) -> None:
        self.recorder.log_metrics(metrics, **more)

    def _report(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._report_found(self.evaluator.run(records) if records else [])

    def _report_found(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if events:
            self.violations.extend(events)
            if self._events is not None:
                for e in events:
                    self._events.write(e)
        return events
