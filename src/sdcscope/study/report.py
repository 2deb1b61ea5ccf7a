"""``sdcscope report DIR``: a self-contained ``report.html`` (figures inlined as PNG) and ``report.md``.

``DIR`` is a campaign directory (``results.sqlite``) or a run directory (``config.json``,
``metrics.jsonl``, ``events.jsonl``; single-process or data-parallel). A run's report shows its
summary, per-rank timelines -- every event on its rank's lane over the steps, next to the
injected faults, vetoed steps and quarantined spans (a figure in the HTML, a table per rank in
the Markdown) -- the loss of every rank, and the event list.

A campaign's sections: outcomes (overall, by bit and site), PVF per site, layer, bit and fault model with
Wilson 95% intervals and the layer × bit heatmap, the healthy-spread thresholds, loss curves
golden vs faulty, parameter drift over time (level c), permanent faults evaluated with the fault
present vs removed, guard detection (coverage, latency, false positives) and, for
``analysis: full``, levels (a) and (b).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import jinja2

from sdcscope.common.io import read_json, read_jsonl
from sdcscope.detect.events import actions_of
from sdcscope.study import figures
from sdcscope.study.runner import SPEC_FILE
from sdcscope.study.spec import load_campaign
from sdcscope.study.stats import pvf_table, wilson_interval
from sdcscope.study.store import DB_FILE, ResultsDB
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


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(title: str, headers: list[str], rows: list[list[Any]], note: str = "") -> dict[str, Any]:
    return {"title": title, "headers": headers, "rows": [[_fmt(v) for v in r] for r in rows], "note": note}


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
            and r["first_divergence"]["module"] == r["target"]
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
        rows, baselines, refs = db.trials(), db.baselines(), db.references()
        golden, thresholds, meta = db.golden_losses(), db.threshold_rows(), db.meta()
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
            "beyond healthy re-seeded runs",
        )
    ]
    tables.append(
        _table(
            "Healthy-spread thresholds",
            ["inject step", "measure", "bound", "healthy mean", "healthy sd", "healthy max", "K"],
            [[t["inject_step"], t["measure"], t["bound"], t["mean"], t["sd"], t["max"], t["n"]] for t in thresholds],
            note=f"bound = {thresholds[0]['rule']} (alpha {thresholds[0]['alpha']})",
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
        "loss curves": figures.loss_curves(golden, rows, baselines),
        "drift": figures.drift_curves(rows, baselines, drift_offsets(spec.horizon)),
    }
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
        tables.append(
            _table(
                "Guard",
                ["measure", "value"],
                [
                    ["detection coverage (detected / activated)", f"{len(detected)}/{len(active)}"],
                    ["median detection latency (steps)", statistics.median(lat) if lat else None],
                    ["false-positive rate (healthy runs with an event)", f"{len(fp)}/{len(baselines)}"],
                ],
            )
        )
        figs["detection latency"] = figures.latency_hist(rows)
    tables += _levels(rows)
    return {
        "name": spec.name,
        "hash": spec.hash,
        "spec": spec.to_dict(),
        "done": len(rows),
        "planned": meta.get("plan_size"),
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
injection steps {{ r.spec.inject_steps }} · horizon {{ r.spec.horizon }} · guard {{ r.spec.guard }} ·
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


def write_report(directory: str | Path, data: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into the campaign (or run) directory; ``data``: its
    :func:`build_report`, built here when not given."""
    directory = Path(directory)
    data = build_report(directory) if data is None else data
    html, md = directory / "report.html", directory / "report.md"
    html.write_text(_HTML.render(r=data), encoding="utf-8")
    md.write_text(_markdown(data), encoding="utf-8")
    return html, md


# ---------------------------------------------------------------------------- run directories

RUN_CONFIG = "config.json"
ACTION_COLORS = {
    "rollback": "#8e24aa",
    "quarantine": "#212121",
    "veto": "#e53935",
    "recompute": "#1565c0",
    "skip_batch": "#fb8c00",
    "lr_backoff": "#fdd835",
    "report": "#9e9e9e",
}
MAX_LISTED = 200


def _first_action(event: dict) -> str:
    actions = actions_of(event)
    return next((a for a in ACTION_COLORS if a in actions), "report")


def _lane(rank: Any) -> str:
    return "world" if rank is None else f"rank {rank}"


