"""``sdcscope report DIR``: a self-contained ``report.html`` (figures inlined as PNG) and ``report.md``.

``DIR`` is a campaign directory (``results.sqlite``) or a run directory (``config.json``,
``metrics.jsonl``, ``events.jsonl``; single-process or data-parallel). A run's report shows its
summary, per-rank timelines -- every event on its rank's lane over the steps, next to the
injected faults, vetoed steps and quarantined spans (a figure in the HTML, a table per rank in
the Markdown) -- the loss of every rank, and the event list.

A campaign's sections: outcomes (overall, by bit and site), PVF per site, layer, bit and fault model with
Wilson 95% intervals and the layer × bit and layer × site heatmaps, the healthy-spread thresholds, loss curves
golden vs faulty, parameter drift over time (level c), permanent faults evaluated with the fault
present vs removed, guard detection (coverage, latency, false positives), for
``analysis: full``, levels (a) and (b), and for node profiles the three levels per profile.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import jinja2

from sdcscope.study import drift, figures
from sdcscope.study.levels import in_target
from sdcscope.study.nodes import LEVEL_COLUMNS, NODE_NOTE, level_rows, profile_levels
from sdcscope.study.run_report import RUN_CONFIG, build_run_report
from sdcscope.study.runner import SPEC_FILE, count_plan
from sdcscope.study.spec import load_campaign
from sdcscope.study.stats import pvf_table, wilson_interval
from sdcscope.study.store import DB_FILE, ResultsDB
from sdcscope.study.tables import table as _table
from sdcscope.study.twins import envelope_curve
from sdcscope.study.worker import drift_offsets

__all__ = ["build_report", "build_run_report", "write_report", "EXPECTED_DIRECTION"]

EXPECTED_DIRECTION = {
    "activation": "forward",
    "gemm.forward": "forward",
    "weight": "forward",
    "gemm.grad_input": "backward",
    "gemm.grad_weight": "backward",
    "param_grad": "backward",
}


def _pvf_section(rows: list[dict], by: str) -> dict[str, Any]:
    t = pvf_table(rows, (by,))
    return _table(
        f"PVF by {by}",
        [by, "incorrect", "trials", "PVF", "95% interval"],
        [[r[by], r["incorrect"], r["trials"], r["pvf"], f"[{r['lo']:.3f}, {r['hi']:.3f}]"] for r in t],
        note="" if t else "no trial's fault fired (all not_fired): PVF counts only trials whose fault fired",
    )


def _permanent(rows: list[dict], refs: dict[int, dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["val_loss_fault"] is not None:
            groups[(r["site"], r["target"], r["pattern"], r["model"], r["bit"], bool(r["swizzle"]))].append(r)
    out = []  # each group averages repeats and injection steps of one fault, never two sites or patterns
    for (site, target, pattern, model, bit, swz), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        mean = lambda key: statistics.fmean(x[key] for x in rs) if all(x[key] is not None for x in rs) else None  # noqa: E731
        ref = [refs[x["inject_step"]] for x in rs]
        out.append(
            {
                "group": f"{site} {target} {pattern} {model}{'' if bit is None else f' b{bit}'}"
                f"{' swizzled' if swz else ''}",
                "n": len(rs),
                "acc_golden": statistics.fmean(x["val_acc"] for x in ref)
                if all(x["val_acc"] is not None for x in ref)
                else None,
                "acc_fault": mean("val_acc_fault"),
                "acc_removed": mean("val_acc"),
                "loss_golden": statistics.fmean(x["val_loss"] for x in ref),
                "loss_fault": mean("val_loss_fault"),
                "loss_removed": mean("val_loss"),
            }
        )
    return out


def _levels(rows: list[dict]) -> list[dict[str, Any]]:
    tables = []
    located = [r for r in rows if r["first_divergence"] is not None or r["lockstep"] is not None]
    if located:
        hits = [
            r
            for r in located
            if r["first_divergence"]
            and in_target(r["first_divergence"]["module"], r["target"])  # a group: any of its modules
            and r["first_divergence"]["direction"] == EXPECTED_DIRECTION.get(r["site"])
        ]
        active = [r for r in located if r["activated"]]
        lo, hi = wilson_interval(len(hits), len(active)) if active else (None, None)
        freq: dict[tuple, list[float]] = defaultdict(list)
        sev: dict[tuple, list[float]] = defaultdict(list)
        for r in located:
            for module, dirs in (r["lockstep"] or {}).items():
                for direction, stats in dirs.items():
                    freq[(module, direction)].append(stats["frequency"])
                    sev[(module, direction)].append(stats["severity"])
        tables.append(
            _table(
                "Level (a): submodule lock-step at the injection step",
                ["submodule", "direction", "trials with a mismatch", "mean mismatch frequency", "mean severity"],
                [
                    [m, d, len(freq[(m, d)]), statistics.fmean(freq[(m, d)]), statistics.fmean(sev[(m, d)])]
                    for m, d in sorted(freq)
                ],
                note=f"first divergence = injected module and direction in {len(hits)}/{len(active)} activated trials"
                + (f" (95% interval [{lo:.3f}, {hi:.3f}])" if active else ""),
            )
        )
    with_nsr = [r for r in rows if r["nsr_max"] is not None]
    if with_nsr:
        by_site: dict[str, list[float]] = defaultdict(list)
        for r in with_nsr:
            by_site[r["site"]].append(r["nsr_max"])
        tables.append(
            _table(
                "Level (b): gradient noise-to-signal ratio, parameters re-synchronized every step",
                ["site", "trials", "median of worst-step NSR", "max NSR"],
                [[s, len(v), statistics.median(v), max(v)] for s, v in sorted(by_site.items())],
            )
        )
    return tables


def _threshold_note(thresholds: list[dict]) -> str:
    """The rule of each kind of threshold row: the healthy spread's, and the twins' envelope
    (``dist_twin``, whose mean and sd columns are the twins' geometric mean and sd of log d)."""
    notes = {}
    for t in thresholds:
        twin = t["measure"] == "dist_twin"
        what = "dist_twin (the chaos envelope; mean: geometric, sd: of log distance)" if twin else "bound"
        notes.setdefault(what, f"{what} = {t['rule']} (alpha {t['alpha']})")
    return "; ".join(notes.values())


def build_report(directory: str | Path) -> dict[str, Any]:
    """Everything the report shows (tables as text cells, figures as base64 PNG)."""
    directory = Path(directory)
    if not (directory / DB_FILE).is_file():
        if (directory / RUN_CONFIG).is_file():
            return build_run_report(directory)
        raise FileNotFoundError(
            f"{str(directory)!r} holds no {DB_FILE} (a campaign: run `sdcscope campaign run "
            f"{directory}` first) and no {RUN_CONFIG} (a run directory: `sdcscope train --out`)"
        )
    spec = load_campaign(directory / SPEC_FILE)
    with ResultsDB(directory / DB_FILE, spec) as db:
        rows, baselines, refs, twins = db.trials(), db.baselines(), db.references(), db.twins()
        golden, thresholds, bounds = db.golden_losses(), db.threshold_rows(), db.thresholds()
        planned = db.plan_size if db.plan_size is not None and not db.extended else count_plan(spec, db)
    if not rows:
        raise ValueError(f"{str(directory)!r} has no finished trials yet: run `sdcscope campaign run {directory}`")
    counts = Counter(figures.label(r) for r in rows)
    tables = [
        _table(
            "Outcomes",
            ["outcome", "trials", "share"],
            [[k, v, v / len(rows)] for k, v in counts.most_common()],
            note="masked: bitwise-identical parameters or no value changed; benign: within healthy "
            "variance; sdc:sharp loss spike, sdc:slow worse validation loss, sdc:drift parameters "
            "away from the golden twin beyond the chaos floor (perturbation twins) or beyond healthy "
            "re-seeded runs (see drift below)",
        )
    ]
    tables.append(
        _table(
            "Healthy-spread thresholds",
            ["inject step", "measure", "bound", "healthy mean", "healthy sd", "healthy max", "K"],
            [[t["inject_step"], t["measure"], t["bound"], t["mean"], t["sd"], t["max"], t["n"]] for t in thresholds],
            note=_threshold_note(thresholds),
        )
    )
    dims = ["site", "target", "bit", "model"] + [
        d for d in ("pattern", "schedule", "swizzle") if len({r[d] for r in rows}) > 1
    ]
    tables += [_pvf_section(rows, d) for d in dims if any(r[d] is not None for r in rows)]
    figs = {
        "outcomes by bit": figures.outcome_bars(rows, "bit", "outcomes by bit")
        if any(r["bit"] is not None for r in rows)
        else None,
        "outcomes by site": figures.outcome_bars(rows, "site", "outcomes by site"),
        "PVF layer × bit": figures.pvf_heatmap(rows) if any(r["bit"] is not None for r in rows) else None,
        "PVF layer × site": figures.site_heatmap(rows),
        "loss curves": figures.loss_curves(golden, rows, baselines),
        "drift": figures.drift_curves(rows, baselines, drift_offsets(spec.horizon)),
    }
    base = spec.baseline
    envelopes = {
        s: envelope_curve([t for t in twins if t["inject_step"] == s], base.alpha, base.twin_margin)
        for s in sorted({t["inject_step"] for t in twins})
    }
    figs["drift against the exact twin"] = drift.drift_figure(
        rows, baselines, drift_offsets(spec.horizon), twins, envelopes
    )
    tables.append(_table(*drift.drift_section(rows, baselines, twins)))
    permanent = _permanent(rows, refs)
    if permanent:
        tables.append(
            _table(
                "Permanent faults: validation with the fault present vs removed",
                [
                    "group",
                    "trials",
                    "golden acc",
                    "acc, fault present",
                    "acc, fault removed",
                    "golden loss",
                    "loss, fault present",
                    "loss, fault removed",
                ],
                [
                    [
                        g["group"],
                        g["n"],
                        g["acc_golden"],
                        g["acc_fault"],
                        g["acc_removed"],
                        g["loss_golden"],
                        g["loss_fault"],
                        g["loss_removed"],
                    ]
                    for g in permanent
                ],
            )
        )
        figs["fault present vs removed"] = figures.fault_present_bars(permanent)
    if spec.guard:
        active = [r for r in rows if r["activated"]]
        detected = [r for r in active if r["detected"]]
        fp = [b for b in baselines if b["guard_events"]]
        lat = [r["latency"] for r in detected if r["latency"] is not None]
        by = Counter(r["detector"] or "?" for r in detected)
        tables.append(
            _table(
                "Guard",
                ["measure", "value"],
                [
                    ["guard profile", spec.guard_profile],
                    ["detection coverage (detected / activated)", f"{len(detected)}/{len(active)}"],
                    ["first detector (detected trials)", ", ".join(f"{k} {n}" for k, n in sorted(by.items())) or None],
                    ["median detection latency (steps)", statistics.median(lat) if lat else None],
                    ["false-positive rate (healthy runs with an event)", f"{len(fp)}/{len(baselines)}"],
                ],
            )
        )
        figs["detection latency"] = figures.latency_hist(rows)
    tables += _levels(rows)
    if any(r["profile"] for r in rows):
        tables.append(
            _table(
                "Node profiles: the three levels",
                LEVEL_COLUMNS,
                level_rows(profile_levels(rows, bounds)),
                note=NODE_NOTE,
            )
        )
    return {
        "name": spec.name,
        "hash": spec.hash,
        "spec": spec.to_dict(),
        "guard": f"on, profile {spec.guard_profile}" if spec.guard else "off",
        "done": len(rows),
        "planned": planned,
        "tables": tables,
        "figures": {k: v for k, v in figs.items() if v is not None},
    }


_HTML = jinja2.Template(
    """<!doctype html>
<html><head><meta charset="utf-8"><title>sdcscope {{ "run" if r.kind == "run" else "campaign" }} {{ r.name }}</title>
<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:right}th{background:#f0f0f0}
td:first-child{text-align:left}.note{color:#555;font-size:12px}img{max-width:100%}</style></head><body>
{% if r.kind == "run" %}<h1>Run {{ r.name }}</h1>
<p>{{ r.line }}</p>
{% else %}<h1>Campaign {{ r.name }}</h1>
<p>{{ r.done }}/{{ r.planned }} trials · workload {{ r.spec.workload.name }}/{{ r.spec.workload.preset }} ·
injection steps {{ r.spec.inject_steps }} · horizon {{ r.spec.horizon }} · guard {{ r.guard }} ·
analysis {{ r.spec.analysis }} · spec hash <code>{{ r.hash[:12] }}</code></p>
{% endif %}
{% for name, png in r.figures.items() %}<h3>{{ name }}</h3><img alt="{{ name }}" src="data:image/png;base64,{{ png }}">
{% endfor %}
{% for t in r.tables %}<h2>{{ t.title }}</h2>{% if t.note %}<p class="note">{{ t.note }}</p>{% endif %}
<table><tr>{% for h in t.headers %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}</table>
{% endfor %}</body></html>
""",
    autoescape=True,
)


def _markdown(r: dict[str, Any]) -> str:
    if r.get("kind") == "run":
        lines = [f"# Run {r['name']}", "", f"{r['line']}; figures in report.html.", ""]
    else:
        lines = [
            f"# Campaign {r['name']}",
            "",
            f"{r['done']}/{r['planned']} trials; spec hash `{r['hash'][:12]}`; figures in report.html.",
            "",
        ]
    for t in r["tables"]:
        lines += [f"## {t['title']}", ""] + ([t["note"], ""] if t["note"] else [])
        lines += ["| " + " | ".join(t["headers"]) + " |", "|" + "---|" * len(t["headers"])]
        lines += ["| " + " | ".join(row) + " |" for row in t["rows"]] + [""]
    return "\n".join(lines)


def write_report(
    directory: str | Path, data: dict[str, Any] | None = None, out: str | Path | None = None
) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into the campaign (or run) directory, or into
    ``out``; ``data``: its :func:`build_report`, built here when not given. Both are rendered
    first, then written atomically: a failed write leaves no half-written report."""
    from sdcscope.common.io import write_text_atomic
    from sdcscope.common.storage import writing

    directory = Path(directory)
    data = build_report(directory) if data is None else data
    target = directory if out is None else Path(out)
    html, md = target / "report.html", target / "report.md"
    texts = {html: _HTML.render(r=data), md: _markdown(data)}
    for path, text in texts.items():
        with writing("the report", path):
            write_text_atomic(path, text)
    return html, md
