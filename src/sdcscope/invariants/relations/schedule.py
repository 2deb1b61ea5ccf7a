"""LRSchedule: the learning rate warms up to a peak, then decays the way the references' did.

Judged on the learning rate of the first param group at each ``optimizer.step`` (``lr``; the
other groups keep their ratio to it, ``APIArgRatio``).  Everything is a ratio within the run
(a value against the previous one, or against the run's peak), so the base learning rate the
schedule multiplies never matters: another learning rate is no violation.

- **Warm-up.** The warm-up is the run's first steps, as long as each raises the learning rate;
  the step where it stops is the peak.  Learned: the references' peak step; checked: the run's
  learning rate stops rising by ``max_peak`` = ``WARMUP_FACTOR`` x (the references' latest
  peak step + 1) steps from its start (the documented tolerance: a warm-up up to that many
  times longer, or shorter, or none).  A warm-up that never ends (its length given in tokens
  instead of steps, a ``min(1, s / warm)`` whose ``warm`` is the run length) is out of it; a
  run that ends still warming up, having run as long as the shortest reference, is reported
  when the checking ends.
- **Decay.** After the peak the references' learning rate follows one of the shapes of
  ``SHAPES`` (``classify``), and a checked run's must stay ``compatible`` with it: never rise
  again (for every decaying shape), keep decreasing at every step while it is above the
  lowest fraction of its peak the references reached (``floor``; a decay that stalls for
  ``STALL`` steps: a scheduler not stepped, stepping another optimizer), and fit the shape
  (equal decrements for ``linear``, an equal ratio for ``exponential``, a cosine for
  ``cosine``: ``y[i+1] + y[i-1] = a y[i] + b`` with ``a <= 2``, of which a linear decay is the
  limit of a long horizon; judged on those of the last ``WINDOW`` values that lie after step
  ``max_peak``: a warm-up that multiplies the decay, ``min(1, s / warm) x cos(...)``, bends it
  until its own end).  ``constant`` keeps the peak, ``step`` drops now and then and never
  rises, ``decay`` is any other monotone decrease; references that disagree, or whose rate
  rises again after its peak (cyclic schedules), give no decay check.

A run that does not start at the references' first step (resumed) is judged only when it
resumes at or after step ``start + max_peak``, past any warm-up the references allow, and only
on its rate never rising (references with a decay shape): a rate that rises there is a warm-up
restarted by the resume (a scheduler rebuilt instead of restored).  Its peak lies before the
resume, so the decay's floor and shape are not judged.  A run resumed earlier is not judged.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from sdcscope.common.validate import check_choice
from sdcscope.invariants.relations.base import Check, InferConfig, Relation, View, as_number, register
from sdcscope.invariants.spec import Invariant, Precondition

SHAPES = ("constant", "linear", "exponential", "cosine", "step", "decay")
SMOOTH = frozenset({"linear", "exponential", "cosine", "decay"})
"""Shapes whose learning rate decreases at every step after the peak."""
WARMUP_FACTOR = 4
"""A checked run may peak up to this many times later than the references' latest peak."""
TOL = 1e-6
"""Relative change below which two learning rates are the same (float32 rates round ~1e-7)."""
FIT_TOL = 1e-5
"""Largest deviation from a shape's fit, relative to the peak (rounding; shapes differ by >1e-3)."""
MIN_SEGMENT = 5
"""Values after the peak a shape is inferred from, and judged on."""
STALL = 2
"""Consecutive unchanged steps that stop a smooth decay above its floor."""
WINDOW = 16
"""Values after the peak a checked run's shape is judged on (the last ones)."""


def lr_of(view: View) -> float | None:
    """The first param group's learning rate at the record's first ``optimizer.step``."""
    calls = view.fields.get("optimizer.step")
    x = as_number(calls[0].get("lr")) if calls else None
    return x if x is not None and math.isfinite(x) and x >= 0 else None


def peak_index(values: list[float]) -> int:
    """How many leading steps raise the learning rate: the index of the warm-up's peak."""
    i = 0
    while i + 1 < len(values) and values[i + 1] > values[i] * (1 + TOL):
        i += 1
    return i


