"""PVF intervals against known binomial cases, healthy-spread thresholds, outcome classes."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import binom, binomtest

from sdcscope.study import classify, prediction_bound, pvf_table, wilson_interval

KNOWN = [  # (k, n, lo, hi): Wilson 95% score intervals (Newcombe 1998, Table I; statsmodels)
    (5, 10, 0.2365895, 0.7634105),
    (0, 10, 0.0, 0.2775328),
    (10, 10, 0.7224672, 1.0),
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize("k,n,lo,hi", KNOWN)
def test_wilson_known_cases(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


@given(st.integers(1, 400), st.data())
def test_wilson_matches_scipy_and_contains_estimate(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = wilson_interval(k, n)
    ref = binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert (lo, hi) == pytest.approx((ref.low, ref.high), abs=1e-9)
    assert 0 <= lo <= k / n <= hi <= 1


def test_wilson_coverage_is_near_nominal():
    n = 40
    intervals = [wilson_interval(k, n) for k in range(n + 1)]
    ps = [i / 100 for i in range(5, 96)]
    coverage = [sum(binom.pmf(k, n, p) for k, (lo, hi) in enumerate(intervals) if lo <= p <= hi) for p in ps]
    assert 0.94 < sum(coverage) / len(coverage) < 0.96 and min(coverage) > 0.9


def test_wilson_rejects_bad_counts():
    for k, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            wilson_interval(k, n)


def test_prediction_bound_rule():
    b = prediction_bound([1.0, 2.0, 3.0], alpha=0.01)
    assert b["t"] == pytest.approx(6.964557, rel=1e-5)
    assert b["bound"] == pytest.approx(2.0 + 6.964557 * 1.0 * math.sqrt(4 / 3), rel=1e-5)
    tight = prediction_bound([5.0, 5.0], alpha=0.01)  # no spread: the worst healthy value
    assert tight["bound"] == 5.0
    with pytest.raises(ValueError, match="2 finite"):
        prediction_bound([1.0], alpha=0.01)


def test_pvf_table_groups_and_intervals():
    rows = [{"site": "a", "effect": e} for e in ("sdc", "crash", "benign", "masked")] + [
        {"site": "b", "effect": "masked"}
    ]
    t = pvf_table(rows, ("site",))
    assert [(r["site"], r["incorrect"], r["trials"]) for r in t] == [("a", 2, 4), ("b", 0, 1)]
    assert (t[0]["lo"], t[0]["hi"]) == wilson_interval(2, 4) and t[0]["pvf"] == 0.5


TH = {"val_delta": 0.1, "loss_excess": 0.5, "dist_golden": 0.01}


def _m(**kw):
    base = {"crash": False, "masked": False, "loss_excess": 0.0, "val_delta": 0.0, "dist_golden": 0.0, "detected": None}
    return {**base, **kw}


@pytest.mark.parametrize(
    "measures,effect,kind",
    [
        (_m(crash=True, loss_excess=9.0), "crash", None),
        (_m(masked=True), "masked", None),
        (_m(loss_excess=0.6, val_delta=0.2), "sdc", "sharp"),
        (_m(val_delta=0.2, dist_golden=0.5), "sdc", "slow"),
        (_m(dist_golden=0.02), "sdc", "drift"),
        (_m(loss_excess=0.5, val_delta=0.1, dist_golden=0.01), "benign", None),  # bounds are inclusive
    ],
)
def test_classify_without_guard(measures, effect, kind):
    assert classify(measures, TH, guard=False) == {"effect": effect, "sdc_kind": kind, "outcome": effect}


def test_classify_with_guard():
    assert classify(_m(loss_excess=1.0, detected=1), TH, True)["outcome"] == "recovered"
    assert classify(_m(val_delta=0.3, detected=1), TH, True) == {
        "effect": "sdc",
        "sdc_kind": "slow",
        "outcome": "detected",
    }
    assert classify(_m(val_delta=0.3, detected=0), TH, True)["outcome"] == "sdc"


def test_trials_whose_fault_never_fired_are_no_part_of_pvf():
    from sdcscope.study.figures import pvf_heatmap

    rows = [{"target": "fc", "bit": 30, "effect": e} for e in ("sdc", "benign", "not_fired", "not_fired")]
    (row,) = pvf_table(rows, ("target",))
    assert (row["incorrect"], row["trials"]) == (1, 2)
    assert pvf_heatmap([r for r in rows if r["effect"] == "not_fired"]) is None  # nothing to draw
