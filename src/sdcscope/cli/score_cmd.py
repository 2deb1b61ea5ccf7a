"""``sdcscope score``: the detector scoreboard over a campaign (or run directories, or files).

    sdcscope score runs/camp-minimal runs/camp-balanced runs/camp-full \\
        --detector examples/zscore_detector.py:detect --json scores.json
    sdcscope score truth.jsonl verdicts.jsonl

Each source is a campaign directory (its trials are the truth, its guard's events the verdicts of
a detector named after its profile), a run directory (one trial), or a JSON-lines file of truth or
verdict rows (``docs/study.md``). Campaigns of the same fault space under other guards add their
verdicts to the first one's truth. ``--detector MODULE:FUNCTION`` runs a callable offline on every
trial's per-step losses (campaign sources only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import CLIError, out_console, path_argument, path_option, user_errors


def _load(sources: list[Path]):
    """``(truth, verdicts, per-step losses, detectors)`` of the sources, truth paired across campaigns."""
    from sdcscope.common.io import read_jsonl
    from sdcscope.study.scoreboard import TRUTH_FORMAT, VERDICT_FORMAT, from_campaign, from_run, validate_rows

    truth: list[dict] | None = None
    verdicts: list[dict] = []
    losses: dict[str, list[dict]] = {}
    detectors: list[str] = []
    for src in sources:
        if src.is_dir() and (src / "campaign.yaml").is_file():
            t, v, info = from_campaign(src)
            if info["profile"] is None:
                out_console.print(f"{src}: an unguarded campaign: its trials are truth, it has no verdicts")
            else:
                detectors.append(info["profile"])
            losses = losses or info["losses"]
        elif src.is_dir():
            t, v = from_run(src)
        elif src.is_file():
            rows = read_jsonl(src)
            fmt = rows[0].get("format") if rows and isinstance(rows[0], dict) else None
            if fmt not in (TRUTH_FORMAT, VERDICT_FORMAT):
                raise CLIError(
                    f"{str(src)!r}: its first row's format is {fmt!r}; expected {TRUTH_FORMAT} or {VERDICT_FORMAT}"
                )
            rows = validate_rows(rows, fmt, str(src))
            t, v = (rows, []) if fmt == TRUTH_FORMAT else (None, rows)
        else:
            raise CLIError(f"{str(src)!r} does not exist")
        if t is not None:
            if truth is None:
                truth = t
            elif src.is_dir() and (src / "campaign.yaml").is_file():
                if {r["trial"] for r in t} != {r["trial"] for r in truth}:
                    raise CLIError(f"{str(src)!r} holds other trials than the first campaign: not the same fault space")
            else:
                truth += t
        verdicts += v
    if truth is None:
        raise CLIError("no ground truth: give a campaign or run directory, or a truth file")
    return truth, verdicts, losses, detectors


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


@app.command()
def score(
    sources: list[Path] = path_argument(..., help="Campaign or run directories, truth or verdict JSONL files."),
    detector: Optional[list[str]] = typer.Option(
        None, "--detector", "-d", help="A callable MODULE:FUNCTION (or FILE.py:FUNCTION) run on each trial's losses."
    ),
    by: str = typer.Option("site,model,pattern,schedule", "--by", help="Truth fields that make a fault class."),
    json_out: Optional[Path] = path_option(None, "--json", help="Write the scores as JSON."),
    export: Optional[Path] = path_option(None, "--export", help="Write truth.jsonl and verdicts.jsonl to this folder."),
) -> None:
    """Recall, false positives, localization (rank, layer, element) and latency of every detector, per fault class."""
    with user_errors():
        from sdcscope.common.io import write_json
        from sdcscope.study.score import load_callable, run_callable
        from sdcscope.study.score import score as score_all
        from sdcscope.study.scoreboard import FIELDS, TRUTH_FORMAT, write_rows

        fields = tuple(f.strip() for f in by.split(",") if f.strip())
        allowed = [f for f in FIELDS[TRUTH_FORMAT] if f not in ("trial", "fault")]
        bad = [f for f in fields if f not in allowed]
        if bad or not fields:
            raise CLIError(f"--by {by!r}: unknown field(s) {bad}; allowed: {', '.join(allowed)}")
        callables = {ref.rpartition(":")[2]: load_callable(ref) for ref in detector or ()}  # before any work
        truth, verdicts, losses, detectors = _load(sources)
        if callables and not losses:
            raise CLIError("--detector runs on a campaign's per-step losses: give a campaign directory")
        for name, fn in callables.items():
            detectors.append(name)
            verdicts += run_callable(fn, name, losses)
        scores = score_all(truth, verdicts, fields, detectors)
        if export is not None:
            write_rows(export / "truth.jsonl", truth)
            write_rows(export / "verdicts.jsonl", verdicts)
        if json_out is not None:
            write_json(json_out, {"by": list(fields), "scores": scores})
    _table(scores, len(truth))
    for path in (json_out, export):
        if path is not None:
            out_console.print(f"wrote {path}")


def _table(scores: dict, n: int) -> None:
    from rich.table import Table

    table = Table(title=f"detector scoreboard ({n} trials)")
    for col in ("detector", "fault class", "trials", "fired", "recall", "FP rate", "rank", "layer", "element"):
        table.add_column(col, justify="left" if col in ("detector", "fault class") else "right")
    table.add_column("latency (median / max)", justify="right")
    for det, per_class in scores.items():
        for label, m in sorted(per_class.items(), key=lambda kv: (kv[0] in ("all", "clean"), kv[0])):
            lat = "-" if m["latency_median"] is None else f"{m['latency_median']:g} / {m['latency_max']}"
            table.add_row(
                det,
                label,
                str(m["trials"]),
                str(m["fired"]),
                _pct(m["recall"]),
                _pct(m["fp_rate"]),
                _pct(m["rank"]),
                _pct(m["layer"]),
                _pct(m["element"]),
                lat,
            )
    if not scores:
        out_console.print("no detector gave a verdict on these trials")
        return
    out_console.print(table)