def _run_events(directory: Path) -> list[dict]:
    """The world's events (``events.jsonl``) and each rank's own reports (``events.rank*.jsonl``)."""
    events = read_jsonl(directory / "events.jsonl")
    for path in sorted(directory.glob("events.rank*.jsonl")):
        events += read_jsonl(path)
    return sorted(events, key=lambda e: (e.get("step", 0), -1 if e.get("rank") is None else e["rank"]))


def _quarantine_spans(metrics: list[dict]) -> dict[int, int]:
    """The first step each rank was quarantined at, from the metrics rows."""
    first: dict[int, int] = {}
    for m in metrics:
        for r in m.get("quarantined") or []:
            first.setdefault(int(r), int(m["step"]))
    return first


def _lane_of(rank: Any, world: int) -> Any:
    """The timeline lane of an event's rank: its rank, or None (the world) for a finding about every
    rank at once; a single process's events are rank 0's."""
    return rank if rank in range(world) else (0 if world == 1 else None)


def _timeline_figure(
    lanes: list[Any],
    events: list[dict],
    injections: list[dict],
    metrics: list[dict],
    quarantined: dict[int, int],
    steps: int,
    world: int,
) -> str:
    fig, ax = figures.plt.subplots(figsize=(9, 1.2 + 0.55 * len(lanes)))
    y = {lane: i for i, lane in enumerate(lanes)}
    for m in metrics:
        if m.get("skipped"):
            ax.axvspan(m["step"] - 0.5, m["step"] + 0.5, color="#ffcdd2", alpha=0.6, lw=0)
    for r, start in quarantined.items():
        if r in y:
            ax.barh(y[r], steps - start, left=start - 0.5, height=0.6, color="#424242", alpha=0.18)
    for inj in injections:
        if _lane_of(inj.get("rank"), world) in y:
            ax.scatter(
                inj["step"],
                y[_lane_of(inj.get("rank"), world)] + 0.25,
                marker="v",
                s=40,
                facecolors="none",
                edgecolors="#1565c0",
            )
    seen = set()
    for e in events:
        lane = _lane_of(e.get("rank"), world)
        action = _first_action(e)
        ax.scatter(
            e["step"],
            y[lane],
            s=55,
            color=ACTION_COLORS[action],
            edgecolors="white",
            zorder=3,
            label=None if action in seen else action,
        )
        seen.add(action)
    if injections:
        ax.scatter([], [], marker="v", facecolors="none", edgecolors="#1565c0", label="injected fault")
    ax.set_yticks(range(len(lanes)), [_lane(lane) for lane in lanes])
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlim(-0.5, max(steps, 1) - 0.5)
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title("per-rank timeline (events by action; red band: vetoed step; grey bar: quarantined)")
    if seen or injections:
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    return figures._png(fig)


def _rank_loss_figure(metrics: list[dict], world: int) -> str | None:
    rows = [m for m in metrics if isinstance(m.get("loss"), (int, float))]
    if not rows:
        return None
    fig, ax = figures.plt.subplots(figsize=(7, 3.2))
    if world > 1 and any("rank_loss" in m for m in rows):
        for r in range(world):
            pts = [
                (m["step"], m["rank_loss"][r])
                for m in rows
                if "rank_loss" in m and isinstance(m["rank_loss"][r], (int, float))
            ]
            ax.plot(*zip(*pts), lw=0.9, label=f"rank {r}") if pts else None
    ax.plot([m["step"] for m in rows], [m["loss"] for m in rows], color="black", lw=1.6, label="world mean")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss per rank")
    ax.legend(fontsize=7)
    return figures._png(fig)


