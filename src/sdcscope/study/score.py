"""The detector scoreboard: recall, false positives, localization and latency per fault class.

A **fault class** is site x fault model x pattern x schedule (the truth rows' labels, as the
coverage matrix classes faults; ``CLASS_FIELDS``). Per detector and class:

- ``recall``: the share of faulty trials whose fault fired that got a verdict at or after the
  fault's first step;
- ``fp_rate``: the share of trials with a false verdict -- any verdict on a clean trial, or one
  before the fault fired on a faulty trial (over clean and faulty trials together; ``clean``
  classes hold the clean trials);
- ``rank``, ``layer``, ``element``: among detected trials, the share whose first verdict at or
  after the fault names the truth's rank / layer / element exactly (trials where the truth or the
  verdict leaves it out are not counted: the share is over those that give both);
- ``latency``: steps from the fault's first firing to that first verdict (median and max).

A detector run offline over a campaign's trials is a Python callable ``module:function`` (or
``path/file.py:function``) taking one trial's per-step metrics rows (``[{"step": 0, "loss": 5.5},
...]``, from step 0: a campaign trial's steps before its injection are the golden run's) and
returning or yielding verdicts: dicts with ``step`` and optionally ``verdict``, ``rank``,
``layer``, ``element`` (see :func:`run_callable`).
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sdcscope.study.scoreboard import VERDICT_FORMAT, validate_rows

__all__ = ["CLASS_FIELDS", "score", "load_callable", "run_callable", "class_label"]

CLASS_FIELDS = ("site", "model", "pattern", "schedule")
CLEAN = "clean"
"""The class of clean trials (no fault)."""


def class_label(truth: dict[str, Any], fields: tuple[str, ...] = CLASS_FIELDS) -> str:
    if not truth["fault"]:
        return CLEAN
    return " x ".join(str(truth.get(f)) for f in fields)


def _same_element(truth: Any, verdict: Any, shape: list[int] | None = None) -> bool | None:
    """Whether the verdict names the truth's element: equal flat indices, or equal multi-indices
    (a verdict's null coordinates are unknown and not compared; a one-coordinate multi-index is a
    flat index). A flat truth and a verdict's multi-index compare on the coordinates ``shape`` (the
    truth's known trailing dimensions) gives, aligned from the last; None when nothing can be
    compared (one side missing, or no coordinate both sides know)."""
    truth, verdict = (x[0] if isinstance(x, list) and len(x) == 1 else x for x in (truth, verdict))
    if truth is None or verdict is None:
        return None
    if isinstance(truth, int) and isinstance(verdict, int):
        return truth == verdict
    if isinstance(truth, int):  # a flat index against a multi-index: unravel what the shape knows
        if isinstance(verdict, int) or not shape or len(shape) > len(verdict):
            return None
        coords, rest = [], truth
        for d in reversed(shape):
            coords.insert(0, rest % d)
            rest //= d
        lead = verdict[: len(verdict) - len(shape)]
        if len(shape) == len(verdict) and rest:
            return False  # beyond the tensor: not the element
        if any(v is not None for v in lead):
            return None  # the verdict names leading coordinates the truth cannot place
        truth, verdict = coords, verdict[len(lead) :]
    if isinstance(verdict, int) or len(truth) != len(verdict):
        return None if isinstance(verdict, int) else False
    if all(v is None for v in verdict):
        return None
    return all(v is None or v == t for t, v in zip(truth, verdict))


def score(
    truth: list[dict[str, Any]],
    verdicts: list[dict[str, Any]],
    fields: tuple[str, ...] = CLASS_FIELDS,
    detectors: Iterable[str] = (),
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{detector: {class: measures}}`` (see the module doc); ``"all"`` sums every faulty class.
    Every detector (those of ``verdicts`` and those named in ``detectors``, which may have said
    nothing) is scored on every trial of ``truth``: a trial it said nothing about is a miss (or a
    correct silence)."""
    by_trial = {t["trial"]: t for t in truth}
    unknown = sorted({v["trial"] for v in verdicts} - set(by_trial))
    if unknown:
        raise ValueError(f"verdicts name trial(s) the truth does not hold: {', '.join(unknown[:5])}")
    said: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for v in sorted(verdicts, key=lambda v: v["step"]):
        said[v["detector"]][v["trial"]].append(v)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for detector in dict.fromkeys([*detectors, *said]):
        per_trial = said.get(detector, {})
        tallies: dict[str, dict[str, Any]] = defaultdict(_tally)
        for t in truth:
            said_here = per_trial.get(t["trial"], [])
            for label in (class_label(t, fields), "all") if t["fault"] else (CLEAN,):
                _count(tallies[label], t, said_here)
        out[detector] = {label: _measures(tally) for label, tally in sorted(tallies.items())}
    return out


