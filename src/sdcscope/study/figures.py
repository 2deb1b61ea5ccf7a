"""Figures of a campaign report (matplotlib, Agg backend), each returned as base64 PNG text."""

from __future__ import annotations

import base64
import io
import math
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from sdcscope.study.outcomes import NOT_FIRED  # noqa: E402
from sdcscope.study.stats import pvf_table  # noqa: E402

__all__ = [
    "COLORS",
    "drift_curves",
    "fault_present_bars",
    "heatmap",
    "latency_hist",
    "loss_curves",
    "mark_crash",
    "outcome_bars",
    "pvf_heatmap",
    "short_label",
    "site_heatmap",
]

COLORS = {
    "masked": "#9e9e9e",
    "benign": "#80cbc4",
    "detected": "#64b5f6",
    "recovered": "#1565c0",
    "crash": "#212121",
    "sdc:sharp": "#e53935",
    "sdc:slow": "#fb8c00",
    "sdc:drift": "#8e24aa",
    NOT_FIRED: "#eeeeee",
}


def label(row: dict[str, Any]) -> str:
    """The outcome with its SDC kind (``sdc:slow``)."""
    return f"sdc:{row['sdc_kind']}" if row["outcome"] == "sdc" else row["outcome"]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def outcome_bars(rows: list[dict], by: str, title: str) -> str:
    """Stacked shares of outcomes per value of column ``by``."""
    counts: dict[Any, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        counts[r[by]][label(r)] += 1
    keys = sorted(counts, key=lambda k: (k is None, k if isinstance(k, (int, float)) else str(k)))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.32 * len(keys) + 2), 3.4))
    bottom = [0.0] * len(keys)
    for outcome, color in COLORS.items():
        shares = [counts[k][outcome] / max(1, sum(counts[k].values())) for k in keys]
        if any(shares):
            ax.bar(range(len(keys)), shares, bottom=bottom, color=color, label=outcome, width=0.85)
            bottom = [b + s for b, s in zip(bottom, shares)]
    ax.set_xticks(range(len(keys)), [str(k) for k in keys], rotation=90 if len(keys) > 8 else 0, fontsize=8)
    ax.set_ylabel("share of trials")
    ax.set_xlabel(by)
    ax.set_title(title)
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _png(fig)


def short_label(text: str, limit: int = 26) -> str:
    """``text`` in at most ``limit`` characters: ``blocks.`` becomes ``b.``, then the middle is elided
    (the ends of a module name say the most: its block and its layer)."""
    text = str(text).replace("blocks.", "b.")
    if len(text) <= limit:
        return text
    keep = limit - 1
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2) :]


def _heatmap_size(rows: list[str], cols: list[str], panels: int) -> tuple[float, float, bool]:
    """Figure size (inches) from the number and length of the labels, so that none overlaps: a cell
    is wide enough for its annotation and a row label's width is reserved on the left; column labels
    turn 90° when they are longer than a cell is wide."""
    char = 0.075  # inches per character at fontsize 7
    cell_w = 0.5 if len(cols) <= 24 else 0.3 if len(cols) <= 40 else 0.2
    if len(cols) <= 8:  # few columns: wide enough for their labels, kept level
        cell_w = max(cell_w, char * max((len(c) for c in cols), default=1) + 0.15)
    rotate = max((len(c) for c in cols), default=1) * char > cell_w * 0.9
    left = 0.4 + char * max((len(r) for r in rows), default=4)
    bottom = 0.9 + (char * max((len(c) for c in cols), default=2) if rotate else 0.2)
    width = panels * (left + cell_w * len(cols) + 1.0)
    height = bottom + 0.8 + 0.3 * len(rows)
    return min(30.0, max(5.0, width)), min(40.0, max(2.8, height)), rotate


