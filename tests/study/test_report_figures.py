"""Campaign report figures a person can read: heatmap labels that never overlap, whole-number ticks on
count axes, zero-drift trials on the drift plot, and a crashed trial's curve ending in a marker."""

import itertools
import math

import pytest

from sdcscope.study import figures

LAYERS = [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
    "transformer.h.11.mlp.experts.gate_up_proj_very_long_name"
]
BITS = list(range(32))


@pytest.fixture
def drawn(monkeypatch):
    """The figures a figure function made, drawn, instead of their PNG."""
    made = []

    def keep(fig):
        fig.canvas.draw()
        made.append(fig)
        return "png"

    monkeypatch.setattr(figures, "_png", keep)
    return made


def _row(target, bit, effect, site="weight", **kw):
    return {"target": target, "bit": bit, "effect": effect, "site": site, **kw}


def _no_overlap(labels):
    boxes = [t.get_window_extent() for t in labels if t.get_text()]
    return all(not a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


def test_heatmap_labels_never_overlap_and_stay_inside_the_figure(drawn):
    rows = [_row(t, b, "sdc" if (i + b) % 3 == 0 else "masked") for i, t in enumerate(LAYERS) for b in BITS]
    figures.pvf_heatmap(rows)
    (fig,) = drawn
    width, height = fig.canvas.get_width_height()
    heatmaps = [ax for ax in fig.axes if ax.images]  # not the colour bars
    assert len(heatmaps) == 2
    for ax in heatmaps:
        ys, xs = ax.get_yticklabels(), ax.get_xticklabels()
        assert len(ys) == len(LAYERS) and len(xs) == len(BITS)
        assert _no_overlap(ys) and _no_overlap(xs)
        for t in ys + xs:
            box = t.get_window_extent()
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, t.get_text()
        assert max(len(t.get_text()) for t in ys) <= 26  # a long module name is shortened, not cut off
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == len(LAYERS) * len(BITS) and "0.00" in texts  # every cell annotated


def test_layer_by_site_heatmap_has_one_row_per_layer_and_one_column_per_site(drawn):
    sites = ["weight", "gemm.forward", "gemm.grad_input"]
    rows = [_row(t, 30, "sdc" if s == "weight" else "benign", site=s) for t in LAYERS[:5] for s in sites]
    figures.site_heatmap(rows)
    (fig,) = drawn
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == sorted(sites)
    assert _no_overlap(ax.get_yticklabels()) and _no_overlap(ax.get_xticklabels())
    assert figures.site_heatmap([_row("a", 1, "sdc")]) is None  # one site: nothing to compare


def test_latency_histogram_counts_in_whole_trials(drawn):
    figures.latency_hist([{"latency": v} for v in (0, 1, 1, 3)])
    (fig,) = drawn
    ax = fig.axes[0]
    for ticks in (ax.get_yticks(), ax.get_xticks()):
        assert all(float(t).is_integer() for t in ticks)


def _trial(drift, outcome="sdc", kind="drift"):
    return {"effect": outcome, "outcome": outcome, "sdc_kind": kind, "drift": drift}


def test_drift_plot_shows_zero_drift_trials_on_the_zero_line(drawn):
    rows = [_trial([0.0, 0.0, 0.0], "benign", None), _trial([1e-6, 1e-4, 1e-2])]
    figures.drift_curves(rows, [{"drift": [1e-7, 1e-6, 1e-5]}], [1, 2, 3])
    (fig,) = drawn
    ax = fig.axes[0]
    zero = [line for line in ax.get_lines() if list(line.get_ydata()) == [0.0, 0.0, 0.0]]
    assert len(zero) == 1 and zero[0].get_marker() == "o"  # drawn and marked, not dropped as log(0)
    low, high = ax.get_ylim()
    assert ax.get_yscale() == "symlog" and low <= 0.0 < high
    assert any("zero drift" in t.get_text() for t in ax.get_legend().get_texts())


def test_a_crashed_trial_curve_ends_in_a_marker_with_a_legend_entry(drawn):
    crashed = {
        "effect": "crash",
        "outcome": "crash",
        "sdc_kind": None,
        "inject_step": 2,
        "losses": [2.0, 2.4, "nan", "nan"],
        "loss_diff_max": None,
    }
    figures.loss_curves([3.0, 2.5, 2.2, 2.0, 1.9, 1.8], [crashed], [])
    (fig,) = drawn
    ax = fig.axes[0]
    marks = [line for line in ax.get_lines() if line.get_marker() == "X" and len(line.get_xdata())]
    assert [(float(m.get_xdata()[0]), float(m.get_ydata()[0])) for m in marks] == [(3.0, 2.4)]  # its last point
    assert any("crash" in t.get_text() for t in ax.get_legend().get_texts())
    assert not any(math.isnan(y) for y in marks[0].get_ydata())


def test_a_run_report_loss_curve_ends_in_a_marker_at_the_crash(drawn):
    from sdcscope.study.run_report import _rank_loss_figure

    _rank_loss_figure([{"step": i, "loss": 3.0 - 0.1 * i} for i in range(5)] + [{"step": 5, "loss": "nan"}], 1)
    (fig,) = drawn
    ax = fig.axes[0]
    marks = [line for line in ax.get_lines() if line.get_marker() == "X"]
    assert [(float(m.get_xdata()[0]), round(float(m.get_ydata()[0]), 6)) for m in marks] == [(5.0, 2.6)]
    assert any("crash" in t.get_text() and "step 5" in t.get_text() for t in ax.get_legend().get_texts())
