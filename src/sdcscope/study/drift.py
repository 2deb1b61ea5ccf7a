"""Drift against the exact golden twin (Ma et al.): how far a trial's weights and function are
from the bit-identical healthy run at the same step, over the horizon.

The golden run is each trial's exact twin: same seed, same data order, bit-reproducible, so a
trial whose fault changed nothing follows it bit for bit (distance 0) and any distance is the
fault's doing. Two measures at the drift steps (``drift_offsets`` after the injection):

- weights: ‖θ − θ_golden‖ / ‖θ_golden‖ (a trial row's ``drift`` list, final value ``dist_golden``);
- function: the share of held-out predictions that differ from golden's (``disagree``, final value
  ``disagree_final``): the argmax of the model's output on the workload's validation inputs,
  computed on a hook-free copy of the model (the healthy chip, as for the weights).

``sdc:drift`` holds by the twin (``drift_twin``: final weight distance above
:data:`~sdcscope.study.outcomes.TWIN_BOUND`) or by the spread of data-order re-seeds
(``drift_spread``); the report states both, with a figure of both distances over time in which a
trial that stays bit-identical to its twin shows at 0.
"""

from __future__ import annotations

import base64
import io
import math
import statistics
from typing import Any

import torch

from sdcscope.study.outcomes import NOT_FIRED, TWIN_BOUND

__all__ = ["Predictor", "disagreement", "drift_figure", "drift_section", "drift_table_rows", "val_inputs"]


def val_inputs(workload) -> list[torch.Tensor] | None:
    """The inputs of a workload's held-out data (the CNN's validation images, the GPT's
    validation windows); None for a workload that keeps them elsewhere."""
    if isinstance(getattr(workload, "x_val", None), torch.Tensor):
        return [workload.x_val]
    batches = getattr(workload, "_val", None)
    if isinstance(batches, (list, tuple)) and batches:
        return [b[0] for b in batches]
    return None


class Predictor:
    """Predictions (argmax of the output) of given parameters on a workload's held-out inputs,
    through a private, hook-free model of the workload (built without touching the global RNG).
    Parameters only are loaded: the model's buffers stay as built (constant masks here)."""

    def __init__(self, workload) -> None:
        self.inputs = val_inputs(workload)
        with torch.random.fork_rng():
            self.model = workload.build_model()
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, params: torch.nn.Module | torch.Tensor) -> torch.Tensor | None:
        """``params``: a model (its parameters) or their flat concatenation in ``parameters()``
        order; None when the workload's held-out inputs are not known."""
        if self.inputs is None:
            return None
        mine = list(self.model.parameters())
        if isinstance(params, torch.nn.Module):
            for dst, src in zip(mine, params.parameters(), strict=True):
                dst.copy_(src.detach())
        else:
            at = 0
            for dst in mine:
                dst.copy_(params[at : at + dst.numel()].view_as(dst))
                at += dst.numel()
        outs = []
        for x in self.inputs:
            y = self.model(x)
            y = y[0] if isinstance(y, (tuple, list)) else y
            outs.append(y.argmax(-1).reshape(-1))
        return torch.cat(outs)


def disagreement(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """The share of predictions in which ``a`` and ``b`` differ (None when either is unknown)."""
    if a is None or b is None:
        return None
    return float((a != b).double().mean())


# ---------------------------------------------------------------------------------- report


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _label(r: dict) -> str:
    return f"sdc:{r['sdc_kind']}" if r["outcome"] == "sdc" else r["outcome"]


def _series(values: Any) -> list[float]:
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values or []]


