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

from sdcscope.study.outcomes import NOT_FIRED  # noqa: E402
from sdcscope.study.stats import pvf_table  # noqa: E402

__all__ = ["outcome_bars", "pvf_heatmap", "loss_curves", "drift_curves", "latency_hist", "fault_present_bars", "COLORS"]

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


def pvf_heatmap(rows: list[dict]) -> str | None:
    """PVF per layer × bit, next to the upper end of its Wilson 95% interval (None: no trial
    with a bit whose fault fired)."""
    table = pvf_table([r for r in rows if r["bit"] is not None], ("target", "bit"))
    if not table:
        return None
    layers = sorted({t["target"] for t in table})
    bits = sorted({t["bit"] for t in table})
    grids = {k: [[math.nan] * len(bits) for _ in layers] for k in ("pvf", "hi", "trials")}
    for t in table:
        i, j = layers.index(t["target"]), bits.index(t["bit"])
        for k in grids:
            grids[k][i][j] = t[k]
    fig, axes = plt.subplots(
        1, 2, figsize=(min(16.0, max(7.0, 3 + 0.5 * len(bits))), 1.4 + 0.32 * len(layers)), squeeze=False
    )
    for ax, key, title in ((axes[0][0], "pvf", "PVF"), (axes[0][1], "hi", "Wilson 95% upper bound")):
        im = ax.imshow(grids[key], vmin=0, vmax=1, cmap="magma_r", aspect="auto")
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xticks(range(len(bits)), [str(b) for b in bits], fontsize=6)
        ax.set_xlabel("bit")
        ax.set_title(title, fontsize=9)
        if len(layers) * len(bits) <= 60:
            for i in range(len(layers)):
                for j in range(len(bits)):
                    n = grids["trials"][i][j]
                    if not math.isnan(n):
                        ax.text(j, i, f"n={int(n)}", ha="center", va="center", fontsize=6, color="#00897b")
        fig.colorbar(im, ax=ax, fraction=0.03)
    return _png(fig)


def loss_curves(golden: list[float], rows: list[dict], baselines: list[dict], limit: int = 24) -> str:
    """Golden loss, healthy re-seeded runs and the most deviating faulty trials after injection."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for b in baselines:
        s = b["inject_step"]
        ax.plot(range(s, s + len(b["losses"])), b["losses"], color="#bdbdbd", lw=0.8)
    ranked = sorted(
        (r for r in rows if r["effect"] not in ("masked", NOT_FIRED)),
        key=lambda r: -(r["loss_diff_max"] if r["loss_diff_max"] is not None else math.inf),
    )
    for r in ranked[:limit]:
        s = r["inject_step"]
        losses = [x if isinstance(x, (int, float)) else math.nan for x in r["losses"]]
        ax.plot(range(s, s + len(losses)), losses, color=COLORS[label(r)], lw=0.9, alpha=0.85)
    ax.plot(range(len(golden)), golden, color="black", lw=1.2, label="golden", zorder=5)
    for name, color in COLORS.items():
        if any(label(r) == name for r in ranked[:limit]):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#bdbdbd", label="healthy re-seeded")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    top = max(golden) * 1.5 if golden else None
    if top:
        ax.set_ylim(top=top)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("loss curves: golden vs faulty (largest deviations)")
    return _png(fig)


def drift_curves(rows: list[dict], baselines: list[dict], offsets: list[int]) -> str:
    """Relative parameter distance to golden after the injection, per trial and healthy runs."""
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for b in baselines:
        ax.plot(offsets[: len(b["drift"])], b["drift"], color="#757575", lw=1.2, ls="--")
    for r in rows:
        if r["effect"] == NOT_FIRED:
            continue
        d = [x if isinstance(x, (int, float)) and x > 0 else math.nan for x in r["drift"] or []]
        if d and not all(math.isnan(x) for x in d):
            ax.plot(offsets[: len(d)], d, color=COLORS[label(r)], lw=0.8, alpha=0.7)
    for name, color in COLORS.items():
        if any(label(r) == name for r in rows):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#757575", ls="--", label="healthy re-seeded")
    ax.set_yscale("log")
    ax.set_xlabel("steps after injection")
    ax.set_ylabel("‖θ − θ_golden‖ / ‖θ_golden‖")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("parameter drift over time")
    return _png(fig)


def latency_hist(rows: list[dict]) -> str:
    lat = [r["latency"] for r in rows if r["latency"] is not None]
    fig, ax = plt.subplots(figsize=(5.0, 3.0))
    ax.hist(lat, bins=range(0, max(lat, default=0) + 2), color="#1565c0", align="left")
    ax.set_xlabel("detection latency (steps after the fault first fired)")
    ax.set_ylabel("trials")
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
    ax.set_xticks(range(len(groups)), [g["group"] for g in groups], fontsize=7, rotation=20)
    ax.set_ylabel(f"validation {metric}")
    ax.legend(fontsize=7)
    ax.set_title("permanent faults: evaluated with the fault present vs removed")
    return _png(fig)
