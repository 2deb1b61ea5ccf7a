"""Perturbation twins: the chaos floor of ``sdc:drift``.

Training is chaotic: a rounding-level change of the weights, followed for enough steps, leaves the
bit-exact golden twin by a distance that grows with the steps since the change (until it reaches
the seed-to-seed spread). A fixed bound on the distance to golden therefore calls noise drift once
the horizon is long. Instead, per injection step, ``baseline.twins`` perturbation twins give the
natural divergence at each drift offset: golden's snapshot at the injection step with **one ulp of
a random half of the weights** (bit 0 of the stored word flipped, :func:`sdcscope.faults.bitflip`;
a seeded Bernoulli(1/2) mask per twin), trained on with golden's seed and data order. That is a
change "at rounding level, anywhere": what a healthy chip that rounds differently (another
reduction order) would do. Chaos amplifies any rounding-level change, of one value or of many, to
the same growing divergence within a few steps, so the twins sample its spread, and the bound
below (a prediction bound for one more such run, times a margin) covers a fault that changed
values by as little, at every horizon.

The envelope at an offset is, over the K twins' relative weight distances ``d`` to golden there,
``margin * exp(max(max(log d), mean(log d) + t[1-alpha, K-1] * sd(log d) * sqrt(1 + 1/K)))``: the
healthy-spread rule of :mod:`.stats` on the log scale (chaotic distances spread by factors, not by
amounts), times ``baseline.twin_margin``. ``sdc:drift`` by the twin measure (``drift_twin``) holds
when a trial's distance at the end of its horizon exceeds the envelope there: drift is about where
the weights end up, and a single test per trial keeps the false-drift rate at the test's level.
The same rule, leaving each twin out of its own envelope, labels the twins (their false-drift
rate) and the healthy re-seeded runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from sdcscope.faults import bitflip
from sdcscope.study.stats import prediction_bound
from sdcscope.workloads import mix_seed

__all__ = ["TWIN_RULE", "perturb_twin", "envelope_bound", "envelope_curve", "twin_flags", "spread_flags"]

TWIN_RULE = "margin * exp(max(max(log d), mean(log d) + t[1-alpha, K-1] * sd(log d) * sqrt(1 + 1/K)))"
"""The envelope over K perturbation twins' distances ``d`` at one offset (``mean``: the geometric
mean and ``sd``: the sd of log d, in the thresholds table)."""


@torch.no_grad()
def perturb_twin(model: torch.nn.Module, inject_step: int, twin: int) -> int:
    """Change one ulp (bit 0 of the stored word) of a random half of ``model``'s floating-point
    parameter elements, in place; the half is a pure function of (``inject_step``, ``twin``).
    Returns how many elements changed."""
    gen = torch.Generator().manual_seed(mix_seed("twin", inject_step, twin))
    changed = 0
    for p in model.parameters():
        if not p.is_floating_point() or p.numel() == 0:
            continue
        mask = (torch.rand(p.shape, generator=gen) < 0.5).to(p.device)
        p.copy_(torch.where(mask, bitflip(p.detach(), [0]), p))
        changed += int(mask.sum())
    return changed


def _positive(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]


def envelope_bound(distances: Sequence[Any], alpha: float, margin: float) -> dict[str, Any] | None:
    """The envelope (see the module docstring) of twins' distances at one offset, as a thresholds
    row: ``bound``, ``n``, ``mean`` (geometric), ``sd`` (of log d), ``max``, ``t``, ``alpha``,
    ``rule``; None with fewer than 2 positive finite distances (no spread to measure)."""
    d = _positive(distances)
    if len(d) < 2:
        return None
    b = prediction_bound([math.log(x) for x in d], alpha)
    return {
        "bound": margin * math.exp(b["bound"]),
        "n": b["n"],
        "mean": math.exp(b["mean"]),
        "sd": b["sd"],
        "max": max(d),
        "t": b["t"],
        "alpha": alpha,
        "rule": f"{TWIN_RULE}, margin {margin:g}, over perturbation twins",
    }


def envelope_curve(twins: list[dict], alpha: float, margin: float) -> list[float | None]:
    """The envelope at each drift offset from the twins' ``drift`` lists (None where fewer than 2
    twins have a positive distance there)."""
    curves = [t.get("drift") or [] for t in twins]
    out = []
    for k in range(max(map(len, curves), default=0)):
        row = envelope_bound([c[k] for c in curves if k < len(c)], alpha, margin)
        out.append(None if row is None else row["bound"])
    return out


def twin_flags(twins: list[dict], alpha: float, margin: float) -> list[int | None]:
    """Each twin tested against the envelope of the other twins at the end of the horizon
    (leave-one-out): 1 when beyond it -- a false drift, since a twin is noise by construction."""
    ends = [t.get("dist_golden") for t in twins]
    out = []
    for i, d in enumerate(ends):
        row = envelope_bound(ends[:i] + ends[i + 1 :], alpha, margin)
        out.append(None if row is None or not _positive([d]) else int(d > row["bound"]))
    return out


def spread_flags(values: list[Any], alpha: float) -> list[int | None]:
    """Each healthy re-seeded run's final distance to golden against the re-seed bound of the
    others (leave-one-out, the rule of :func:`.stats.prediction_bound`): 1 when beyond it -- a
    false ``drift_spread``; None with fewer than 2 others (no spread to test against)."""
    out = []
    for i, d in enumerate(values):
        others = [float(v) for j, v in enumerate(values) if j != i and isinstance(v, (int, float))]
        ok = len(others) >= 2 and isinstance(d, (int, float))
        out.append(int(d > prediction_bound(others, alpha)["bound"]) if ok else None)
    return out
