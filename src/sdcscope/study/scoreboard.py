"""The detector scoreboard's two neutral JSON-lines formats, their validator, and converters from
sdcscope run and campaign directories.

**Ground truth** (``sdcscope.truth/1``): one row per trial -- what the injector did::

    {"format": "sdcscope.truth/1", "trial": "trial-3", "fault": true, "step": 5, "site": "gemm.forward",
     "model": "bitflip", "pattern": "element(index=random)", "schedule": "transient", "bit": 30,
     "rank": 0, "layer": "blocks.0.mlp.fc", "element": 17}

``fault`` false is a clean trial (every other field null): any verdict on it is a false positive.
``step`` is the first training step the fault fired at (null: it never fired; such a trial is
left out of recall). ``element`` is a flat (row-major) index, or a multi-index, into the
corrupted tensor; ``shape`` (optional) its trailing dimensions as far as known (all of them for a
parameter-shaped site), so that a flat index can be compared with a detector's multi-index.

**Verdicts** (``sdcscope.verdict/1``): one row per finding of a detector::

    {"format": "sdcscope.verdict/1", "trial": "trial-3", "detector": "balanced", "step": 5,
     "verdict": "abft:checksum_mismatch", "rank": 0, "layer": "blocks.0.mlp.fc", "element": [0, 2, 5]}

``rank``, ``layer`` and ``element`` may be null (not localized). Both formats are versioned by
their ``format`` field; :func:`validate_rows` names the line and field of any bad value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdcscope.common.io import dumps, read_jsonl, write_text_atomic
from sdcscope.common.storage import writing

__all__ = [
    "TRUTH_FORMAT",
    "VERDICT_FORMAT",
    "TRIALS_DIR",
    "validate_rows",
    "load_rows",
    "write_rows",
    "truth_row",
    "verdict_rows",
    "from_run",
    "from_campaign",
    "trial_name",
    "baseline_name",
    "known_shape",
]

TRUTH_FORMAT = "sdcscope.truth/1"
VERDICT_FORMAT = "sdcscope.verdict/1"
TRIALS_DIR = "trials"
"""A campaign directory's folder of per-trial files (``sdcscope.study.worker``)."""
NOT_FINDINGS = {("guard", "stopped"), ("guard", "stalled"), ("guard", "internal_error")}
"""Guard events that report the guard's own state, not a finding about the run."""

_STR = (str, type(None))
_INT = (int, type(None))
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    TRUTH_FORMAT: {
        "trial": (str,),
        "fault": (bool,),
        "step": _INT,
        "site": _STR,
        "model": _STR,
        "pattern": _STR,
        "schedule": _STR,
        "bit": _INT,
        "rank": _INT,
        "layer": _STR,
        "element": (int, list, type(None)),
        "shape": (list, type(None)),
    },
    VERDICT_FORMAT: {
        "trial": (str,),
        "detector": (str,),
        "step": (int,),
        "verdict": (str,),
        "rank": _INT,
        "layer": _STR,
        "element": (int, list, type(None)),
    },
}
REQUIRED = {TRUTH_FORMAT: ("trial", "fault"), VERDICT_FORMAT: ("trial", "detector", "step", "verdict")}


def trial_name(trial_id: int) -> str:
    return f"trial-{trial_id}"


def baseline_name(step: int, seed: int) -> str:
    return f"baseline-{step}-{seed}"