def drift_figure(rows: list[dict], baselines: list[dict], offsets: list[int], bound: float = TWIN_BOUND) -> str | None:
    """Weight distance and prediction disagreement to the golden twin over the steps after the
    injection, one line per trial (coloured by outcome) and per healthy re-seeded run (dashed).
    The weight axis is symmetric-log, so trials bit-identical to their twin lie on 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdcscope.study.figures import COLORS

    shown = [r for r in rows if r["effect"] != NOT_FIRED and r.get("drift")]
    if not shown:
        return None
    with_fn = any(r.get("disagree") for r in shown)
    fig, axes = plt.subplots(1, 2 if with_fn else 1, figsize=(11.0 if with_fn else 6.5, 3.6), squeeze=False)
    panels = [("drift", "‖θ − θ_twin‖ / ‖θ_twin‖"), ("disagree", "prediction disagreement with twin")]
    for ax, (key, ylabel) in zip(axes[0], panels):
        for b in baselines:
            ys = _series(b.get(key))
            if ys:
                ax.plot(offsets[: len(ys)], ys, color="#757575", lw=1.2, ls="--")
        for r in shown:
            ys = _series(r.get(key))
            if ys:
                ax.plot(offsets[: len(ys)], ys, color=COLORS.get(_label(r), "#000000"), lw=0.8, alpha=0.7, marker=".")
        if key == "drift":
            ax.axhline(bound, color="#8e24aa", lw=0.8, ls=":")
            tiny = [abs(v) for r in shown for v in _series(r.get("drift")) if v and not math.isnan(v)]
            ax.set_yscale("symlog", linthresh=max(min(tiny, default=1e-6), 1e-9))
        ax.set_xlabel("steps after injection")
        ax.set_ylabel(ylabel)
    ax = axes[0][0]
    for name, color in COLORS.items():
        if any(_label(r) == name for r in shown):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#757575", ls="--", label="healthy re-seeded")
    ax.plot([], [], color="#8e24aa", ls=":", label=f"twin bound {bound:g}")
    ax.legend(fontsize=7, ncol=2, loc="best", framealpha=0.6)
    zero = sum(1 for r in shown if all(v == 0 for v in _series(r["drift"])))
    fig.suptitle(f"drift against the exact golden twin ({zero} of {len(shown)} trials stay at 0)", fontsize=10)
    return _png(fig)


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    return (statistics.median(v), max(v)) if v else (None, None)


def _twin(r: dict) -> bool:
    """``drift_twin`` of a row; from its distance when a read-only old database left it empty."""
    if r.get("drift_twin") is not None:
        return bool(r["drift_twin"])
    d = r.get("dist_golden")
    return r.get("effect") not in ("crash", NOT_FIRED) and isinstance(d, float) and d > TWIN_BOUND


def drift_table_rows(rows: list[dict], baselines: list[dict], by: str = "outcome") -> list[list[Any]]:
    """One row per value of ``by`` and one for the healthy re-seeded runs: trials, how many are
    beyond the twin bound and beyond the re-seed spread, median and max weight distance and
    prediction disagreement to the twin at the end of the horizon."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["effect"] != NOT_FIRED:
            groups.setdefault(_label(r) if by == "outcome" else str(r[by]), []).append(r)
    out = []
    for key in sorted(groups):
        rs = groups[key]
        out.append(
            [
                key,
                len(rs),
                sum(1 for r in rs if _twin(r)),
                sum(1 for r in rs if r.get("drift_spread")),
                *_stats([r["dist_golden"] for r in rs]),
                *_stats([r.get("disagree_final") for r in rs]),
            ]
        )
    if baselines:
        ends = [(b.get("disagree") or [None])[-1] for b in baselines]
        out.append(
            [
                "healthy re-seeded",
                len(baselines),
                None,
                None,
                *_stats([b["dist_golden"] for b in baselines]),
                *_stats(ends),
            ]
        )
    return out


def drift_section(rows: list[dict], baselines: list[dict]) -> tuple[str, list[str], list[list[Any]], str]:
    """The report's drift table: (title, headers, rows, note)."""
    headers = ["outcome", "trials", "beyond twin bound", "beyond re-seed spread"]
    headers += [f"{s} {m}" for m in ("weight distance", "prediction disagreement") for s in ("median", "max")]
    note = (
        "at the end of the horizon, against the bit-identical golden run: weight distance ‖θ − θ_twin‖ / "
        "‖θ_twin‖; prediction disagreement: the share of held-out argmax predictions that differ. sdc:drift "
        f"when the weight distance exceeds the twin bound ({TWIN_BOUND:g}) or the healthy re-seeds' bound "
        "(threshold dist_golden); the last row: the re-seeded healthy runs' own distance to golden"
    )
    return "Drift against the exact golden twin", headers, drift_table_rows(rows, baselines), note
