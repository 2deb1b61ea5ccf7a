"""The report of one run directory (``sdcscope report RUN``): summary, per-rank timelines -- every
event on its rank's lane over the steps, next to the injected faults, vetoed steps and quarantined
spans -- the loss of every rank (a crashed run's curve ends in a marked point), and the event list.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from sdcscope.common.io import read_json, read_jsonl
from sdcscope.detect.events import actions_of
from sdcscope.study import figures
from sdcscope.study.tables import table as _table

__all__ = ["RUN_CONFIG", "ACTION_COLORS", "build_run_report"]

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
    """The world's mean loss and each rank's; a loss that became non-finite (a crash) ends the
    curve in an ✕ with its legend entry."""
    rows = [m for m in metrics if not m.get("skipped") and m.get("loss") is not None]
    finite = [m for m in rows if _finite(m["loss"])]
    if not finite:
        return None
    fig, ax = figures.plt.subplots(figsize=(7, 3.2))
    if world > 1 and any("rank_loss" in m for m in finite):
        for r in range(world):
            pts = [(m["step"], m["rank_loss"][r]) for m in finite if "rank_loss" in m and _finite(m["rank_loss"][r])]
            ax.plot(*zip(*pts), lw=0.9, label=f"rank {r}") if pts else None
    ax.plot([m["step"] for m in finite], [float(m["loss"]) for m in finite], color="black", lw=1.6, label="world mean")
    crash = next((m for m in rows if not _finite(m["loss"])), None)
    if crash is not None:
        last = [m for m in finite if m["step"] < crash["step"]] or finite
        figures.mark_crash(
            ax,
            crash["step"],
            float(last[-1]["loss"]),
            "#e53935",
            label=f"crash: non-finite loss at step {crash['step']}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss per rank")
    ax.legend(fontsize=7)
    return figures._png(fig)


def _finite(value: Any) -> bool:
    """A finite number (a non-finite loss is written as the string ``"nan"``/``"inf"``)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


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
        + (", guard on" if config.get("guard") else ", guard off")
        + (f", profile {config['guard']['profile']}" if (config.get("guard") or {}).get("profile") else "")
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