def validate_rows(rows: Iterable[Any], fmt: str, where: str = "rows") -> list[dict[str, Any]]:
    """``rows`` checked against ``fmt``; a ``ValueError`` names the row (1-based line), the field,
    the bad value and what is allowed. Missing optional fields read as null."""
    if fmt not in FIELDS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FIELDS)}")
    fields, out = FIELDS[fmt], []
    for n, row in enumerate(rows, 1):
        at = f"{where}, line {n}"
        if not isinstance(row, dict):
            raise ValueError(f"{at}: a row must be a JSON object, not {row!r}")
        if row.get("format") != fmt:
            raise ValueError(f"{at}: format {row.get('format')!r}; this file must hold {fmt!r} rows")
        unknown = sorted(set(row) - set(fields) - {"format"})
        if unknown:
            raise ValueError(f"{at}: unknown field(s) {unknown}; allowed: format, {', '.join(fields)}")
        for key in REQUIRED[fmt]:
            if row.get(key) is None:
                raise ValueError(f"{at}: field {key!r} is required")
        for key, kinds in fields.items():
            value = row.get(key)
            bad = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
            counts = key in ("step", "rank", "bit")
            if not bad and counts and value is not None:
                bad = value < 0
            if not bad and isinstance(value, list):
                bad = not value or not all(isinstance(i, int) and not isinstance(i, bool) or i is None for i in value)
            if bad:
                allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                what = " (>= 0)" if counts else " (a list: of integers, null where unknown)" if list in kinds else ""
                raise ValueError(f"{at}: field {key!r} = {value!r}; allowed: {allowed}{what}")
        if fmt == TRUTH_FORMAT and not row["fault"]:
            set_ = [k for k in fields if k not in ("trial", "fault") and row.get(k) is not None]
            if set_:
                raise ValueError(f"{at}: a clean trial (fault false) has no {', '.join(set_)}; leave them null")
        out.append({k: row.get(k) for k in ("format", *fields)})
    return out


def load_rows(path: str | Path, fmt: str) -> list[dict[str, Any]]:
    """A scoreboard JSON-lines file, validated (see :func:`validate_rows`)."""
    return validate_rows(read_jsonl(path), fmt, str(path))


