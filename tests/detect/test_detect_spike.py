"""SpikeDetector: quiet on smooth noisy series, loud on a 10× spike, warm-up respected."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcscope.detect import SpikeConfig, SpikeDetector
from sdcscope.detect.spike import _kth_deviation, _median


def noisy_decreasing(n=2000, seed=0, noise=0.03):
    rng = random.Random(seed)
    return [(1.5 + 2.5 * math.exp(-t / 300)) * math.exp(rng.gauss(0, noise)) for t in range(n)]


def heavy_tailed_grad_norm(n=2000, seed=0):
    rng = random.Random(seed)  # lognormal noise with occasional benign 2-3× excursions
    out = []
    for t in range(n):
        base = 0.4 + 0.6 * math.exp(-t / 200)
        v = base * math.exp(rng.gauss(0, 0.12))
        if rng.random() < 0.01:
            v *= rng.uniform(1.5, 3.0)
        out.append(v)
    return out


@pytest.mark.parametrize(
    "cfg",
    [SpikeConfig.loss(), SpikeConfig.loss(method="ema"), SpikeConfig.loss(window=50)],
    ids=["mad", "ema", "mad50"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_alarm_on_smooth_noisy_decreasing_series(cfg, seed):
    det = SpikeDetector(cfg)
    events = [e for t, v in enumerate(noisy_decreasing(seed=seed)) for e in det.check(t, v)]
    assert events == []


@pytest.mark.parametrize("seed", [0, 1])
def test_no_alarm_on_heavy_tailed_grad_norm(seed):
    det = SpikeDetector(SpikeConfig.grad_norm())
    events = [e for t, v in enumerate(heavy_tailed_grad_norm(seed=seed)) for e in det.check(t, v)]
    assert events == []


@pytest.mark.parametrize("method", ["mad", "ema"])
def test_alarm_on_10x_spike_and_baseline_not_polluted(method):
    det = SpikeDetector(SpikeConfig.loss(method=method))
    series = noisy_decreasing()
    hits = {}
    for t, v in enumerate(series):
        if t in (700, 701, 702):  # a 3-step spike cluster
            v *= 10
        for e in det.check(t, v):
            hits[t] = e
    assert sorted(hits) == [700, 701, 702]  # the cluster did not raise its own baseline
    ev = hits[700]
    assert ev.verdict == "spike" and ev.detector == "spike" and ev.module is None
    assert ev.evidence["signal"] == "loss" and ev.evidence["ratio"] == pytest.approx(10, rel=0.15)
    assert ev.evidence["z"] > ev.evidence["alarm_z"] and hits[702].evidence["consecutive"] == 3
    assert det.state.consecutive == 0 and not det.state.alarm


def test_warmup_no_verdicts_then_alarm():
    det = SpikeDetector(SpikeConfig.loss(warmup=20))
    series = noisy_decreasing(100)
    for t in range(20):
        assert det.check(t, series[t] * (50 if t == 10 else 1)) == []  # spike inside warm-up
    assert det.check(20, series[20] * 10)  # first verdict-capable step


def test_clip_state_is_zclip_style_and_nonfinite_skipped():
    det = SpikeDetector(SpikeConfig.zclip())
    for t, v in enumerate(heavy_tailed_grad_norm(200, seed=3)):
        det.check(t, v)
    seen = det.seen
    det.check(200, 0.95)  # > μ + 2.5σ, well below an alarm
    st = det.state
    assert st.clip and not st.alarm and st.z > 2.5
    assert st.baseline < st.clip_to < 0.95
    assert det.check(201, float("nan")) == [] and det.seen == seen + 1
    assert det.check(202, -1.0) == []  # linear space: a finite value is judged


def test_two_sided_and_min_ratio():
    series = noisy_decreasing(400, noise=0.001)
    det = SpikeDetector(SpikeConfig.loss())
    # a 0.5 % bump is many robust σ of this nearly noise-free series, but below ×1.5
    assert [e for t, v in enumerate(series) for e in det.check(t, v * (1.005 if t == 300 else 1))] == []
    det2 = SpikeDetector(SpikeConfig.loss(two_sided=True))
    drops = [t for t, v in enumerate(series) if det2.check(t, v / (3 if t == 300 else 1))]
    assert drops == [300]


def test_config_validation():
    with pytest.raises(ValueError, match="method.*allowed: mad, ema"):
        SpikeConfig(method="median")
    with pytest.raises(ValueError, match="min_ratio=0.5"):
        SpikeConfig(min_ratio=0.5)
    with pytest.raises(ValueError, match="ema_alpha=1"):
        SpikeConfig(ema_alpha=1)
    with pytest.raises(ValueError, match="window=2"):
        SpikeConfig(window=2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(-1e6, 1e6), st.integers(-3, 3).map(float)), min_size=1, max_size=40), st.data())
def test_kth_deviation_is_the_kth_smallest_absolute_deviation(values, data):
    """The O(log n) selection behind the MAD equals sorting the deviations (ties, any center)."""
    s = sorted(values)
    center = data.draw(st.one_of(st.sampled_from(s), st.floats(-1e6, 1e6), st.just(_median(s))))
    devs = sorted(abs(x - center) for x in s)
    assert [_kth_deviation(s, center, k) for k in range(len(s))] == devs


@pytest.mark.parametrize("cfg", [SpikeConfig.loss(), SpikeConfig.grad_norm(method="ema"), SpikeConfig.zclip()])
def test_a_gross_outlier_alarms_during_warmup_and_stays_out_of_the_statistics(cfg):
    det = SpikeDetector(cfg)
    values = noisy_decreasing(12)
    assert all(det.check(i, v) == [] for i, v in enumerate(values[:2]))  # too few values to judge
    assert all(det.check(i, v) == [] for i, v in enumerate(values[2:10], 2))
    events = det.check(10, values[10] * 1e4)
    assert [(e.verdict, e.evidence["warmup"]) for e in events] == [("spike", True)] and det.state.alarm
    assert det.seen == 10 and det.check(11, values[11]) == [] and det.seen == 11  # the outlier was not absorbed
    assert SpikeDetector(cfg).check(0, 1e30) == []  # nothing to compare the first value with


def test_clean_warmup_with_its_early_excursions_is_quiet():
    for signal in (noisy_decreasing(60, seed=3, noise=0.3), heavy_tailed_grad_norm(60, seed=4)):
        det = SpikeDetector(SpikeConfig.grad_norm())
        assert [e for i, v in enumerate(signal) for e in det.check(i, v)] == []
