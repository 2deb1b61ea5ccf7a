"""Statistics of a campaign: Wilson intervals for PVF and healthy-spread outcome thresholds.

**PVF** (parameter vulnerability factor, Jiao et al.): the share of trials with an incorrect
outcome, ``D / N``, here per layer, site, bit and fault model, with a Wilson score interval.

**Thresholds.** A faulty trial is *outside healthy variance* on a measure when it exceeds the
bound set by the healthy runs continued from the same snapshot with other data-order seeds
(K >= 2 values ``h``: each healthy run's deviation from golden, taken as a magnitude, since a
re-seeded run may land on either side of golden -- golden itself must lie inside the spread)::

    bound = max( max(h),  mean(h) + t(1 - alpha, K - 1) * sd(h) * sqrt(1 + 1/K) )

the larger of the worst healthy value and the one-sided ``1 - alpha`` Student-t prediction bound
for one more healthy run (``alpha`` = ``baseline.alpha``, default 0.01). Measures: ``val_delta``
(final val loss minus golden's), ``loss_excess`` (largest per-step training loss above golden's
over the horizon) and ``dist_golden`` (relative L2 distance of the final parameters to golden's).

**Effects of a finding** (a study's claim, e.g. "removing the fault raises the loss"): the mean of
per-unit paired differences (one per seed x cell) with a two-sided Student-t interval
(:func:`mean_interval`), or a seeded percentile bootstrap for other statistics
(:func:`bootstrap_interval`), judged against the healthy spread of the same measure
(:func:`effect_verdict`): an effect *holds* only when its interval excludes zero in the stated
direction and its size exceeds the spread; otherwise it is *within noise*.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from sdcscope.study.outcomes import NOT_FIRED

__all__ = [
    "Z95",
    "wilson_interval",
    "prediction_bound",
    "THRESHOLD_MEASURES",
    "RULE",
    "pvf_table",
    "INCORRECT",
    "mean_interval",
    "bootstrap_interval",
    "effect_verdict",
    "VERDICTS",
    "DIRECTIONS",
]

Z95 = 1.959963984540054
"""The 0.975 quantile of the standard normal (two-sided 95%)."""
THRESHOLD_MEASURES = ("val_delta", "loss_excess", "dist_golden")
RULE = "max(max(h), mean(h) + t[1-alpha, K-1] * sd(h) * sqrt(1 + 1/K))"
INCORRECT = ("crash", "sdc")
"""Effects that count as incorrect for PVF."""
VERDICTS = ("holds", "within noise", "does not hold")
DIRECTIONS = ("+", "-", "0")
"""A finding's stated direction: an increase, a decrease, or no effect beyond the healthy spread."""


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``k / n`` (default 95%)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ValueError(f"k={k!r} must be an int in [0, n={n}]")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo, hi = max(0.0, center - half), min(1.0, center + half)
    return (0.0 if k == 0 else lo, 1.0 if k == n else hi)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz; converges fast for x < (a + 1) / (a + b + 2), else through I_x(a, b) = 1 - I_{1-x}(b, a))."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 10_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return front * f


def _t_quantile(q: float, dof: int) -> float:
    """The ``q`` quantile of Student's t with ``dof`` degrees of freedom (scipy's ``stdtrit``),
    without scipy: closed forms for 1 and 2 degrees of freedom, else bisection down to adjacent
    floats of ``P(|T| < t) = I_{t²/(ν+t²)}(1/2, ν/2) = 1 - 2p`` near the centre and of
    ``P(T > t) = I_{ν/(ν+t²)}(ν/2, 1/2) / 2 = p`` in the tail (p = min(q, 1 - q), exact in floats)."""
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof={dof!r} must be an int >= 1")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q!r} must lie in (0, 1)")
    if q == 0.5:
        return 0.0
    sign, p = (1.0, 1.0 - q) if q > 0.5 else (-1.0, q)  # p = the tail beyond |t|, exact in floats
    if dof == 1:
        return sign / math.tan(math.pi * p)
    if dof == 2:
        return sign * (1 - 2 * p) / math.sqrt(2 * p * (1 - p))
    nu = float(dof)
    if p > 0.25:  # below the target: P(|T| < t) < 1 - 2p
        target = 1 - 2 * p
        below = lambda t: _betainc(0.5, nu / 2, t * t / (nu + t * t)) < target
    else:  # below the target: P(T > t) > p
        below = lambda t: 0.5 * _betainc(nu / 2, 0.5, nu / (nu + t * t)) > p
    lo, hi = 0.0, 1.0
    while below(hi):
        lo, hi = hi, hi * 2
    while (mid := (lo + hi) / 2) not in (lo, hi):
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return sign * hi


