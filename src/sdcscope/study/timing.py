"""Where a campaign run's time went: its fixed costs and the trials' efficiency against their floor.

A trial's compute floor is the campaign's own golden step time (the golden run's mean optimizer
step, its first, warm-up step left out) times the optimizer steps the trial ran: what the trial
would cost if it were nothing but training. Efficiency is the sum of the trials' floors over the
time the workers spent on those trials, per worker and over all, in wall time and in CPU time
(the CPU figure is blind to other jobs sharing the machine); what lies between is the per-trial
work around the steps (restore, injector, drift and disagreement measures, evaluation, files)
and, with several workers, their contention for the machine. The fixed costs (start-up, golden
run, healthy baselines, perturbation twins) and the share of the trial phase the workers were
busy (dispatch, the runner's writes, the last stragglers) are reported beside it, apart. A run
that did not run the golden job itself (a resume) has no golden step time, hence no efficiency.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["RunTiming"]


class RunTiming:
    """Collects one ``run_campaign``'s phase wall times and its workers' job results."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.golden: dict[str, float] = {}
        self.workers: dict[str, dict[str, float]] = {}
        self.size = 0
        """The backend's worker count (the trial phase's worker-seconds)."""

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def job(self, result: dict[str, Any]) -> None:
        """Account one job result (``wall_s``, ``cpu_s``, ``worker``; the golden job's
        ``step_s`` and ``step_cpu_s``; a trial's ``steps_run``)."""
        if result["kind"] == "golden":
            self.golden = {k: result[k] for k in ("step_s", "step_cpu_s", "wall_s")}
        elif result["kind"] == "trial":
            w = self.workers.setdefault(str(result["worker"]), {"trials": 0, "steps": 0, "busy_s": 0.0, "cpu_s": 0.0})
            w["trials"] += 1
            w["steps"] += result["steps_run"]
            w["busy_s"] += result["wall_s"]
            w["cpu_s"] += result["cpu_s"]

    def _ratios(self, w: dict[str, float]) -> dict[str, float | None]:
        """Floor and efficiency (wall, CPU) of ``w``'s trials; None without a golden step time."""
        g = self.golden
        if not g or w["busy_s"] <= 0:
            return {"floor_s": None, "efficiency": None, "cpu_efficiency": None}
        return {
            "floor_s": g["step_s"] * w["steps"],
            "efficiency": g["step_s"] * w["steps"] / w["busy_s"],
            "cpu_efficiency": g["step_cpu_s"] * w["steps"] / w["cpu_s"] if w["cpu_s"] > 0 else None,
        }

    def summary(self) -> dict[str, Any]:
        """``{golden: {step_s, step_cpu_s, wall_s}, phases: {startup, golden, baseline, twins,
        trials}, total_s, size, workers: {id: {trials, steps, busy_s, cpu_s, floor_s, efficiency,
        cpu_efficiency}}, trials: (the same over all workers), busy_share}``."""
        workers = {k: {**w, **self._ratios(w)} for k, w in self.workers.items()}
        keys = ("trials", "steps", "busy_s", "cpu_s")
        total = {k: sum(w[k] for w in self.workers.values()) for k in keys}
        phase = self.phases.get("trials", 0.0)
        return {
            "golden": dict(self.golden),
            "phases": dict(self.phases),
            "total_s": time.perf_counter() - self.t0,
            "size": self.size,
            "workers": workers,
            "trials": {**total, **self._ratios(total)},
            "busy_share": total["busy_s"] / (phase * self.size) if phase > 0 and self.size else None,
        }