def write_rows(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """JSON lines, written atomically (folders made as needed); a write the storage refuses is a
    ``StorageError`` naming the file."""
    path = Path(path)
    with writing("the scoreboard's rows", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "".join(dumps(r) + "\n" for r in rows))
    return path


def _element(index: Any) -> int | list | None:
    if isinstance(index, list) and index:
        first = index[0]
        return first if isinstance(first, int) else list(first) if isinstance(first, list) else None
    return None


def truth_row(trial: str, records: list[dict], labels: dict[str, Any] | None) -> dict[str, Any]:
    """The truth of one trial from its injection records (``injections.jsonl``) and its fault's
    class labels (site, model, pattern, schedule, bit); ``labels`` None: a clean trial."""
    row: dict[str, Any] = {"format": TRUTH_FORMAT, **dict.fromkeys(FIELDS[TRUTH_FORMAT])}
    row.update(trial=trial, fault=labels is not None)
    if labels is None:
        return row
    row.update({k: labels.get(k) for k in ("site", "model", "pattern", "schedule", "bit")})
    fired = [r for r in records if r.get("when") != "eval"]
    if fired:
        first = min(fired, key=lambda r: (r["step"], r.get("micro_batch") or 0))
        row.update(step=first["step"], rank=first.get("rank"), layer=first.get("module"))
        row["element"] = _element(first.get("index"))
        row["shape"] = first.get("shape")
        if row["site"] is None:
            row["site"] = first.get("site")
    return row


def known_shape(model: Any, site: str, name: str) -> list[int] | None:
    """The trailing dimensions of the tensor a fault at ``site`` on ``name`` corrupts, as far as the
    model tells them: a parameter's whole shape (``weight``, ``param_grad``, ``optimizer_state``: a
    parameter's name, optionally with a state suffix; ``gemm.grad_weight``: the module's weight), a
    Linear's output or input features for its ``gemm.forward`` / ``gemm.grad_input`` (the leading
    batch dimensions are not known); None otherwise."""
    params = dict(model.named_parameters())
    match = next((p for n, p in params.items() if name == n or name.startswith(n + ".")), None)
    if site in ("weight", "param_grad", "optimizer_state") and match is not None:
        return list(match.shape)
    module = dict(model.named_modules()).get(name)
    weight = getattr(module, "weight", None)
    if weight is None or not hasattr(weight, "shape"):
        return None
    if site == "gemm.grad_weight":
        return list(weight.shape)
    if type(module).__name__ == "Linear" and site in ("gemm.forward", "gemm.grad_input"):
        return [int(weight.shape[0 if site == "gemm.forward" else 1])]
    return None


def verdict_rows(trial: str, detector: str, events: Iterable[dict]) -> list[dict[str, Any]]:
    """A detector's verdicts on one trial from sdcscope events (``events.jsonl`` records)."""
    out = []
    for e in events:
        if (e.get("detector"), e.get("verdict")) in NOT_FINDINGS or not isinstance(e.get("step"), int):
            continue
        index = e.get("index")
        out.append(
            {
                "format": VERDICT_FORMAT,
                "trial": trial,
                "detector": detector,
                "step": e["step"],
                "verdict": f"{e.get('detector')}:{e.get('verdict')}",
                "rank": e.get("rank"),
                "layer": e.get("module"),
                "element": list(index) if isinstance(index, (list, tuple)) and index else None,
            }
        )
    return out


def _read(path: Path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []


def from_run(run_dir: str | Path, detector: str | None = None) -> tuple[list[dict], list[dict]]:
    """``(truth, verdicts)`` of one run directory: a trial named after the folder; its faults'
    labels from ``config.json``; the detector named ``detector`` (default: the guard's profile)."""
    from sdcscope.common.io import read_json
    from sdcscope.study.plan import pattern_label

    run = Path(run_dir)
    config = read_json(run / "config.json") if (run / "config.json").is_file() else {}
    specs = config.get("faults") or []
    records = _read(run / "injections.jsonl")
    labels = None
    if specs:
        i = records[0].get("spec", 0) if records else 0
        spec = specs[i] if i < len(specs) else specs[0]
        bits = spec.get("bits") or [None]
        labels = {
            "site": spec.get("site"),
            "model": spec.get("model"),
            "pattern": pattern_label(spec.get("pattern") or {"kind": "element"}),
            "schedule": (spec.get("schedule") or {}).get("kind"),
            "bit": bits[0] if len(bits) == 1 else None,
        }
    name = detector or ((config.get("guard") or {}).get("profile")) or "sdcscope"
    return [truth_row(run.name, records, labels)], verdict_rows(run.name, name, _read(run / "events.jsonl"))


def _schedule_kind(label: str | None) -> str | None:
    return None if label is None else label.split("(")[0]


def from_campaign(directory: str | Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """``(truth, verdicts, info)`` of a campaign directory: one truth row per trial (trials named by
    their plan key, so campaigns of the same fault space under other guards pair up) and per healthy
    baseline (a clean trial); the guard's verdicts, named after its profile, when it was guarded;
    ``info``: the profile, and each trial's per-step losses from step 0 (``{trial: [{"step", "loss"},
    ...]}``) for detectors run offline."""
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import DB_FILE, ResultsDB

    directory = Path(directory)
    spec = load_campaign(directory / "campaign.yaml")
    with ResultsDB(directory / DB_FILE, spec) as db:
        rows, baselines, golden = db.trials(), db.baselines(), db.golden_losses()
    profile = (spec.guard or {}).get("profile") if spec.guard else None
    truth, verdicts, losses = [], [], {}
    for r in rows:
        name = r["key"]
        where = directory / TRIALS_DIR / trial_name(r["trial_id"])
        labels = {
            "site": r["site"],
            "model": r["model"],
            "pattern": r["pattern"],
            "schedule": _schedule_kind(r["schedule"]),
            "bit": r["bit"],
        }
        row = truth_row(name, _read(where / "injections.jsonl"), labels)
        if row["step"] is None and r.get("fired"):  # a campaign without per-trial files: what the row says
            row.update(step=r["inject_step"], rank=0, layer=r["target"])
        truth.append(row)
        if profile is not None:
            verdicts += verdict_rows(name, profile, _read(where / "events.jsonl"))
        losses[name] = _steps(golden, r["inject_step"], r.get("losses"))
    for b in baselines:
        name = baseline_name(b["inject_step"], b["seed"])
        truth.append(truth_row(name, [], None))
        if profile is not None:
            verdicts += verdict_rows(name, profile, _read(directory / TRIALS_DIR / name / "events.jsonl"))
        losses[name] = _steps(golden, b["inject_step"], b.get("losses"))
    return truth, verdicts, {"profile": profile, "losses": losses, "name": spec.name}


def _steps(golden: list[float], first: int, losses: list | None) -> list[dict[str, Any]]:
    """Per-step metrics rows of a trial: the golden run's losses before its injection step (the
    trial restored the golden run there, so they are its own history), then its own."""
    out = []
    for i, x in enumerate([*golden[:first], *(losses or [])]):
        x = float(x) if isinstance(x, (int, float)) else float("nan")
        out.append({"step": i, "loss": x if math.isfinite(x) else None})
    return out