def heatmap(
    grids: list[tuple[str, list[list[float]]]],
    rows: list[Any],
    cols: list[Any],
    xlabel: str,
    counts: list[list[float]] | None = None,
) -> str:
    """Heatmaps side by side (``grids``: title, rows × cols values in [0, 1]), labelled rows and
    columns that never overlap, every cell annotated with its value (and ``n=`` its trial count);
    an empty cell (NaN) is left blank and grey."""
    row_labels, col_labels = [short_label(r) for r in rows], [short_label(c, 20) for c in cols]
    w, h, rotate = _heatmap_size(row_labels, col_labels, len(grids))
    fig, axes = plt.subplots(1, len(grids), figsize=(w, h), squeeze=False)
    cmap = matplotlib.colormaps["magma_r"].with_extremes(bad="#eeeeee")
    annotate = len(cols) <= 40  # a cell wide enough for its value
    for ax, (title, grid) in zip(axes[0], grids):
        im = ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto")
        ax.set_yticks(range(len(rows)), row_labels, fontsize=7)
        ax.set_xticks(range(len(cols)), col_labels, fontsize=7, rotation=90 if rotate else 0)
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=9)
        for i in range(len(rows)):
            for j in range(len(cols)):
                v = grid[i][j]
                if not annotate or math.isnan(v):
                    continue
                n = counts[i][j] if counts is not None else math.nan
                text = f"{v:.2f}" + ("" if math.isnan(n) or len(cols) > 24 else f"\nn={int(n)}")
                ax.text(j, i, text, ha="center", va="center", fontsize=7 if len(cols) <= 24 else 5.5,
                        color="white" if v > 0.55 else "black")  # fmt: skip
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    return _png(fig)


def _grid(table: list[dict], row_key: str, col_key: str) -> tuple[list, list, dict[str, list[list[float]]]]:
    rows = sorted({t[row_key] for t in table}, key=str)
    cols = sorted({t[col_key] for t in table}, key=lambda c: (isinstance(c, str), c))
    grids = {k: [[math.nan] * len(cols) for _ in rows] for k in ("pvf", "hi", "trials")}
    for t in table:
        i, j = rows.index(t[row_key]), cols.index(t[col_key])
        for k in grids:
            grids[k][i][j] = t[k]
    return rows, cols, grids


def pvf_heatmap(rows: list[dict]) -> str | None:
    """PVF per layer × bit, next to the upper end of its Wilson 95% interval (None: no trial
    with a bit whose fault fired)."""
    table = pvf_table([r for r in rows if r["bit"] is not None], ("target", "bit"))
    if not table:
        return None
    layers, bits, grids = _grid(table, "target", "bit")
    return heatmap(
        [("PVF", grids["pvf"]), ("Wilson 95% upper bound", grids["hi"])], layers, bits, "bit", grids["trials"]
    )


def site_heatmap(rows: list[dict]) -> str | None:
    """PVF per layer × site (None: fewer than two sites, or no trial whose fault fired)."""
    if len({r["site"] for r in rows}) < 2:
        return None
    table = pvf_table(rows, ("target", "site"))
    if not table:
        return None
    layers, sites, grids = _grid(table, "target", "site")
    return heatmap([("PVF", grids["pvf"])], layers, sites, "site", grids["trials"])


def mark_crash(ax, x: float, y: float, color: str, label: str | None = None, top: float | None = None) -> None:
    """A crashed run's curve ends in a black-edged ✕ at its last finite point (at the axis' top
    when that point is above it); ``label`` adds a legend entry for it."""
    y = min(y, top) if top is not None else y
    ax.plot([x], [y], marker="X", ms=9, color=color, mec="black", mew=0.8, ls="none", zorder=6, label=label)


def _numbers(values: list[Any]) -> list[float]:
    return [float(x) if isinstance(x, (int, float)) else math.nan for x in values or []]


