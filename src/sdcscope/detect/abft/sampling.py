"""Which layers ABFT checks on each step: a deterministic rotation, sized by ``every`` and
``layer_fraction``, or from measured step times to stay within ``budget``."""

from __future__ import annotations

import math
import random
import time

from sdcscope.detect.abft.config import ABFTConfig
from sdcscope.detect.abft.records import Layer

BUDGET_AIM = 0.75
"""Share of ``budget`` the sampling plan aims at (headroom for timing noise)."""


class Sampler:
    """The rotation over a detector's layers. ``plan`` = (layers per checked step, check every
    that many steps); with a budget the plan starts at full coverage on step 0, none on step 1."""

    def __init__(self, config: ABFTConfig, n_layers: int) -> None:
        self.budget = config.budget
        self.random = config.order == "random" and config.budget is None
        self.seed = config.seed
        self.fraction = config.layer_fraction
        self.plan = (
            (n_layers, 2)
            if config.budget is not None
            else (max(1, math.ceil(config.layer_fraction * n_layers)), config.every)
        )
        self.rot = 0  # next position of the rotation
        self.chosen_rot = 0  # the rotation after the current step's choice
        self.last_checked: tuple[int, list[Layer], int] | None = None  # (step, its layers, rotation)
        self._last_check: tuple[float, int] | None = None  # (wall time, step) of the last check
        self._cost_per_layer: float | None = None
        self._base_step: float | None = None

    def choose(self, step: int, layers: list[Layer], unreached: set[str]) -> list[Layer]:
        """The layers checked on ``step``: those of the last checked step again when it is
        ``step`` (a replay), else the next ones of the rotation over the reached layers."""
        again = self.last_checked
        if again is not None and again[0] == step:
            _, chosen, self.rot = again
        else:
            k, every = self.plan
            pool = [x for x in layers if x.name not in unreached] or layers
            if step % every:
                chosen = []
            else:
                n = len(pool)
                k = min(k, n)
                if self.random:  # each layer with probability fraction; a function of (seed, step) alone
                    rng = random.Random(self.seed * 1_000_003 + step)
                    chosen = [x for x in pool if rng.random() < self.fraction]
                else:
                    chosen = [pool[(self.rot + i) % n] for i in range(k)]
                    self.rot = (self.rot + k) % max(n, 1)
        self.chosen_rot = self.rot
        return chosen

    def checked(self, step: int, chosen: list[Layer]) -> None:
        """``step`` was judged with ``chosen``: a replay of it arms them again."""
        self.last_checked = (step, chosen, self.chosen_rot)

    def update(self, step: int | None, n_checked: int, n_layers: int) -> None:
        """Budget mode: size the rotation from measured step times. Checked and unchecked steps
        alternate (the plan checks at most every other step), so the wall time of an unchecked
        step is the baseline and a checked step's excess over it, per layer, is the whole cost
        of checking — hooks, autograd nodes, memory traffic, the judgement — not just the part a
        timer around the hooks would see. Layers per checked step = 2·AIM·budget·base/cost: the
        plan aims below the budget (:data:`BUDGET_AIM`), since step times are noisy estimates and
        unchecked steps carry a small fixed cost the measurement cannot separate."""
        now = time.perf_counter()
        last, self._last_check = self._last_check, (now, step)
        if last is None or step is None or last[1] is None or step <= last[1]:
            return
        dt = (now - last[0]) / (step - last[1])
        ema = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
        if n_checked == 0:
            self._base_step = ema(self._base_step, dt)
        elif self._base_step is not None:
            self._cost_per_layer = ema(self._cost_per_layer, max(dt - self._base_step, 0.0) / n_checked)
        if self._base_step is None or self._cost_per_layer is None:
            return
        per_step = BUDGET_AIM * self.budget * self._base_step / max(self._cost_per_layer, 1e-12)
        n = n_layers
        self.plan = (
            (min(n, max(1, int(2 * per_step))), 2) if 2 * per_step >= 1 else (1, min(10_000, math.ceil(1 / per_step)))
        )