def build_run_report(directory: str | Path) -> dict[str, Any]:
    """The report of one run directory: summary, per-rank timelines, loss per rank, events."""
    directory = Path(directory)
    config = read_json(directory / RUN_CONFIG)
    summary = read_json(directory / "summary.json") if (directory / "summary.json").is_file() else {}
    metrics = read_jsonl(directory / "metrics.jsonl")
    events = _run_events(directory)
    injections = read_jsonl(directory / "injections.jsonl")
    failures = [read_json(p) for p in sorted(directory.glob("failure.rank*.json"))]
    world = int(config.get("world_size") or summary.get("world_size") or 1)
    steps = int(summary.get("steps") or (metrics[-1]["step"] + 1 if metrics else config.get("steps") or 0))
    ledger = read_json(directory / "ledger.json").get("devices", {}) if (directory / "ledger.json").is_file() else {}
    devices = {d.get("rank"): name for name, d in ledger.items()}
    quarantined = _quarantine_spans(metrics)
    lanes: list[Any] = list(range(world))
    if any(_lane_of(e.get("rank"), world) is None for e in events):
        lanes.append(None)

    timeline = []
    per_rank_tables = []
    for lane in lanes:
        mine = [e for e in events if _lane_of(e.get("rank"), world) == lane]
        faults = [i for i in injections if lane is not None and _lane_of(i.get("rank"), world) == lane]
        kinds = Counter(f"{e['detector']}:{e['verdict']}" for e in mine)
        actions = Counter(a for e in mine for a in actions_of(e))
        timeline.append(
            [
                _lane(lane),
                devices.get(lane),
                len(faults),
                len(mine),
                len({e["step"] for e in mine}),
                min((e["step"] for e in mine), default=None),
                max((e["step"] for e in mine), default=None),
                ", ".join(f"{k} ×{v}" for k, v in kinds.most_common()) or None,
                ", ".join(f"{k} ×{v}" for k, v in actions.most_common()) or None,
                quarantined.get(lane) if lane is not None else None,
            ]
        )
        if mine or faults:
            rows = [
                [
                    i["step"],
                    "fault",
                    i.get("site"),
                    i.get("module"),
                    f"{i.get('model')} bits {i.get('bits')}" if i.get("bits") else i.get("model"),
                    None,
                ]
                for i in faults
            ]
            rows += [
                [
                    e["step"],
                    e["detector"],
                    e["verdict"],
                    e.get("module"),
                    (e.get("evidence") or {}).get("finding"),
                    e.get("action"),
                ]
                for e in mine
            ]
            rows.sort(key=lambda row: (row[0], row[1] != "fault"))
            per_rank_tables.append(
                _table(
                    f"Timeline of {_lane(lane)}",
                    ["step", "what", "verdict / site", "module", "finding / fault", "action"],
                    rows[:MAX_LISTED],
                    note="" if len(rows) <= MAX_LISTED else f"first {MAX_LISTED} of {len(rows)}",
                )
            )
    vetoed = [m["step"] for m in metrics if m.get("skipped")]
    facts = [
        ["outcome", summary.get("outcome", "unfinished (no summary.json)")],
        ["steps", steps],
        ["ranks", world],
        ["final train loss", summary.get("final_train_loss")],
        ["final val loss", summary.get("final_val_loss")],
        ["replicas identical", summary.get("replicas_identical")],
        ["events", len(events)],
        ["injected faults", len(injections)],
        ["vetoed steps", ", ".join(map(str, vetoed)) or None],
        ["quarantined ranks", ", ".join(f"{r} (from step {s})" for r, s in sorted(quarantined.items())) or None],
    ]
    facts += [[f"failure of rank {f.get('rank')}", f.get("error")] for f in failures]
    tables = [
        _table("Run", ["", ""], facts),
        _table(
            "Per-rank timelines",
            [
                "lane",
                "device",
                "faults injected",
                "events",
                "steps with events",
                "first",
                "last",
                "findings",
                "actions",
                "quarantined from step",
            ],
            timeline,
            note="world: findings about every rank at once (before a replay named a rank)",
        ),
        *per_rank_tables,
    ]
    wl = config.get("workload", {})
    line = (
        f"{wl.get('workload', '?')}/{wl.get('preset', '?')}, seed {config.get('train', {}).get('seed')}, "
        f"{steps} steps on {world} rank{'s' if world != 1 else ''}"
        + (f", backend {config['backend']}" if config.get("backend") else "")
        + f", guard {'on' if config.get('guard') else 'off'}"
        + (f", cross-rank checks {'on' if config.get('crossrank') else 'off'}" if "crossrank" in config else "")
    )
    figs = {
        "per-rank timeline": _timeline_figure(lanes, events, injections, metrics, quarantined, steps, world),
        "loss per rank": _rank_loss_figure(metrics, world),
    }
    return {
        "kind": "run",
        "name": directory.name,
        "line": line,
        "tables": tables,
        "figures": {k: v for k, v in figs.items() if v is not None},
    }
