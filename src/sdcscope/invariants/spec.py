"""What an invariant is: a relation name, its parameters, a precondition and a description.

The trace vocabulary lives here too, because both the recorder (which emits these names) and the
relations (which reason about them) must agree on it:

- **APIs** are the calls the recorder observes, in the order they happen within a step.
- **Effects** are per-tensor state changes observed *within* a parent event: a parameter changed
  by ``optimizer.step`` (``update``), a gradient produced by ``backward`` (``grad``), a gradient
  cleared within the step before the first backward (``cleared``); and one observed *outside*
  it: a parameter written within the step but not by ``optimizer.step`` (``outside``).
- **Phases**: ``train`` records lie between ``step_begin``/``step_end``; everything observed
  between steps (evaluation forwards, evaluation metrics) forms an ``eval`` record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdcscope.common.validate import check_choice, check_non_negative

APIS = (
    "forward",
    "zero_grad",
    "backward",
    "clip_grad_norm_",
    "optimizer.step",
    "lr_scheduler.step",
    "scaler.scale",
    "scaler.unscale_",
    "scaler.step",
    "scaler.update",
)
EFFECT_PARENT = {"update": "optimizer.step", "grad": "backward", "cleared": "step"}
"""Each effect and the event it must happen within (``step``: the whole training step)."""
PHASES = ("train", "eval")
SKIPPABLE = {"optimizer.step": "scaler.step"}
"""APIs another API may legitimately skip: ``GradScaler.step`` skips ``optimizer.step`` when
the gradients overflowed, which mixed-precision training does by design now and then."""
OPTIONAL = frozenset({"clip_grad_norm_"})
"""APIs a run may leave out altogether: gradient clipping on or off is a setting of the run (a
hyper-parameter), not a bug.  A run that runs one on some steps and not on others is still
inconsistent, and where it runs, its place in the order and its arguments are still judged."""
MASK_FIELDS = frozenset({"params", "decayed"})
"""Call fields holding a set of the model's parameters (a bit mask in the trace): the parameters
``clip_grad_norm_`` clips, those ``optimizer.step`` applies a weight decay to."""
SELECTIVE_FIELDS = frozenset({"decayed"})
"""Mask fields recorded only when they select some of the parameters and not others: a call
without one treats every parameter alike (no decay for any, or the same for all), which is a
violation of a learned value, not a missing fact."""
FINGERPRINT_FIELDS = frozenset({"input"})
"""Call fields holding an exact integer checksum of a tensor argument."""
MICRO_BATCH_APIS = ("forward", "backward", "scaler.scale")
"""APIs that run once per micro-batch: how often they run in a step (or an evaluation) is the
number of micro-batches, a setting of the run, not a property of the loop."""
PROBE_FIELDS = frozenset({"causal_leak", "causal_cut", "causal_pos", "causal_len"})
"""Forward fields of the causality probe (see ``recorder.TraceConfig.causal_probe``): judged by
the ``Causal`` relation, not learned as call fields (the probe runs every N steps only)."""
STYLE_FIELDS = frozenset({("zero_grad", "on"), ("zero_grad", "set_to_none")})
"""(API, field)s recorded for the reader but not learned: ``model.zero_grad()`` and
``zero_grad(set_to_none=False)`` clear the gradients as well as ``optimizer.zero_grad()`` does;
whether the gradients were cleared is the ``cleared`` effect's business."""


@dataclass(kw_only=True)
class Precondition:
    """When an invariant applies: a phase, from a (learned) warm-up step on, when APIs ran."""

    phase: str = "train"
    min_step: int = 0
    """Learned: the relation held on every reference step >= min_step."""
    when: tuple[str, ...] = ()
    """Only records in which every one of these APIs was called (e.g. ``optimizer.step``)."""

    def __post_init__(self) -> None:
        check_choice("precondition phase", self.phase, PHASES)
        check_non_negative("precondition min_step", self.min_step)
        if isinstance(self.when, str):
            self.when = (self.when,)
        self.when = tuple(self.when)
        for api in self.when:
            check_choice("precondition api", api, APIS)

    @classmethod
    def from_dict(cls, data: Any) -> Precondition:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"precondition must be a mapping, not {data!r}")
        unknown = set(data) - {"phase", "min_step", "when"}
        if unknown:
            raise ValueError(f"unknown precondition key(s) {sorted(unknown)}; allowed: phase, min_step, when")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase}
        if self.min_step:
            out["min_step"] = self.min_step
        if self.when:
            out["when"] = list(self.when)
        return out


@dataclass(kw_only=True)
class Invariant:
    """One checkable statement about a correct training run.

    ``params`` is relation-specific and validated by the relation (see ``relations``);
    ``support`` is how many reference observations backed it when it was inferred.
    """

    id: str
    relation: str
    params: dict[str, Any]
    precondition: Precondition = field(default_factory=Precondition)
    description: str = ""
    support: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "relation": self.relation,
            "params": self.params,
            "precondition": self.precondition.to_dict(),
        }
        if self.description:
            out["description"] = self.description
        if self.support:
            out["support"] = self.support
        return out
