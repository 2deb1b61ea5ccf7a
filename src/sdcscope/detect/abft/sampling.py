"""Which layers ABFT checks on each step: a fixed rotation that checks every layer within a known
number of steps (``layer_fraction``, ``every``), a random draw (``order: random``), or a rotation
sized from measured step times to stay within ``budget``."""

from __future__ import annotations

import math
import random
import time
from collections import Counter

from sdcscope.detect.abft.config import ABFTConfig
from sdcscope.detect.abft.records import Layer

BUDGET_AIM = 0.75
"""Share of ``budget`` the sampling plan aims at (headroom for timing noise)."""


class Sampler:
    """The choice of a detector's checked layers, on steps with ``step % every == 0``. With a
    budget, ``plan`` = (layers per checked step, ``every``) is sized from step times: full
    coverage on step 0, none on step 1, then a rotation over the layers.

    The fixed rotation deals the ``n`` layers evenly into ``cycle`` = ⌈1 / layer_fraction⌉ slots
    (layer ``p`` in slot ``⌊p · cycle / n⌋``: ⌊n / cycle⌋ or ⌈n / cycle⌉ layers each, some empty
    when n < cycle) and checks slot ``(step // every + offset) mod cycle`` on a checked step, the
    offset drawn from ``seed``. Each layer is checked once every ``every · cycle`` steps -- the
    random draw's rate and price, with a bound -- and a step's layers are a function of (seed,
    step, layers) alone (a replay or a resumed run checks the same ones). A layer's slot never
    depends on the others, so a layer leaving the rotation (unreached) moves no other's turn."""

    def __init__(self, config: ABFTConfig, n_layers: int) -> None:
        self.budget = config.budget
        self.mode = "budget" if config.budget is not None else config.order
        self.seed = config.seed
        self.fraction = config.layer_fraction
        self.plan = (n_layers, 2 if config.budget is not None else config.every)
        self.cycle = math.ceil(round(1 / config.layer_fraction, 9))  # the fixed rotation's slots
        self.slot_of = [p * self.cycle // n_layers for p in range(n_layers)]  # each layer's slot
        self.offset = random.Random(config.seed).randrange(self.cycle)  # the slot of step 0
        self.rot = 0  # budget mode: next position of its rotation
        self.chosen_rot = 0  # budget mode: the rotation after the current step's choice
        self.last_checked: tuple[int, list[Layer], int] | None = None  # (step, its layers, rotation)
        self._last_check: tuple[float, int] | None = None  # (wall time, step) of the last check
        self._cost_per_layer: float | None = None
        self._base_step: float | None = None

    def bound(self) -> tuple[int, int, int] | None:
        """(fewest, most layers checked on a checked step, steps within which every layer is
        checked) of the fixed rotation; None where nothing bounds it (a random draw, a budget,
        no layers)."""
        if self.mode != "rotation" or not self.slot_of:
            return None
        sizes = Counter(self.slot_of)
        fewest = min(sizes.values()) if len(sizes) == self.cycle else 0
        return fewest, max(sizes.values()), self.plan[1] * self.cycle

    def choose(self, step: int, layers: list[Layer], unreached: set[str]) -> list[Layer]:
        """The layers checked on ``step``: those of the last checked step again when it is
        ``step`` (a replay: the same layers even if one has since turned out unreached), else the
        step's slot of the rotation, its random draw, or the budget rotation's next layers, the
        :attr:`~sdcscope.detect.abft.detector.ABFTDetector.unreached` ones left out (unless all are)."""
        again = self.last_checked
        if again is not None and again[0] == step:
            _, chosen, self.rot = again
        else:
            k, every = self.plan  # k: the budget's alone
            skip = unreached if len(unreached) < len(layers) else set()
            if step % every:
                chosen = []
            elif self.mode == "rotation":
                slot = (step // every + self.offset) % self.cycle
                chosen = [x for x, s in zip(layers, self.slot_of) if s == slot and x.name not in skip]
            elif self.mode == "random":  # each layer with probability fraction; a function of (seed, step) alone
                rng = random.Random(self.seed * 1_000_003 + step)
                chosen = [x for x in layers if x.name not in skip and rng.random() < self.fraction]
            else:
                pool = [x for x in layers if x.name not in skip]
                n = len(pool)
                chosen = [pool[(self.rot + i) % n] for i in range(min(k, n))]
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