def prediction_bound(values: Sequence[float], alpha: float) -> dict[str, float]:
    """The threshold of one measure from its healthy values (see the module docstring)."""
    h = [float(v) for v in values]
    if len(h) < 2 or not all(math.isfinite(v) for v in h):
        raise ValueError(f"healthy values must be >= 2 finite numbers, got {h!r}")
    mean, sd, k = statistics.fmean(h), statistics.stdev(h), len(h)
    t = _t_quantile(1 - alpha, k - 1)
    bound = max(max(h), mean + t * sd * math.sqrt(1 + 1 / k))
    return {"bound": bound, "n": k, "mean": mean, "sd": sd, "max": max(h), "t": t, "alpha": alpha}


def pvf_table(rows: Iterable[dict], by: Sequence[str]) -> list[dict]:
    """PVF with Wilson 95% intervals grouped by the columns ``by`` (rows: trial rows with
    ``effect``; those whose fault never fired are no trial of the fault); sorted by group key."""
    groups: dict[tuple, list[int]] = {}
    for r in rows:
        if r["effect"] == NOT_FIRED:
            continue
        key = tuple(r[c] for c in by)
        g = groups.setdefault(key, [0, 0])
        g[0] += r["effect"] in INCORRECT
        g[1] += 1
    out = []
    for key in sorted(
        groups, key=lambda k: tuple((v is None, str(v) if not isinstance(v, (int, float)) else v) for v in k)
    ):
        d, n = groups[key]
        lo, hi = wilson_interval(d, n)
        out.append({**dict(zip(by, key)), "incorrect": d, "trials": n, "pvf": d / n, "lo": lo, "hi": hi})
    return out


def _level(level: float) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < level < 1.0:
        raise ValueError(f"level={level!r} must be a number in (0, 1), e.g. 0.95")
    return float(level)


def _finite(name: str, values: Sequence[float], least: int) -> list[float]:
    xs = [float(v) for v in values]
    if len(xs) < least or not all(math.isfinite(v) for v in xs):
        raise ValueError(f"{name} must be >= {least} finite numbers, got {xs!r}")
    return xs


def mean_interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """The mean of ``values`` (>= 2 paired differences, one per independent unit) with its two-sided
    Student-t interval at ``level``: ``mean ± t[(1+level)/2, n-1] * sd / sqrt(n)``."""
    xs, level = _finite("values", values, 2), _level(level)
    n, mean, sd = len(xs), statistics.fmean(xs), statistics.stdev(xs)
    half = _t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "sd": sd, "level": level}


def bootstrap_interval(
    samples: Sequence[Sequence[float]],
    statistic: Callable[..., float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """``statistic(*samples)`` with a percentile bootstrap interval at ``level``: each sample is
    resampled with replacement, independently, ``resamples`` times (a seeded generator: the same
    inputs give the same interval)."""
    groups, level = [_finite("each sample", s, 1) for s in samples], _level(level)
    if not groups:
        raise ValueError("samples must hold at least one sample")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"resamples={resamples!r} must be an int >= 100")
    rng = random.Random(seed)
    draws = sorted(statistic(*(rng.choices(g, k=len(g)) for g in groups)) for _ in range(resamples))
    k = round((1 - level) / 2 * (resamples - 1))
    return {"mean": statistic(*groups), "lo": draws[k], "hi": draws[-1 - k], "n": min(map(len, groups)), "level": level}


def effect_verdict(interval: Mapping[str, float], spread: float, direction: str, null: float = 0.0) -> str:
    """The verdict (one of VERDICTS) on a finding's effect ``interval`` (``mean``, ``lo``, ``hi``)
    against the healthy ``spread`` of its measure, for the stated ``direction`` (DIRECTIONS):

    - ``+`` / ``-``: *holds* when the interval lies above (below) ``null`` and the effect's distance
      from it exceeds ``spread``; *does not hold* when the interval lies wholly on the other side;
      else *within noise*.
    - ``0`` (no effect beyond the spread): *holds* when the interval lies within ``null ± spread``;
      *does not hold* when it lies wholly outside; else *within noise* (not resolved either way).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not spread >= 0:
        raise ValueError(f"spread={spread!r} must be a number >= 0")
    lo, hi, mean = interval["lo"] - null, interval["hi"] - null, interval["mean"] - null
    if direction == "0":
        if -spread <= lo and hi <= spread:
            return "holds"
        return "does not hold" if lo > spread or hi < -spread else "within noise"
    sign = 1.0 if direction == "+" else -1.0
    lo, hi, mean = (lo, hi, mean) if sign > 0 else (-hi, -lo, -mean)
    if lo > 0 and mean > spread:
        return "holds"
    return "does not hold" if hi < 0 else "within noise"
