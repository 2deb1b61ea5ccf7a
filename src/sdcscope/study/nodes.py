"""The three levels of analysis per node profile (Ma et al., ACL 2025), from a campaign's trial rows.

A node profile (:class:`~sdcscope.study.space.FaultProfiles`) stands for one unhealthy machine;
its trials are independent draws of that machine's fault (another lane, element or start). Per
profile, over its trials:

- level (a), the submodule lock-step at the injection step: in how many trials the first divergent
  submodule is the injected unit, and each trial's largest mismatch frequency and severity;
- level (b), one optimizer step at a time (parameters re-synchronized every step): each trial's
  worst-step gradient noise-to-signal ratio and the share of steps whose gradients differ at all
  (an intermittent fault leaves most steps clean);
- level (c), the training period without synchronization: how many trials end with their
  parameters beyond the chaos envelope (``drift_twin``), how many are a loss spike or worse
  validation (``sdc:sharp``, ``sdc:slow``), and how many of the drifted ones have a training loss
  inside the healthy spread -- a normal loss curve that does not certify the weights.

Rows without a profile (a spec of one fault space) form one profile, ``""``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from sdcscope.study.levels import in_target

__all__ = ["profile_levels", "level_rows", "worst_mismatch", "LEVEL_COLUMNS", "NODE_NOTE"]

LEVEL_COLUMNS = [
    "profile",
    "trials",
    "activated",
    "(a) first divergence in the unit",
    "(a) median worst mismatch frequency",
    "(a) max severity",
    "(b) median worst-step NSR",
    "(b) max NSR",
    "(b) steps with a gradient mismatch",
    "(c) beyond the chaos envelope",
    "(c) of those, loss within healthy spread",
    "(c) sdc:sharp / sdc:slow / crash",
    "(c) median distance to golden",
]


NODE_NOTE = (
    "per profile, over its trials: (a) lock-step at the injection step (first divergent submodule, "
    "each trial's largest mismatch frequency and severity); (b) parameters re-synchronized every step "
    "(each trial's worst-step gradient noise-to-signal ratio; the mean share of steps whose gradients "
    "differ); (c) no synchronization (final parameters beyond the perturbation twins' envelope; of "
    "those, how many have training and validation loss inside the healthy spread)"
)


def worst_mismatch(row: dict[str, Any]) -> tuple[float, float]:
    """``(frequency, severity)``: the largest of any submodule and direction in the trial's
    lock-step (level a); ``(0, 0)`` when nothing mismatched."""
    cells = [d for dirs in (row.get("lockstep") or {}).values() for d in dirs.values()]
    return (max((c["frequency"] for c in cells), default=0.0), max((c["severity"] for c in cells), default=0.0))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quiet_loss(row: dict[str, Any], bounds: dict[str, float]) -> bool:
    """Whether the trial's training and validation loss stay inside the healthy spread (the
    thresholds of its injection step): its loss curve would pass for a healthy run."""
    return all(row[m] is not None and (m not in bounds or row[m] <= bounds[m]) for m in ("loss_excess", "val_delta"))


def profile_levels(rows: list[dict[str, Any]], thresholds: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """One summary per profile (in order of first appearance): the three levels' measures, each
    over the profile's trials (``None`` where the campaign did not measure it); ``thresholds``:
    ``{inject_step: {measure: bound}}`` of the results database."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r.get("profile") or ""].append(r)
    out = []
    for profile, rs in groups.items():
        located = [r for r in rs if r["lockstep"] is not None or r["first_divergence"] is not None]
        worst = [worst_mismatch(r) for r in located]
        nsr = [r for r in rs if r["nsr"]]
        drifted = [r for r in rs if r["drift_twin"]]
        out.append(
            {
                "profile": profile,
                "trials": len(rs),
                "activated": sum(bool(r["activated"]) for r in rs),
                "a_located": len(located),
                "a_in_unit": sum(
                    bool(r["first_divergence"]) and in_target(r["first_divergence"]["module"], r["target"])
                    for r in located
                ),
                "a_frequency": [f for f, _ in worst],
                "a_severity": [s for _, s in worst],
                "b_nsr_max": [r["nsr_max"] for r in nsr],
                "b_step_share": [sum(float(x) != 0 for x in r["nsr"]) / len(r["nsr"]) for r in nsr],  # "inf", "nan" too
                "c_drift": len(drifted),
                "c_drift_quiet_loss": sum(_quiet_loss(r, thresholds.get(r["inject_step"], {})) for r in drifted),
                "c_sharp": sum(r["sdc_kind"] == "sharp" for r in rs),
                "c_slow": sum(r["sdc_kind"] == "slow" for r in rs),
                "c_crash": sum(r["effect"] == "crash" for r in rs),
                "c_dist": [r["dist_golden"] for r in rs if r["dist_golden"] is not None],
            }
        )
    return out


def level_rows(summaries: list[dict[str, Any]]) -> list[list[Any]]:
    """Table cells (:data:`LEVEL_COLUMNS`) of :func:`profile_levels`."""
    cells = []
    for s in summaries:
        nsr_share = s["b_step_share"]
        cells.append(
            [
                s["profile"] or "(one fault space)",
                s["trials"],
                s["activated"],
                f"{s['a_in_unit']}/{s['a_located']}" if s["a_located"] else None,
                _median(s["a_frequency"]),
                max(s["a_severity"], default=None),
                _median(s["b_nsr_max"]),
                max(s["b_nsr_max"], default=None),
                statistics.fmean(nsr_share) if nsr_share else None,
                f"{s['c_drift']}/{s['trials']}",
                f"{s['c_drift_quiet_loss']}/{s['c_drift']}",
                f"{s['c_sharp']} / {s['c_slow']} / {s['c_crash']}",
                _median(s["c_dist"]),
            ]
        )
    return cells
