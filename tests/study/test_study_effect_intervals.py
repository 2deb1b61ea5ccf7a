"""A finding's effect interval and verdict: the t interval of paired differences, the seeded
bootstrap, and "holds" only when the interval clears zero in the stated direction and the effect
exceeds the healthy spread."""

import statistics

import pytest

from sdcscope.study.stats import bootstrap_interval, effect_verdict, mean_interval


def test_t_interval_of_paired_differences_matches_the_textbook_formula():
    diffs = [0.10, 0.12, 0.07, 0.11]  # sd 0.02160; t[0.975, 3] = 3.1824
    out = mean_interval(diffs)
    half = 3.182446305 * statistics.stdev(diffs) / 2
    assert out["mean"] == pytest.approx(0.1)
    assert (out["lo"], out["hi"]) == pytest.approx((0.1 - half, 0.1 + half), rel=1e-8)
    assert out["n"] == 4
    narrow = mean_interval(diffs, level=0.5)
    assert out["lo"] < narrow["lo"] < narrow["hi"] < out["hi"]


@pytest.mark.parametrize(
    "interval, spread, direction, verdict",
    [
        ({"mean": 0.10, "lo": 0.06, "hi": 0.14}, 0.03, "+", "holds"),
        ({"mean": 0.02, "lo": 0.01, "hi": 0.03}, 0.03, "+", "within noise"),  # clears zero, not the spread
        ({"mean": 0.10, "lo": -0.01, "hi": 0.21}, 0.03, "+", "within noise"),  # large, but the interval holds 0
        ({"mean": -0.10, "lo": -0.14, "hi": -0.06}, 0.03, "+", "does not hold"),  # the other sign
        ({"mean": -0.10, "lo": -0.14, "hi": -0.06}, 0.03, "-", "holds"),
        ({"mean": 0.005, "lo": -0.01, "hi": 0.02}, 0.03, "0", "holds"),  # inside ± spread
        ({"mean": 0.02, "lo": -0.01, "hi": 0.05}, 0.03, "0", "within noise"),
        ({"mean": 0.08, "lo": 0.05, "hi": 0.11}, 0.03, "0", "does not hold"),
    ],
)
def test_verdict_needs_the_interval_and_the_spread(interval, spread, direction, verdict):
    assert effect_verdict(interval, spread, direction) == verdict


def test_verdict_against_a_null_other_than_zero():
    ratio = {"mean": 40.0, "lo": 12.0, "hi": 90.0}
    assert effect_verdict(ratio, 0.0, "+", null=10.0) == "holds"
    assert effect_verdict({**ratio, "lo": 8.0}, 0.0, "+", null=10.0) == "within noise"


def test_bootstrap_is_seeded_and_brackets_the_statistic():
    a, b = [1.0, 2.0, 3.0, 5.0, 8.0], [20.0, 30.0, 50.0, 80.0]
    ratio = lambda x, y: statistics.median(y) / statistics.median(x)  # noqa: E731
    first = bootstrap_interval([a, b], ratio)
    assert first == bootstrap_interval([a, b], ratio)  # the same inputs, the same interval
    assert first["lo"] <= first["mean"] <= first["hi"] and first["mean"] == 40.0 / 3.0
    means = lambda x, y: statistics.fmean(y) - statistics.fmean(x)  # noqa: E731
    assert bootstrap_interval([a, b], means, seed=1)["lo"] != bootstrap_interval([a, b], means)["lo"]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mean_interval([0.1]), ">= 2 finite"),
        (lambda: mean_interval([0.1, float("nan")]), ">= 2 finite"),
        (lambda: mean_interval([0.1, 0.2], level=95), "level"),
        (lambda: bootstrap_interval([[1.0]], statistics.fmean, resamples=10), "resamples"),
        (lambda: effect_verdict({"mean": 0, "lo": 0, "hi": 0}, 0.1, "up"), "direction"),
        (lambda: effect_verdict({"mean": 0, "lo": 0, "hi": 0}, -1.0, "+"), "spread"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
