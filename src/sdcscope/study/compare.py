"""Compare a faulty run with its golden twin (same seed, same data): the first outcome label.

``masked``: bitwise-identical final parameters. ``crash``: a non-finite loss or parameter.
``stalled``: a guarded run whose guard kept discarding its steps. Otherwise ``deviation``, with its
size: the relative L2 distance of the final parameters, the validation-loss delta and the
loss-curve difference (step by step, over the steps both runs applied).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from sdcscope.common.io import read_json
from sdcscope.engine import CHECKPOINT_DIR, load_checkpoint, read_jsonl
from sdcscope.engine.rundir import write_json


def _losses(run: Path) -> dict[int, float]:
    """The loss of each step's applied update, by step: a step a guard discarded (vetoed, rolled
    back) is left out, and a step trained again after a rollback counts once, as last trained."""
    losses: dict[int, float] = {}
    for r in read_jsonl(run / "metrics.jsonl"):
        if not r.get("skipped"):
            losses[int(r["step"])] = float(r["loss"])
    return losses


def param_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all floating-point tensors (fp64 accumulation)."""
    num = den = 0.0
    for name, tb in b.items():
        if not tb.is_floating_point():
            continue
        ta, tb = a[name].double(), tb.double()
        num += float((ta - tb).pow(2).sum())
        den += float(tb.pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.inf


def compare_runs(golden: str | Path, faulty: str | Path) -> dict[str, Any]:
    golden, faulty = Path(golden), Path(faulty)
    sg = read_json(golden / "summary.json")
    sf = read_json(faulty / "summary.json")
    lg, lf = _losses(golden), _losses(faulty)
    steps = sorted(set(lg) & set(lf))
    diff = [lf[s] - lg[s] for s in steps]
    first = next((s for s in steps if lf[s] != lg[s] and not (math.isnan(lf[s]) and math.isnan(lg[s]))), None)
    finite_diff = [abs(d) for d in diff if math.isfinite(d)]
    pg = load_checkpoint(golden / CHECKPOINT_DIR).model
    pf = load_checkpoint(faulty / CHECKPOINT_DIR).model
    distance = param_distance(pf, pg)
    params_finite = all(bool(torch.isfinite(t).all()) for t in pf.values() if t.is_floating_point())
    val_g, val_f = sg.get("final_val_loss"), sf.get("final_val_loss")
    val_delta = (val_f - val_g) if isinstance(val_f, float) and isinstance(val_g, float) else None
    if sf["param_sha256"] == sg["param_sha256"]:
        outcome = "masked"
    elif sf["outcome"] == "crash" or not params_finite or (val_delta is not None and not math.isfinite(val_delta)):
        outcome = "crash"
    elif sf["outcome"] == "stalled":  # its guard could not repair it: its model is not comparable
        outcome = "stalled"
    else:
        outcome = "deviation"
    return {
        "outcome": outcome,
        "first_divergence_step": first,
        "param_rel_l2": distance if math.isfinite(distance) else str(distance),
        "val_loss_golden": val_g,
        "val_loss_faulty": val_f,
        "val_loss_delta": val_delta,
        "loss_diff_max_abs": max(finite_diff, default=0.0),
        "loss_diff_mean_abs": sum(finite_diff) / len(finite_diff) if finite_diff else 0.0,
        "loss_diff": diff,
        "loss_diff_steps": steps,
        "steps_golden": sg["steps"],
        "steps_faulty": sf["steps"],
        "injections": len(read_jsonl(faulty / "injections.jsonl")),
    }


def write_comparison(out: str | Path, comparison: dict[str, Any]) -> Path:
    path = Path(out) / "comparison.json"
    write_json(path, comparison)
    return path
