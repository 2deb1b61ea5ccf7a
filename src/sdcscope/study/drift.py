"""Drift against the exact golden twin (Ma et al.): how far a trial's weights and function are
from the bit-identical healthy run at the same step, over the horizon.

The golden run is each trial's exact twin: same seed, same data order, bit-reproducible, so a
trial whose fault changed nothing follows it bit for bit (distance 0) and any distance is the
fault's doing. Two measures at the drift steps (``drift_offsets`` after the injection):

- weights: ‖θ − θ_golden‖ / ‖θ_golden‖ (a trial row's ``drift`` list, final value ``dist_golden``);
- function: the share of held-out predictions that differ from golden's (``disagree``, final value
  ``disagree_final``): the argmax of the model's output on the workload's validation inputs,
  computed on a hook-free copy of the model (the healthy chip, as for the weights).

``sdc:drift`` holds by the twin (``drift_twin``: final weight distance beyond the chaos floor, the
envelope of perturbation twins, :mod:`.twins`) or by the spread of data-order re-seeds
(``drift_spread``); the report states both, with a figure of both distances over time -- the
twins and their envelope drawn, a trial that stays bit-identical to its twin at 0 -- and the
false-drift rate of the twins (each tested against the others) and of the re-seeded runs.
"""

from __future__ import annotations

import base64
import io
import math
import statistics
from typing import Any

import torch

from sdcscope.study.outcomes import NOT_FIRED, TWIN_BOUND
from sdcscope.study.stats import wilson_interval

__all__ = [
    "Predictor",
    "disagreement",
    "drift_figure",
    "drift_section",
    "drift_table_rows",
    "false_drift",
    "val_inputs",
]


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


_TWIN_COLOR, _ENVELOPE_COLOR = "#a1887f", "#000000"
"""The perturbation twins' lines and their envelope in the drift figure (apart from every outcome's)."""


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


def drift_figure(
    rows: list[dict],
    baselines: list[dict],
    offsets: list[int],
    twins: list[dict] = (),
    envelopes: dict[int, list[float | None]] | None = None,
) -> str | None:
    """Weight distance and prediction disagreement to the golden twin over the steps after the
    injection, one line per trial (coloured by outcome), per healthy re-seeded run (dashed) and per
    perturbation twin (thin), with the twins' envelope of each injection step (dotted; the fixed
    :data:`TWIN_BOUND` without twins). The weight axis is symmetric-log, so trials bit-identical
    to their twin lie on 0."""
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
        for t in twins:
            ys = _series(t.get(key))
            if ys:
                ax.plot(offsets[: len(ys)], ys, color=_TWIN_COLOR, lw=0.7, alpha=0.6)
        for r in shown:
            ys = _series(r.get(key))
            if ys:
                ax.plot(offsets[: len(ys)], ys, color=COLORS.get(_label(r), "#000000"), lw=0.8, alpha=0.7, marker=".")
        if key == "drift":
            for curve in (envelopes or {}).values():
                ax.plot(offsets[: len(curve)], _series(curve), color=_ENVELOPE_COLOR, lw=1.6, ls=":")
            if not envelopes:
                ax.axhline(TWIN_BOUND, color=_ENVELOPE_COLOR, lw=0.8, ls=":")
            tiny = [abs(v) for r in shown for v in _series(r.get("drift")) if v and not math.isnan(v)]
            ax.set_yscale("symlog", linthresh=max(min(tiny, default=1e-6), 1e-9))
        ax.set_xlabel("steps after injection")
        ax.set_ylabel(ylabel)
    ax = axes[0][0]
    for name, color in COLORS.items():
        if any(_label(r) == name for r in shown):
            ax.plot([], [], color=color, label=name)
    ax.plot([], [], color="#757575", ls="--", label="healthy re-seeded")
    if twins:
        ax.plot([], [], color=_TWIN_COLOR, lw=0.7, label="perturbation twins")
    ax.plot(
        [],
        [],
        color=_ENVELOPE_COLOR,
        ls=":",
        label="chaos envelope (twins)" if envelopes else f"fixed twin bound {TWIN_BOUND:g} (no twins)",
    )
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


def drift_table_rows(
    rows: list[dict], baselines: list[dict], twins: list[dict] = (), by: str = "outcome"
) -> list[list[Any]]:
    """One row per value of ``by``, one for the perturbation twins and one for the healthy
    re-seeded runs: how many, how many beyond the twins' envelope (a twin: beyond the other twins'
    envelope) and beyond the re-seed spread (a re-seeded run: beyond the others' spread), median
    and max weight distance and prediction disagreement to golden at the end of the horizon."""
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
    for name, runs in (("perturbation twins", twins), ("healthy re-seeded", baselines)):
        if runs:
            ends = [(r.get("disagree") or [None])[-1] for r in runs]
            out.append(
                [
                    name,
                    len(runs),
                    _count(runs, "drift_twin"),
                    _count(runs, "drift_spread"),
                    *_stats([r["dist_golden"] for r in runs]),
                    *_stats(ends),
                ]
            )
    return out


def _count(runs: list[dict], key: str) -> int | None:
    """How many of ``runs`` have the label ``key`` set; None when none was labelled."""
    flags = [r[key] for r in runs if r.get(key) is not None]
    return sum(map(int, flags)) if flags else None


def false_drift(twins: list[dict]) -> str:
    """The twins' false-drift rate (each twin beyond the other twins' envelope) with a Wilson 95 %
    interval, as a sentence."""
    flags = [t["drift_twin"] for t in twins if t.get("drift_twin") is not None]
    if not flags:
        return "No perturbation twins (a database written before them): drift_twin uses the fixed bound."
    k, n = sum(flags), len(flags)
    lo, hi = wilson_interval(k, n)
    return f"False-drift rate of the perturbation twins {k}/{n} = {k / n:.1%} (95% interval [{lo:.3f}, {hi:.3f}])"


def drift_section(
    rows: list[dict], baselines: list[dict], twins: list[dict] = ()
) -> tuple[str, list[str], list[list[Any]], str]:
    """The report's drift table: (title, headers, rows, note)."""
    headers = ["outcome", "runs", "beyond chaos envelope", "beyond re-seed spread"]
    headers += [f"{s} {m}" for m in ("weight distance", "prediction disagreement") for s in ("median", "max")]
    floor = (
        "the envelope of the perturbation twins at the end of the horizon (threshold dist_twin: golden's snapshot "
        "with one ulp of a random half of the weights, trained on with golden's data order; its rule in the "
        "thresholds table)"
        if twins
        else f"the fixed twin bound ({TWIN_BOUND:g}; this database has no perturbation twins)"
    )
    note = (
        "at the end of the horizon, against the bit-identical golden run: weight distance ‖θ − θ_twin‖ / "
        "‖θ_twin‖; prediction disagreement: the share of held-out argmax predictions that differ. sdc:drift "
        f"when the weight distance exceeds {floor} or the healthy re-seeds' bound (threshold dist_golden). "
        "Perturbation twins: each tested against the other twins' envelope; healthy re-seeded: each against "
        "the envelope and against the other re-seeds' spread (another data order lands beyond the chaos "
        f"envelope by design). {false_drift(twins)}"
    )
    return "Drift against the exact golden twin", headers, drift_table_rows(rows, baselines, twins), note