def _same(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= TOL * scale


def _recurrence(y: list[float]) -> tuple[float, float, float]:
    """Least-squares ``a, b`` of ``y[i+1] + y[i-1] = a y[i] + b`` and its largest residual."""
    xs = y[1:-1]
    ts = [y[i + 1] + y[i - 1] for i in range(1, len(y) - 1)]
    n, sx, st = len(xs), sum(xs), sum(ts)
    sxx = sum(x * x for x in xs)
    den = n * sxx - sx * sx
    if den <= 1e-30 * max(1.0, sxx * n):
        return 2.0, 0.0, 0.0  # constant: a line, trivially
    a = (n * sum(x * t for x, t in zip(xs, ts)) - sx * st) / den
    b = (st - a * sx) / n
    return a, b, max(abs(t - a * x - b) for x, t in zip(xs, ts))


def fits(shape: str, y: list[float]) -> bool:
    """Whether the values after the peak ``y`` (relative to the peak) fit ``shape``; see the module doc."""
    pairs = list(zip(y, y[1:]))
    if any(b > a * (1 + TOL) for a, b in pairs):
        return False  # rises again
    if shape == "constant":
        return all(_same(x, y[0], y[0]) for x in y)
    if shape in ("step", "decay") or len(y) < 3:
        return True
    if shape == "linear":
        return all(abs(y[i + 1] - 2 * y[i] + y[i - 1]) <= FIT_TOL for i in range(1, len(y) - 1))
    if shape == "exponential":
        ratios = [b / a for a, b in pairs if a > 0]
        return bool(ratios) and max(ratios) - min(ratios) <= FIT_TOL * 10
    a, _, residual = _recurrence(y)  # cosine
    return residual <= FIT_TOL and a <= 2 + FIT_TOL


def classify(y: list[float]) -> str | None:
    """The shape of the values after a peak (relative to it); None: too few, or rising again."""
    if len(y) < MIN_SEGMENT or any(b > a * (1 + TOL) for a, b in zip(y, y[1:])):
        return None
    changes = sum(not _same(a, b, y[0]) for a, b in zip(y, y[1:]))
    if changes == 0:
        return "constant"
    if changes < (len(y) - 1) / 2:
        return "step"
    if changes < len(y) - 1:
        return "decay"
    return next((s for s in ("linear", "exponential", "cosine") if fits(s, y)), "decay")


def _series(trace) -> list[tuple[int, float]]:
    out = []
    for r in trace.phase("train"):
        x = lr_of(View(r))
        if x is not None:
            out.append((r["step"], x))
    return out


@register
class LRSchedule(Relation):
    name = "LRSchedule"
    required = {"start": int, "max_peak": int, "min_steps": int}
    optional = {"shape": str, "floor": (int, float)}

    @classmethod
    def validate(cls, params):
        super().validate(params)
        if params["start"] < 0 or params["max_peak"] < 1 or params["min_steps"] < 1:
            raise ValueError(f"LRSchedule: start must be >= 0, max_peak and min_steps >= 1, not {params!r}")
        if "shape" in params:
            check_choice("LRSchedule shape", params["shape"], SHAPES)
        if not 0 <= params.get("floor", 0) <= 1:
            raise ValueError(f"LRSchedule: floor={params['floor']!r} must be in [0, 1] (a fraction of the peak)")

    @classmethod
    def infer(cls, traces, config: InferConfig) -> list[Invariant]:
        series = [_series(t) for t in traces]
        if not all(series) or len({s[0][0] for s in series}) != 1:
            return []
        values = [[x for _, x in s] for s in series]
        if any(max(v) <= 0 for v in values) or sum(map(len, values)) < config.min_support:
            return []
        peaks = [peak_index(v) for v in values]
        if any(p == len(v) - 1 for p, v in zip(peaks, values)):
            return []  # a reference still warming up when it ended: no peak to learn
        params: dict[str, Any] = {
            "start": series[0][0][0],
            "max_peak": WARMUP_FACTOR * (max(peaks) + 1),
            "min_steps": min(map(len, values)),
        }
        segments = [[x / v[p] for x in v[p:]] for p, v in zip(peaks, values)]
        shapes = {classify(y) for y in segments}
        shape = shapes.pop() if len(shapes) == 1 else None
        text = ""
        if shape is not None:
            params["shape"] = shape
            text = f", then decays as a {shape} schedule (references' shape)"
            if shape in SMOOTH:
                params["floor"] = min(y[-1] for y in segments)
                text += f", at every step down to {params['floor']:.3g} of its peak"
        return [
            Invariant(
                id="schedule.train.lr",
                relation=cls.name,
                params=params,
                precondition=Precondition(phase="train", when=("optimizer.step",)),
                description=f"the learning rate's warm-up peaks within {params['max_peak']} steps "
                f"(references: step {max(peaks)}){text}",
                support=sum(map(len, values)),
            )
        ]

    @classmethod
    def bind(cls, inv, header):
        return _ScheduleCheck(inv)


class _ScheduleCheck(Check):
    """Incremental: the warm-up's state, the peak, and the last ``WINDOW`` values after it (a
    shape is judged on a sliding window: its fit is local, so a long run costs no more per step)."""

    def __init__(self, inv: Invariant) -> None:
        super().__init__(inv)
        p = inv.params
        self.start, self.max_peak, self.min_steps = p["start"], p["max_peak"], p["min_steps"]
        self.shape, self.floor = p.get("shape"), p.get("floor", 0.0)
        self.n, self.last_step = 0, -1
        self.judged = True  # False: the run did not start where the references did
        self.resumed: int | None = None  # the step a run resumed at (judged: rises only)
        self.peak: tuple[int, float] | None = None  # step and value, once the warm-up has ended
        self.prev = 0.0
        self.tail: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (step, value / peak) after the peak
        self.reported: set[str] = set()

    def check(self, view: View):
        x = lr_of(view)
        if not self.judged or x is None or view.step <= self.last_step:  # a rolled-back step runs again
            return []
        if not self.n and view.step != self.start:
            if view.step < self.start + self.max_peak or self.shape is None:
                self.judged = False
                return []
            self.resumed = view.step  # past any warm-up the references allow: the peak lies before
            self.peak, self.n, self.last_step, self.prev = (view.step, x), 1, view.step, x
            self.tail.append((view.step, 1.0))
            return []
        self.n += 1
        self.last_step, prev, self.prev = view.step, self.prev, x
        if self.peak is None:
            if self.n == 1 or x > prev * (1 + TOL):
                if self.n > self.max_peak:
                    return self._report("warmup", view.step, rising_steps=self.n - 1, max_peak=self.max_peak)
                return []
            self.peak = (self.last_step - 1, prev)  # the previous step was the peak
            self.tail.append((self.last_step - 1, 1.0))
        return self._decay(view.step, x)

    def _decay(self, step: int, x: float) -> list[tuple[str, dict[str, Any]]]:
        peak_step, peak = self.peak
        if not peak > 0 or self.shape is None:
            return []
        y = x / peak
        before = self.tail[-1][1]
        self.tail.append((step, y))
        tail = [v for _, v in self.tail]
        found = []
        if y > before * (1 + TOL):
            found += self._report("rise", step, lr=x, peak_step=peak_step)
        if self.resumed is not None:  # y is a fraction of the rate at the resume, not of the peak
            return found
        elif self.shape == "constant" and not _same(y, 1.0, 1.0):
            found += self._report("shape", step, lr=x, peak_step=peak_step)
        if self.shape in SMOOTH and len(tail) > STALL and y > self.floor * (1 + TOL):
            last = tail[-STALL - 1 :]
            if all(_same(a, b, 1.0) for a, b in zip(last, last[1:])):
                found += self._report("stall", step, lr=x, floor=self.floor)
        settled = [v for st, v in self.tail if st >= self.start + self.max_peak]  # no warm-up multiplier left
        if len(settled) >= MIN_SEGMENT and not fits(self.shape, settled):
            found += self._report("shape", step, lr=x, peak_step=peak_step)
        return found

    def _report(self, rule: str, step: int, **facts: Any) -> list[tuple[str, dict[str, Any]]]:
        """The first violation of each rule (a schedule that is wrong stays wrong)."""
        if rule in self.reported:
            return []
        self.reported.add(rule)
        meaning = {
            "warmup": f"the learning rate is still rising at step {step}: the warm-up never reaches its "
            f"peak (references' schedule peaks within {self.max_peak} steps)",
            "rise": f"the learning rate rose at step {step}, after its warm-up had peaked"
            + (
                ""
                if self.resumed is None
                else f" (the run resumed at step {self.resumed}, after any warm-up the references "
                "allow: the warm-up restarted)"
            ),
            "stall": f"the learning rate stopped decaying at step {step} ({STALL} steps unchanged above "
            f"{self.floor:.3g} of its peak): the references' {self.shape} decay does not proceed",
            "shape": f"the learning rate after its peak no longer follows the references' {self.shape} schedule",
        }[rule]
        return [("lr", {"rule": rule, "step": step, **facts, "meaning": meaning})]

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """The run ended while its learning rate still rose, after as many steps as a reference ran."""
        if not self.judged or self.peak is not None or self.n < max(2, self.min_steps):
            return []
        return self._report("warmup", self.last_step, rising_steps=self.n - 1, max_peak=self.max_peak)
