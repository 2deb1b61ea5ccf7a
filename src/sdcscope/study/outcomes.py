"""Outcome classes of a trial, decided against the healthy-seed thresholds of its injection step.

``effect`` -- what the fault did, in this order of precedence:

- ``not_fired``: the fault never fired (its target was never reached -- a module not called, a
  first layer without dX -- or an intermittent schedule missed every event). Such a trial is no
  evidence of anything: it is neither masked nor incorrect, and no part of PVF;
- ``crash``: a non-finite loss, parameter or validation loss (or the step raised);
- ``masked``: the final parameters are bitwise equal to golden's at the same step, or the fault
  never changed a single value;
- ``sdc`` (silent data corruption), with ``sdc_kind``:
  ``sharp`` -- a loss spike: the training loss exceeded golden's, at some step of the horizon, by
  more than ``loss_excess`` of the healthy runs allows; ``slow`` -- the final validation loss
  (fault removed) is worse than golden's by more than the healthy ``val_delta`` bound;
  ``drift`` -- the losses look healthy but the parameters are farther from golden's than healthy
  re-seeded runs get (``dist_golden``);
- ``benign``: parameters differ from golden but every measure is within healthy variance.

``outcome`` -- ``effect``, unless the guard is on and emitted an event at or after the step
the fault first fired on (``detected``; ``latency`` counts from that step): then ``recovered`` when
the run ends finite with a validation loss within the
healthy bound, else ``detected`` (a ``not_fired`` trial stays ``not_fired``: an event there is a
false positive). PVF counts ``crash`` and ``sdc`` effects as incorrect among the trials whose
fault fired.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EFFECTS", "OUTCOMES", "SDC_KINDS", "NOT_FIRED", "classify"]

NOT_FIRED = "not_fired"
EFFECTS = ("masked", "benign", "crash", "sdc", NOT_FIRED)
SDC_KINDS = ("sharp", "slow", "drift")
OUTCOMES = ("masked", "benign", "detected", "recovered", "crash", "sdc", NOT_FIRED)


def _above(value: float | None, bound: float) -> bool:
    return value is not None and value > bound


def classify(m: dict[str, Any], thresholds: dict[str, float], guard: bool) -> dict[str, Any]:
    """``{"effect", "sdc_kind", "outcome"}`` of trial measures ``m`` (keys: fired -- true when left
    out --, crash, masked, loss_excess, val_delta, dist_golden, detected) against ``thresholds``
    (measure -> bound)."""
    kind = None
    if not m.get("fired", True):
        return {"effect": NOT_FIRED, "sdc_kind": None, "outcome": NOT_FIRED}
    if m["crash"]:
        effect = "crash"
    elif m["masked"]:
        effect = "masked"
    else:
        for name, measure in (("sharp", "loss_excess"), ("slow", "val_delta"), ("drift", "dist_golden")):
            if _above(m[measure], thresholds[measure]):
                kind = name
                break
        effect = "benign" if kind is None else "sdc"
    outcome = effect
    if guard and m.get("detected"):
        healthy_end = (
            not m["crash"]
            and m["val_delta"] is not None
            and math.isfinite(m["val_delta"])
            and m["val_delta"] <= thresholds["val_delta"]
        )
        outcome = "recovered" if healthy_end else "detected"
    return {"effect": effect, "sdc_kind": kind, "outcome": outcome}
