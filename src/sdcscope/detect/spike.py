"""Spike detection on a scalar training signal (loss, global grad norm) with robust running stats.

Statistics are kept in log space by default (spikes are multiplicative). Two estimators:

* ``'mad'`` (default): median and MAD of the last ``window`` accepted values;
  z = (x − median) / (1.4826 · MAD). Robust to heavy tails (K2-V2 style).
* ``'ema'``: ZClip's EMA mean and variance (α = 0.97); z = (x − μ) / σ.

Two thresholds, kept apart on purpose:

* ``clip_z`` = 2.5 is ZClip's *clipping* threshold. Above it the step is "clip-worthy": the state
  reports ZClip's suggested value (``clip_to`` = μ + clip_z²·σ/z) for a mitigation to use, but no
  event is raised — on clean runs a few percent of steps cross 2.5.
* ``alarm_z`` (default 8) raises an :class:`Event`. OLMo 2 counts 7σ excursions against a rolling
  mean/std of 1000 values; a MAD-based σ is smaller than a std on heavy-tailed signals, so the
  alarm default is one σ more conservative, and an alarm also needs the value to be at least
  ``min_ratio`` × the baseline (a 7σ wiggle of a nearly noise-free loss is not a spike).
  The defaults (:meth:`SpikeConfig.loss`: z 8, ×1.5; :meth:`SpikeConfig.grad_norm`: z 8, ×5) sit
  above what clean runs of the reference GPT reach (``benchmarks/bench_guard_clean.py``), while
  a 10× spike is far above both.

Spiked values are not absorbed: a value beyond ``clip_z`` enters the statistics winsorised at
baseline ± clip_z·σ (ZClip updates its EMA with the clipped value), so a spike cluster cannot
raise its own baseline, while a genuine level shift is still followed, slowly. No verdict is
given during ``warmup`` accepted values, except for gross outliers (``warmup_ratio`` × the median
of the values so far). Non-finite or (in log space) non-positive values are
skipped — :class:`~sdcscope.detect.NonFiniteDetector` owns them.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import torch

from sdcscope.common.validate import check_bool, check_choice, check_float, check_non_negative, check_positive
from sdcscope.detect.events import Event
from sdcscope.detect.protocol import CheckView, Registration, register

SPIKE_METHODS = ("mad", "ema")
WATCHED = ("loss_value", "grad_norm")
"""The world values of a :class:`~sdcscope.detect.protocol.CheckView` a guard's spike detector watches."""
_MAD_TO_SIGMA = 1.4826


@dataclass(kw_only=True)
class SpikeConfig:
    signal: str = "loss"
    """Name of the watched signal (the event's ``module`` stays None; evidence names it)."""
    method: str = "mad"
    window: int = 200
    """Values in the MAD window (ignored by ``'ema'``)."""
    warmup: int = 50
    """Accepted values before the first verdict (ZClip 25, Megatron 100)."""
    alarm_z: float = 8.0
    clip_z: float = 2.5
    min_ratio: float = 1.5
    """An alarm also needs value ≥ min_ratio × baseline (≤ baseline / min_ratio when two-sided)."""
    warmup_ratio: float = 1000.0
    """During warm-up, once 3 values are in, a value ≥ this × their median (≤ median / this when
    two-sided) alarms at once: a gross outlier needs no statistics (a fault in a run's first
    steps; clean warm-up excursions stay within ~10×)."""
    ema_alpha: float = 0.97
    log_space: bool = True
    two_sided: bool = False
    """Also alarm on sudden drops."""

    def __post_init__(self) -> None:
        check_choice("method", self.method, SPIKE_METHODS)
        check_positive("window", self.window)
        check_non_negative("warmup", self.warmup)
        if self.method == "mad" and self.window < 3:
            raise ValueError(f"window={self.window} must be >= 3 for method 'mad'")
        check_float("alarm_z", self.alarm_z, low=0, low_open=True)
        check_float("clip_z", self.clip_z, low=0, low_open=True)
        check_float("min_ratio", self.min_ratio, low=1.0)
        check_float("warmup_ratio", self.warmup_ratio, low=1.0)
        check_float("ema_alpha", self.ema_alpha, low=0, high=1, low_open=True, high_open=True)
        check_bool("log_space", self.log_space)
        check_bool("two_sided", self.two_sided)
        if not isinstance(self.signal, str) or not self.signal:
            raise ValueError(f"signal={self.signal!r} must be a non-empty string")

    @classmethod
    def loss(cls, **kw) -> SpikeConfig:
        """Loss alarms: z > 8 and ≥ 1.5× the median (the default)."""
        return cls(**{"signal": "loss", **kw})

    @classmethod
    def grad_norm(cls, **kw) -> SpikeConfig:
        """Global grad-norm alarms: z > 8 and ≥ 5× the median. Clean runs of a small GPT had
        benign grad-norm excursions up to 3.7× the median (robust z up to 7.2)."""
        return cls(**{"signal": "grad_norm", "min_ratio": 5.0, **kw})

    @classmethod
    def zclip(cls, signal: str = "grad_norm", **kw) -> SpikeConfig:
        """ZClip's own setting (EMA α 0.97, z 2.5, 25 warm-up steps, linear space): use
        ``state.clip`` / ``state.clip_to`` to clip; alarms here fire at ``alarm_z``."""
        return cls(signal=signal, method="ema", warmup=25, log_space=False, **kw)