def _tally() -> dict[str, Any]:
    return {"trials": 0, "fired": 0, "detected": 0, "false": 0, "latency": [], "rank": [], "layer": [], "element": []}


def _count(tally: dict[str, Any], t: dict[str, Any], said: list[dict]) -> None:
    tally["trials"] += 1
    start = t["step"] if t["fault"] else None
    if not t["fault"]:
        tally["false"] += bool(said)
        return
    if start is None:  # the fault never fired: nothing to detect; a verdict is a false one
        tally["false"] += bool(said)
        return
    tally["fired"] += 1
    tally["false"] += any(v["step"] < start for v in said)
    hit = next((v for v in said if v["step"] >= start), None)
    if hit is None:
        return
    tally["detected"] += 1
    tally["latency"].append(hit["step"] - start)
    for key in ("rank", "layer"):
        if t[key] is not None and hit[key] is not None:
            tally[key].append(hit[key] == t[key])
    same = _same_element(t["element"], hit["element"], t.get("shape"))
    if same is not None:
        tally["element"].append(same)


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _measures(t: dict[str, Any]) -> dict[str, Any]:
    lat = t["latency"]
    return {
        "trials": t["trials"],
        "fired": t["fired"],
        "detected": t["detected"],
        "recall": t["detected"] / t["fired"] if t["fired"] else None,
        "false": t["false"],
        "fp_rate": t["false"] / t["trials"] if t["trials"] else None,
        "rank": _share(t["rank"]),
        "layer": _share(t["layer"]),
        "element": _share(t["element"]),
        "localized": {k: len(t[k]) for k in ("rank", "layer", "element")},
        "latency_median": statistics.median(lat) if lat else None,
        "latency_max": max(lat) if lat else None,
    }


def load_callable(ref: str) -> Callable[[list[dict[str, Any]]], Iterable[dict[str, Any]]]:
    """The function ``ref`` names: ``package.module:function`` or ``path/to/file.py:function``."""
    module_name, sep, func = ref.rpartition(":")
    if not sep or not module_name or not func:
        raise ValueError(f"detector {ref!r} must be MODULE:FUNCTION or FILE.py:FUNCTION")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"detector {ref!r}: no file {module_name!r}")
        spec = importlib.util.spec_from_file_location(f"sdcscope_detector_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"detector {ref!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"detector {ref!r}: {module_name!r} has no function {func!r}")
    return fn


def run_callable(
    fn: Callable[[list[dict[str, Any]]], Iterable[dict[str, Any]]], name: str, metrics: dict[str, list[dict]]
) -> list[dict[str, Any]]:
    """Verdict rows of detector ``fn`` (named ``name``) run on each trial's metrics rows; its
    outputs are validated like a verdicts file (a clear error names the trial and the field)."""
    rows = []
    for trial, steps in metrics.items():
        found = []
        for v in fn([dict(s) for s in steps]) or ():
            if not isinstance(v, dict):
                raise TypeError(f"detector {name!r} on trial {trial!r} returned {v!r}; verdicts are dicts with 'step'")
            found.append({"format": VERDICT_FORMAT, "verdict": name, **v, "trial": trial, "detector": name})
        rows += validate_rows(found, VERDICT_FORMAT, f"detector {name!r} on trial {trial!r}")
    return rows
