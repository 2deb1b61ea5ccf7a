"""What a golden/faulty/guarded comparison shows, read back from its folder (``inject``, ``demo``).

:func:`load_series` reads each run's applied-update losses, whether and where it crashed, its events
and injected faults, and the parameter-distance trace of ``comparison.json``; :func:`story` says in
one sentence each what the fault was, what it did to the unguarded run, what the guard detected and
how it repaired it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sdcscope.common.io import read_json, read_jsonl
from sdcscope.detect.events import actions_of

__all__ = ["RUNS", "load_series", "story", "departure"]

RUNS = ("golden", "faulty", "guarded")
"""The run directories a comparison folder may hold, the reference first."""


def _run(path: Path) -> dict[str, Any]:
    losses: dict[int, float] = {}
    vetoed: list[int] = []
    for row in read_jsonl(path / "metrics.jsonl"):
        if row.get("skipped"):
            vetoed.append(int(row["step"]))
        else:  # a step re-trained after a rollback counts once, as last trained
            losses[int(row["step"])] = float(row["loss"])
    steps = sorted(losses)
    summary = read_json(path / "summary.json") if (path / "summary.json").is_file() else {}
    config = read_json(path / "config.json") if (path / "config.json").is_file() else {}
    crash = next((s for s in steps if not math.isfinite(losses[s])), None)
    if crash is None and summary.get("outcome") == "crash" and steps:
        crash = steps[-1]
    return {
        "steps": steps,
        "losses": [losses[s] for s in steps],
        "crash_step": crash,
        "vetoed": vetoed,
        "events": read_jsonl(path / "events.jsonl") if (path / "events.jsonl").is_file() else [],
        "injections": read_jsonl(path / "injections.jsonl") if (path / "injections.jsonl").is_file() else [],
        "summary": summary,
        "faults": config.get("faults") or [],
    }


def load_series(out: str | Path) -> dict[str, Any]:
    """``{"runs": {label: run}, "comparison": comparison.json or {}}`` of the runs ``out`` holds."""
    out = Path(out)
    runs = {label: _run(out / label) for label in RUNS if (out / label / "metrics.jsonl").is_file()}
    if "golden" not in runs:
        raise FileNotFoundError(f"{str(out)!r} holds no golden/metrics.jsonl: not an inject or demo folder")
    comparison = read_json(out / "comparison.json") if (out / "comparison.json").is_file() else {}
    return {"runs": runs, "comparison": comparison}


def departure(series: dict[str, Any], label: str, after: int | None = None) -> dict[str, Any]:
    """Where and how far run ``label``'s loss left the golden one (at or after step ``after``): the
    first step that differs (runs from one seed are bitwise equal until then) and that difference,
    the largest finite difference and its step, the last difference, and whether the run crashed."""
    golden = dict(zip(series["runs"]["golden"]["steps"], series["runs"]["golden"]["losses"]))
    run = series["runs"][label]
    diffs = [
        (s, v - golden[s])
        for s, v in zip(run["steps"], run["losses"])
        if s in golden and (after is None or s >= after) and math.isfinite(v) and math.isfinite(golden[s])
    ]
    peak = max(diffs, key=lambda d: abs(d[1]), default=(None, 0.0))
    first = next((d for d in diffs if d[1] != 0), (None, 0.0))
    return {
        "first_step": first[0],
        "first": first[1],
        "peak_step": peak[0],
        "peak": peak[1],
        "last": diffs[-1][1] if diffs else 0.0,
        "crash_step": run["crash_step"],
    }


def _distance(series: dict[str, Any], label: str) -> float | None:
    c = series["comparison"] if label == "faulty" else series["comparison"].get(label) or {}
    value = c.get("param_rel_l2")
    return None if value is None else float(value)


def _fault_sentence(injections: list[dict], specs: list[dict]) -> str:
    if not injections:
        return "fault: none fired"
    first = injections[0]
    spec = specs[first["spec"]] if isinstance(first.get("spec"), int) and first["spec"] < len(specs) else {}
    bits = f" bit{'s' if len(first.get('bits') or []) > 1 else ''} {', '.join(map(str, first.get('bits') or []))}"
    bits += f" (of {spec['format']})" if spec.get("format") else ""
    values = f"{first.get('count', 1)} value{'s' if first.get('count', 1) != 1 else ''}"
    more = f" (and {len(injections) - 1} more injection(s))" if len(injections) > 1 else ""
    return (
        f"fault: at step {first['step']}, {first.get('model', 'a fault')}{bits if first.get('bits') else ''} "
        f"in {values} of {first.get('module')} ({first.get('site')}){more}"
    )


def _repair(event: dict, distance: float | None) -> str:
    actions = actions_of(event)
    evidence = event.get("evidence") or {}
    if "rollback" in actions:
        did = f"rolled back to its verified snapshot of step {evidence.get('rolled_back_to', '?')} and trained on"
    elif "recompute" in actions:
        did = "replayed the step and kept the clean re-execution"
    elif "veto" in actions:
        did = "discarded the step's update"
    else:
        did = f"took the action {', '.join(actions)}"
    if distance is None:
        end = ""
    elif distance == 0:
        end = "; the guarded run ends bitwise equal to the golden one"
    else:
        end = f"; the guarded run ends {distance:.3g} (relative L2) from the golden one"
    return f"repair: the guard {did}{end}"


def _departure_sentence(d: dict[str, Any], distance: float | None) -> str:
    """Where the unguarded loss left the golden curve, where it was furthest, where it ends."""
    params = "" if distance is None else f", parameters {distance:.3g} (relative L2) from the golden ones"
    if d["first_step"] is None:
        return "unguarded: the loss never left the golden curve" + params
    left = f"unguarded: the loss left the golden curve at step {d['first_step']} ({d['first']:+.3g})"
    if d["peak_step"] != d["first_step"]:
        left += f", was furthest from it at step {d['peak_step']} ({d['peak']:+.3g})"
    return f"{left} and ends {d['last']:+.3g} from it{params}"


def story(series: dict[str, Any]) -> list[str]:
    """One sentence each: the fault, the unguarded run's departure, the detection, the repair."""
    runs = series["runs"]
    lines = []
    if "faulty" in runs:
        faulty = runs["faulty"]
        lines.append(_fault_sentence(faulty["injections"], faulty["faults"]))
        fault_step = faulty["injections"][0]["step"] if faulty["injections"] else None
        d = departure(series, "faulty", fault_step)
        dist = _distance(series, "faulty")
        if d["crash_step"] is not None:
            lines.append(f"unguarded: the loss became non-finite at step {d['crash_step']}: the run crashed")
        else:
            lines.append(_departure_sentence(d, dist))
    if "guarded" in runs:
        events = runs["guarded"]["events"]
        if not events:
            lines.append("detection: the guard reported nothing")
        else:
            e = events[0]
            finding = (e.get("evidence") or {}).get("finding")
            where = " ".join(str(x) for x in (e.get("module"), e.get("gemm")) if x) or "the step"
            more = f" ({len(events) - 1} more event(s))" if len(events) > 1 else ""
            lines.append(
                f"detection: at step {e['step']} the guard's {e['detector']} check flagged {where}: "
                f"{e.get('verdict')}{f', {finding}' if finding else ''}{more}"
            )
            lines.append(_repair(e, _distance(series, "guarded")))
    return lines
