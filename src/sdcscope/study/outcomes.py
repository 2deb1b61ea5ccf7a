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
  ``drift`` -- the losses look healthy but the parameters moved away from golden's, decided two
  ways and both recorded: ``drift_twin`` -- the final relative distance to the bit-exact golden
  twin (``dist_golden``) exceeds the chaos floor, the envelope of perturbation twins at the end of
  the horizon (threshold ``dist_twin``, :mod:`.twins`; :data:`TWIN_BOUND` where a database has no
  twins yet); ``drift_spread`` -- it exceeds the distance healthy re-seeded runs reach (their
  bound). A re-seeded run lands far from golden (another data order), so only the twin measure
  sees a fault that sends the weights elsewhere with a normal loss (Ma et al.); ``sdc_kind`` is
  ``drift`` when either holds (see :mod:`.drift`);
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

__all__ = ["EFFECTS", "OUTCOMES", "SDC_KINDS", "NOT_FIRED", "TWIN_BOUND", "classify", "drift_flags"]

NOT_FIRED = "not_fired"
EFFECTS = ("masked", "benign", "crash", "sdc", NOT_FIRED)
SDC_KINDS = ("sharp", "slow", "drift")
OUTCOMES = ("masked", "benign", "detected", "recovered", "crash", "sdc", NOT_FIRED)
TWIN_BOUND = 0.01
"""The fixed ``drift_twin`` bound of databases without perturbation twins (written before them, or
read-only): the final weights differ from the bit-exact golden twin's by more than 1 % of their
norm. Training is chaotic, so a rounding-level trace outgrows any fixed bound on a long enough
horizon; a campaign run decides against its twins' envelope instead (:mod:`.twins`)."""


def _above(value: float | None, bound: float) -> bool:
    return value is not None and value > bound


def _flag(value: float | None, bound: float) -> int | None:
    return None if value is None or not math.isfinite(value) else int(value > bound)


def drift_flags(m: dict[str, Any], thresholds: dict[str, float]) -> dict[str, int | None]:
    """``{"drift_twin", "drift_spread"}``: the final weight distance to golden (``dist_golden``)
    against the perturbation twins' envelope ``thresholds["dist_twin"]`` (:data:`TWIN_BOUND`
    without one) and against the healthy re-seeds' bound, whatever the effect; None without a
    finite distance (a crash, a fault that never fired)."""
    dist = None if m["crash"] or not m.get("fired", True) else m["dist_golden"]
    return {
        "drift_twin": _flag(dist, thresholds.get("dist_twin", TWIN_BOUND)),
        "drift_spread": _flag(dist, thresholds["dist_golden"]),
    }


def classify(m: dict[str, Any], thresholds: dict[str, float], guard: bool) -> dict[str, Any]:
    """``{"effect", "sdc_kind", "outcome"}`` of trial measures ``m`` (keys: fired -- true when left
    out --, crash, masked, loss_excess, val_delta, dist_golden, detected) against ``thresholds``
    (measure -> bound); ``drift`` by either measure of :func:`drift_flags`."""
    kind = None
    if not m.get("fired", True):
        return {"effect": NOT_FIRED, "sdc_kind": None, "outcome": NOT_FIRED}
    flags = drift_flags(m, thresholds)
    if m["crash"]:
        effect = "crash"
    elif m["masked"]:
        effect = "masked"
    else:
        for name, measure in (("sharp", "loss_excess"), ("slow", "val_delta")):
            if _above(m[measure], thresholds[measure]):
                kind = name
                break
        if kind is None and (flags["drift_twin"] or flags["drift_spread"]):
            kind = "drift"
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