@dataclass
class SpikeState:
    """What the last :meth:`SpikeDetector.check` saw (in the signal's own units where noted)."""

    value: float = math.nan
    baseline: float = math.nan
    """Median (mad) or EMA mean, in signal units."""
    z: float = math.nan
    clip: bool = False
    """z > clip_z: ZClip would clip this value."""
    clip_to: float = math.nan
    """ZClip's target μ + clip_z²·σ/z, in signal units (NaN unless ``clip``)."""
    alarm: bool = False
    consecutive: int = 0
    """Alarms in a row including this one (persistence for heavier actions)."""


class SpikeDetector:
    """``check(step, value) -> list[Event]`` once per step, for one signal; in the guard
    ``check(view)`` reads the value from the view's ``watch`` (one of :data:`WATCHED`)."""

    name = "spike"

    def __init__(
        self, config: SpikeConfig | None = None, *, rank: int | None = None, watch: str = "loss_value"
    ) -> None:
        check_choice("spike watch", watch, WATCHED)
        self.config = config or SpikeConfig()
        self.rank = rank
        self.watch = watch
        self.state = SpikeState()
        self.seen = 0
        self._win: deque[float] = deque()
        self._sorted: list[float] = []
        self._mu = 0.0
        self._var = 0.0
        self._warm: list[float] = []

    def _to_space(self, v: float) -> float:
        return math.log(v) if self.config.log_space else v

    def _from_space(self, x: float) -> float:
        return math.exp(x) if self.config.log_space else x

    def _stats(self) -> tuple[float, float]:
        """(center, sigma) of the accepted history, in the working space."""
        if self.config.method == "ema":
            return self._mu, math.sqrt(max(self._var, 0.0))
        s = self._sorted
        med = _median(s)
        n = len(s)
        mad = (
            _kth_deviation(s, med, n // 2)
            if n % 2
            else 0.5 * (_kth_deviation(s, med, n // 2 - 1) + _kth_deviation(s, med, n // 2))
        )
        return med, _MAD_TO_SIGMA * mad

    def _absorb(self, x: float) -> None:
        cfg = self.config
        self.seen += 1
        if cfg.method == "ema":
            if self.seen <= max(cfg.warmup, 2):
                self._warm.append(x)
                n = len(self._warm)
                self._mu = sum(self._warm) / n
                self._var = sum((w - self._mu) ** 2 for w in self._warm) / n
                return
            a = cfg.ema_alpha
            self._mu = a * self._mu + (1 - a) * x
            self._var = a * self._var + (1 - a) * (x - self._mu) ** 2
            return
        self._win.append(x)
        bisect.insort(self._sorted, x)
        if len(self._win) > cfg.window:
            old = self._win.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def _warmup_check(self, step: int, v: float, x: float) -> list[Event]:
        """Before the first verdict: only a gross outlier against the median so far alarms (and
        is not absorbed); every other value joins the statistics."""
        cfg, st = self.config, self.state
        seen = self._sorted if cfg.method == "mad" else sorted(self._warm)
        if len(seen) >= 3:
            st.baseline = self._from_space(_median(seen))
            ratio = v / st.baseline if st.baseline else math.inf
            if ratio >= cfg.warmup_ratio or (cfg.two_sided and ratio * cfg.warmup_ratio <= 1):
                st.alarm, st.consecutive = True, st.consecutive + 1
                return [self._event(step, ratio, warmup=True, warmup_ratio=cfg.warmup_ratio, seen=self.seen)]
        self._absorb(x)
        st.consecutive = 0
        return []

    def check(self, step: int | CheckView, value: float | torch.Tensor | None = None) -> list[Event]:
        """The verdict on ``value`` at ``step``, which then joins the statistics. ``check(view)``:
        the guard's protocol, the value the view's :attr:`watch` (None -- no loss, no gradient --
        gives no verdict and teaches nothing)."""
        if isinstance(step, CheckView):
            step, value = step.step, getattr(step, self.watch)
            if value is None:
                return []
        cfg = self.config
        v = float(value.item() if isinstance(value, torch.Tensor) else value)
        st = SpikeState(value=v, consecutive=self.state.consecutive)
        self.state = st
        if not math.isfinite(v) or (cfg.log_space and v <= 0):
            return []
        x = self._to_space(v)
        if self.seen < max(cfg.warmup, 2):
            return self._warmup_check(step, v, x)
        center, sigma = self._stats()
        sigma = max(sigma, 1e-12 * max(1.0, abs(center)))
        z = (x - center) / sigma
        st.baseline, st.z = self._from_space(center), z
        score = abs(z) if cfg.two_sided else z
        ratio = v / st.baseline if st.baseline else math.inf
        far = ratio >= cfg.min_ratio or (cfg.two_sided and ratio <= 1 / cfg.min_ratio)
        st.clip = z > cfg.clip_z
        if st.clip:
            st.clip_to = self._from_space(center + cfg.clip_z**2 * sigma / z)
        st.alarm = score > cfg.alarm_z and far
        # winsorise before absorbing: a spike never raises its own baseline
        bound = cfg.clip_z * sigma
        self._absorb(min(max(x, center - bound), center + bound))
        if not st.alarm:
            st.consecutive = 0
            return []
        st.consecutive += 1
        return [self._event(step, ratio, z=z, alarm_z=cfg.alarm_z, min_ratio=cfg.min_ratio)]

    def _event(self, step: int, ratio: float, **detail) -> Event:
        """The alarm on the value :attr:`state` holds, with the ``detail`` of the test that fired."""
        cfg, st = self.config, self.state
        return Event(
            step,
            self.name,
            "spike",
            rank=self.rank,
            evidence={
                "signal": cfg.signal,
                "value": st.value,
                "baseline": st.baseline,
                "ratio": ratio,
                **detail,
                "method": cfg.method,
                "log_space": cfg.log_space,
                "consecutive": st.consecutive,
            },
        )


def _median(s: list[float]) -> float:
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def _kth_deviation(s: list[float], center: float, k: int) -> float:
    """The ``k``-th smallest (from 0) of ``|x - center|`` over the sorted list ``s``, in O(log n):
    the deviations below ``center`` (read downwards) and above it (read upwards) are two sorted
    runs, and the k + 1 smallest take some ``a`` from the first and ``k + 1 - a`` from the second;
    bisect on ``a``. (A full sort of the deviations costs a few hundred Python operations a step.)"""
    p = bisect.bisect_left(s, center)  # s[:p] < center <= s[p:]
    below, above = p, len(s) - p
    lo, hi = max(0, k + 1 - above), min(k + 1, below)
    while lo < hi:  # smallest a with L[a] >= R[k - a] (or a = below)
        a = (lo + hi) // 2
        if center - s[p - 1 - a] < s[p + k - a] - center:
            lo = a + 1
        else:
            hi = a
    a, b = lo, k + 1 - lo
    left = center - s[p - a] if a else -math.inf  # L[a - 1]
    right = s[p + b - 1] - center if b else -math.inf  # R[b - 1]
    return max(left, right)


register(
    Registration(
        "loss_spike",
        SpikeConfig,
        lambda model, optimizer, config, rank: SpikeDetector(config, rank=rank, watch="loss_value"),
        world_values=True,
        rolls_back=True,
    )
)
register(
    Registration(
        "grad_spike",
        SpikeConfig,
        lambda model, optimizer, config, rank: SpikeDetector(config, rank=rank, watch="grad_norm"),
        world_values=True,
        rolls_back=True,
    )
)