def loss_curves(golden: list[float], rows: list[dict], baselines: list[dict], limit: int = 24) -> str:
    """Golden loss, healthy re-seeded runs and the most deviating faulty trials after injection; a
    trial whose loss became non-finite (a crash) ends in an ✕."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for b in baselines:
        s = b["inject_step"]
        ax.plot(range(s, s + len(b["losses"])), b["losses"], color="#bdbdbd", lw=0.8)
    ranked = sorted(
        (r for r in rows if r["effect"] not in ("masked", NOT_FIRED)),
        key=lambda r: -(r["loss_diff_max"] if r["loss_diff_max"] is not None else math.inf),
    )
    top = max(golden) * 1.5 if golden else None
    crashed = False
    for r in ranked[:limit]:
        s = r["inject_step"]
        losses = _numbers(r["losses"])
        ax.plot(range(s, s + len(losses)), losses, color=COLORS[label(r)], lw=0.9, alpha=0.85)
        finite = [(s + i, v) for i, v in enumerate(losses) if math.isfinite(v)]
        if r["outcome"] == "crash" or len(finite) < len(losses):
            x, y = finite[-1] if finite else (s, golden[s] if s < len(golden) else 0.0)
            mark_crash(ax, x, y, COLORS[label(r)], top=top)
            crashed = True
    ax.plot(range(len(golden)), golden, color="black", lw=1.2, label="golden", zorder=5)
    for name, color in COLORS.items():
        if any(label(r) == name for r in ranked[:limit]):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#bdbdbd", label="healthy re-seeded")
    if crashed:
        ax.plot([], [], marker="X", color="white", mec="black", ls="none", label="crash: curve ends (non-finite)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if top:
        ax.set_ylim(top=top)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("loss curves: golden vs faulty (largest deviations)")
    return _png(fig)


def drift_curves(rows: list[dict], baselines: list[dict], offsets: list[int]) -> str:
    """Relative parameter distance to golden after the injection, per trial and healthy runs. The
    axis is linear near 0 (symlog), so a trial with zero drift (bitwise equal) shows on the 0 line."""
    fig, ax = plt.subplots(figsize=(8.6, 3.6))
    curves = [_numbers(b["drift"]) for b in baselines]
    positive = [x for c in curves for x in c if math.isfinite(x) and x > 0]
    trials = [(r, _numbers(r["drift"])) for r in rows if r["effect"] != NOT_FIRED and r["drift"]]
    positive += [x for _, d in trials for x in d if math.isfinite(x) and x > 0]
    for d in curves:
        ax.plot(offsets[: len(d)], d, color="#757575", lw=1.2, ls="--")
    zero = 0
    for r, d in trials:
        if not any(math.isfinite(x) for x in d):
            continue
        flat = all(x == 0 for x in d if math.isfinite(x))
        zero += flat
        ax.plot(offsets[: len(d)], d, color=COLORS[label(r)], lw=0.8, alpha=0.7, marker="o" if flat else None, ms=3)
    for name, color in COLORS.items():
        if any(label(r) == name for r, _ in trials):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#757575", ls="--", label="healthy re-seeded")
    if zero:
        ax.plot([], [], color="#757575", marker="o", ms=3, ls="none", label=f"zero drift ({zero} trial(s), on 0)")
    linthresh = 10 ** math.floor(math.log10(min(positive))) if positive else 1e-9
    ax.set_yscale("symlog", linthresh=linthresh)
    ax.set_ylim(bottom=-0.5 * linthresh)  # the 0 line (zero-drift trials) clear of the axis
    ax.axhline(0, color="#bdbdbd", lw=0.6)
    ax.axhline(linthresh, color="#bdbdbd", lw=0.6, ls=":")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("steps after injection")
    ax.set_ylabel("‖θ − θ_golden‖ / ‖θ_golden‖\n(linear below the dotted line)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # never over a curve
    ax.set_title("parameter drift over time")
    return _png(fig)


def latency_hist(rows: list[dict]) -> str:
    lat = [r["latency"] for r in rows if r["latency"] is not None]
    fig, ax = plt.subplots(figsize=(5.0, 3.0))
    ax.hist(lat, bins=range(0, max(lat, default=0) + 2), color="#1565c0", align="left")
    ax.set_xlabel("detection latency (steps after the fault first fired)")
    ax.set_ylabel("trials")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole trials
    ax.set_title("detection latency")
    return _png(fig)


def fault_present_bars(groups: list[dict]) -> str:
    """Mean validation accuracy (or loss) per group: golden, with the fault present, removed."""
    metric = "acc" if all(g["acc_fault"] is not None for g in groups) else "loss"
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(groups) + 2), 3.4))
    width = 0.27
    for k, (key, name, color) in enumerate(
        (
            ("golden", "golden", "#9e9e9e"),
            ("fault", "fault present", "#43a047"),
            ("removed", "fault removed", "#e53935"),
        )
    ):
        values = [g[f"{metric}_{key}"] for g in groups]
        ax.bar([i + (k - 1) * width for i in range(len(groups))], values, width, label=name, color=color)
    ax.set_xticks(range(len(groups)), [short_label(g["group"], 40) for g in groups], fontsize=7, rotation=20)
    ax.set_ylabel(f"validation {metric}")
    ax.legend(fontsize=7)
    ax.set_title("permanent faults: evaluated with the fault present vs removed")
    return _png(fig)
