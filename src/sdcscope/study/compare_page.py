"""``comparison.html``: the page a person reads after ``inject`` or ``demo``.

One self-contained file (the figure inlined as a PNG data URI, no external link or script): the story
in one sentence per fact (fault, unguarded departure, detection, repair), the figure of
:mod:`sdcscope.study.compare_figure` (losses and their difference from the golden run, parameter
distance, events on a timeline), a table of the runs and one of the events. Written atomically.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import jinja2

from sdcscope.common.io import write_text_atomic
from sdcscope.study.compare_figure import comparison_figure
from sdcscope.study.compare_series import load_series, story
from sdcscope.study.tables import table

__all__ = ["PAGE", "FIGURE", "build_page", "write_page", "write_outputs"]

PAGE = "comparison.html"
FIGURE = "loss_curves.png"
MAX_EVENTS = 200

_HTML = jinja2.Template(
    """<!doctype html>
<html><head><meta charset="utf-8"><title>sdcscope: {{ p.title }}</title>
<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:right}th{background:#f0f0f0}
td:first-child{text-align:left}.note{color:#555;font-size:12px}img{max-width:100%}li{margin:.2em 0}</style>
</head><body>
<h1>{{ p.title }}</h1>
<ul>{% for line in p.story %}<li>{{ line }}</li>{% endfor %}</ul>
<img alt="losses, difference from golden, parameter distance and events" src="data:image/png;base64,{{ p.png }}">
{% for t in p.tables %}<h2>{{ t.title }}</h2>{% if t.note %}<p class="note">{{ t.note }}</p>{% endif %}
<table><tr>{% for h in t.headers %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}</table>
{% endfor %}</body></html>
""",
    autoescape=True,
)


def _runs_table(series: dict[str, Any]) -> dict[str, Any]:
    c = series["comparison"]
    rows = []
    for label, run in series["runs"].items():
        vs = {} if label == "golden" else (c if label == "faulty" else c.get(label) or {})
        s = run["summary"]
        rows.append(
            [
                label,
                s.get("outcome"),
                "–" if label == "golden" else vs.get("outcome"),
                len(run["steps"]),
                s.get("final_train_loss"),
                s.get("final_val_loss"),
                0.0 if label == "golden" else vs.get("param_rel_l2"),
                vs.get("first_divergence_step"),
                len(run["injections"]),
                len(run["events"]),
                len(run["vetoed"]),
            ]
        )
    return table(
        "Runs",
        ["run", "run outcome", "vs golden", "steps", "final train loss", "final val loss",
         "param distance (rel. L2)", "first divergence", "faults fired", "events", "discarded steps"],
        rows,
        note="same seed and data; vs golden: masked = bitwise-identical final parameters",
    )  # fmt: skip


def _events_table(series: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for label, run in series["runs"].items():
        for i in run["injections"]:
            rows.append([i["step"], label, "fault", i.get("site"), i.get("module"), f"bits {i.get('bits')}", None])
        for e in run["events"]:
            finding = (e.get("evidence") or {}).get("finding")
            rows.append([e["step"], label, e["detector"], e.get("verdict"), e.get("module"), finding, e.get("action")])
    rows.sort(key=lambda r: (r[0], r[1], r[2] != "fault"))
    return table(
        "Faults and events",
        ["step", "run", "what", "site / verdict", "module", "bits / finding", "action"],
        rows[:MAX_EVENTS],
        note="" if len(rows) <= MAX_EVENTS else f"first {MAX_EVENTS} of {len(rows)}",
    )


def build_page(out: str | Path) -> dict[str, Any]:
    """The page's content (and the figure's data, under ``figure``) of comparison folder ``out``."""
    series = load_series(out)
    title = f"golden vs {' vs '.join(r for r in series['runs'] if r != 'golden')} ({Path(out).name})"
    figure = comparison_figure(series, title=title)
    return {
        "title": title,
        "story": story(series),
        "png": base64.b64encode(figure["png"]).decode(),
        "tables": [_runs_table(series), _events_table(series)],
        "figure": figure,
        "series": series,
    }


def write_page(out: str | Path, page: dict[str, Any] | None = None, to: str | Path | None = None) -> Path:
    """Write ``comparison.html`` of folder ``out`` (atomically) into ``out``, or into folder ``to``;
    ``page``: its :func:`build_page`, built when not given."""
    page = build_page(out) if page is None else page
    path = Path(out if to is None else to) / PAGE
    write_text_atomic(path, _HTML.render(p=page))
    return path


def write_outputs(out: str | Path, comparison: dict[str, Any], trace=None) -> dict[str, Any]:
    """After an experiment: add the parameter-distance ``trace`` (a
    :class:`~sdcscope.study.trace.ParamTrace`) to ``comparison.json``, write ``comparison.html`` and
    its figure as ``loss_curves.png``; return the page."""
    from sdcscope.common.io import write_bytes_atomic
    from sdcscope.study.compare import write_comparison

    if trace is not None:
        comparison["param_distance"] = trace.series()
        write_comparison(out, comparison)
    page = build_page(out)
    write_page(out, page)
    write_bytes_atomic(Path(out) / FIGURE, page["figure"]["png"])
    return page
