"""The figure of a golden/faulty/guarded comparison (``loss_curves.png`` of ``demo`` and ``inject``).

Panels over the steps, top to bottom: the training losses (the fault's step, the guard's detections
and repairs marked; a crashed run's curve ends in an ✕), each run's loss minus the golden one,
the parameter distance to the golden run (when traced), and the events on a timeline (one lane per
run: injected faults, detections by action, vetoed steps). :func:`comparison_figure` returns the
series it plotted, so a caller (or a test) can check what the figure shows, not only its pixels.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from sdcscope.detect.events import actions_of
from sdcscope.study.figures import plt

__all__ = ["comparison_figure", "RUN_STYLES", "ACTION_COLORS"]

RUN_STYLES = {
    "golden": {"color": "black", "ls": "-", "lw": 2.0},
    "faulty": {"color": "#e53935", "ls": "-", "lw": 1.3},
    "guarded": {"color": "#1e88e5", "ls": "--", "lw": 1.6},
}
ACTION_COLORS = {
    "rollback": "#8e24aa",
    "recompute": "#1565c0",
    "veto": "#e53935",
    "skip_batch": "#fb8c00",
    "quarantine": "#212121",
    "lr_backoff": "#fdd835",
    "report": "#9e9e9e",
}


def _style(label: str) -> dict[str, Any]:
    return RUN_STYLES.get(label, {"color": "#757575", "ls": ":", "lw": 1.2})


def _finite(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _fault_steps(runs: dict[str, Any]) -> list[int]:
    return sorted({int(i["step"]) for r in runs.values() for i in r["injections"] if i.get("when", "train") == "train"})


def _loss_panel(ax, runs: dict[str, Any], data: dict[str, Any]) -> None:
    finite_all = [v for r in runs.values() for v in r["losses"] if math.isfinite(v)]
    for label, run in runs.items():
        steps, values = _finite(run["steps"], run["losses"])
        data["loss"][label] = {"steps": steps, "values": values}
        ax.plot(steps, values, label=label, **_style(label))
        if run["crash_step"] is not None:
            y = values[-1] if values else (max(finite_all) if finite_all else 1.0)
            x = run["crash_step"]
            ax.plot([x], [y], marker="X", ms=11, color=_style(label)["color"], mec="black", ls="none", zorder=6)
            ax.plot([], [], marker="X", ms=9, color=_style(label)["color"], mec="black", ls="none",
                    label=f"{label} crashed (non-finite loss, step {x})")  # fmt: skip
            data["crashes"][label] = x
    if finite_all and max(finite_all) / max(min(finite_all), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_ylabel("training loss")


def _mark_events(ax, runs: dict[str, Any], data: dict[str, Any]) -> None:
    """The guard's detections on the guarded curve, with the repair each took."""
    seen = set()
    for label, run in runs.items():
        curve = dict(zip(run["steps"], run["losses"]))
        for e in run["events"]:
            step, action = int(e["step"]), actions_of(e)[0]
            y = curve.get(step)
            if y is None or not math.isfinite(y):
                continue
            color = ACTION_COLORS.get(action, "#9e9e9e")
            key = (e["detector"], action)
            ax.plot([step], [y], marker="o", ms=10, mfc="none", mec=color, mew=2.2, ls="none", zorder=7,
                    label=None if key in seen else f"detected by {e['detector']} → {action}")  # fmt: skip
            seen.add(key)
            to = (e.get("evidence") or {}).get("rolled_back_to")
            text = f"detected ({e['detector']})\n→ {action}" + (f" to step {to}" if to is not None else "")
            ax.annotate(text, (step, y), xytext=(-18, 48), textcoords="offset points", fontsize=8, color=color,
                        ha="right", arrowprops={"arrowstyle": "->", "color": color}, zorder=8,
                        bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": color, "alpha": 0.9})  # fmt: skip
            data["detections"].append({"run": label, "step": step, "detector": e["detector"], "action": action})


def _diff_panel(ax, runs: dict[str, Any], data: dict[str, Any]) -> None:
    golden = dict(zip(runs["golden"]["steps"], runs["golden"]["losses"]))
    for label, run in runs.items():
        if label == "golden":
            continue
        steps = [s for s in run["steps"] if s in golden]
        diffs = [v - golden[s] for s, v in zip(run["steps"], run["losses"]) if s in golden]
        steps, diffs = _finite(steps, diffs)
        data["diff"][label] = {"steps": steps, "values": diffs}
        ax.plot(steps, diffs, label=f"{label} − golden", **_style(label))
    ax.axhline(0, color="black", lw=0.6)
    ax.set_yscale("symlog", linthresh=1e-3)  # a bitwise-equal run stays on the 0 line
    if all(v >= 0 for d in data["diff"].values() for v in d["values"]):
        ax.set_ylim(bottom=-1e-3)  # nothing below golden: no empty negative half
    ax.set_ylabel("loss − golden loss")


def _distance_panel(ax, trace: dict[str, Any], data: dict[str, Any]) -> None:
    for label, series in trace.items():
        if label == "every" or not isinstance(series, dict):
            continue
        values = [float(v) for v in series["values"]]
        steps, values = _finite(series["steps"], values)
        data["distance"][label] = {"steps": steps, "values": values}
        ax.plot(steps, values, label=label, **_style(label))
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("‖θ − θ_golden‖ / ‖θ_golden‖")


def _timeline_panel(ax, runs: dict[str, Any]) -> None:
    lanes = [label for label in runs if label != "golden"]
    seen = set()
    for y, label in enumerate(lanes):
        run = runs[label]
        for s in run["vetoed"]:
            ax.barh(y, 1.0, left=s - 0.5, height=0.8, color="#ffcdd2", lw=0,
                    label=None if "vetoed" in seen else "discarded step")  # fmt: skip
            seen.add("vetoed")
        for inj in run["injections"]:
            ax.plot([inj["step"]], [y - 0.25], marker="v", ms=9, mfc="none", mec="#1565c0", mew=1.6, ls="none",
                    label=None if "fault" in seen else "injected fault")  # fmt: skip
            seen.add("fault")
        for e in run["events"]:
            action = actions_of(e)[0]
            ax.plot([e["step"]], [y], marker="o", ms=8, color=ACTION_COLORS.get(action, "#9e9e9e"), ls="none",
                    label=None if action in seen else f"event → {action}")  # fmt: skip
            seen.add(action)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.set_title("events", fontsize=9, loc="left")
    if seen:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def comparison_figure(
    series: dict[str, Any], path: str | Path | None = None, title: str = "", render: bool = True
) -> dict[str, Any]:
    """Draw the comparison of :func:`~sdcscope.study.compare_series.load_series`; save it as PNG at
    ``path`` when given. Returns what each panel plotted (``loss``, ``diff``, ``distance``: per
    run ``{"steps", "values"}``, finite points only), ``crashes`` (run → step), ``detections``,
    ``fault_steps`` and ``png`` (the image bytes; None with ``render=False``, which only lays the
    figure out)."""
    runs = series["runs"]
    trace = series["comparison"].get("param_distance") or {}
    data: dict[str, Any] = {"loss": {}, "diff": {}, "distance": {}, "crashes": {}, "detections": []}
    panels = ["loss", "diff"] + (["distance"] if trace else []) + ["timeline"]
    heights = {"loss": 3.2, "diff": 1.8, "distance": 1.8, "timeline": 0.6 + 0.35 * max(1, len(runs) - 1)}
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9.0, 1.2 + sum(heights[p] for p in panels)), sharex=True,
        height_ratios=[heights[p] for p in panels],
    )  # fmt: skip
    ax = dict(zip(panels, axes))
    _loss_panel(ax["loss"], runs, data)
    if len(runs) > 1:
        _diff_panel(ax["diff"], runs, data)
    if trace:
        _distance_panel(ax["distance"], trace, data)
    data["fault_steps"] = _fault_steps(runs)
    for name in panels[:-1]:
        for j, s in enumerate(data["fault_steps"]):
            ax[name].axvline(s, color="grey", lw=1.0, ls="-.", label=f"fault injected (step {s})" if j == 0 else None)
    _mark_events(ax["loss"], runs, data)
    _timeline_panel(ax["timeline"], runs)
    for name in panels[:-1]:
        ax[name].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax[name].grid(alpha=0.25)
    ax["loss"].set_title(title or "golden vs " + " vs ".join(r for r in runs if r != "golden"))
    ax["timeline"].xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    data["png"] = None
    if render:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        data["png"] = buf.getvalue()
    plt.close(fig)
    if path is not None and data["png"] is not None:
        from sdcscope.common.io import write_bytes_atomic

        write_bytes_atomic(path, data["png"])
    return data
