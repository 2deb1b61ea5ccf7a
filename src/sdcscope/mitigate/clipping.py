"""Gradient- and parameter-level mitigations applied in the job: ZClip, LR backoff, QK-clip."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sdcscope.common.tensors import dense_values
from sdcscope.common.validate import check_float, check_non_negative, check_positive
from sdcscope.engine.trainer import total_norm


@dataclass(kw_only=True)
class ZClipConfig:
    """ZClip (Kumar et al. 2025): clip the gradient norm when its z-score against an EMA exceeds
    ``z_threshold``; defaults from the paper's reference code."""

    alpha: float = 0.97
    z_threshold: float = 2.5
    warmup: int = 25
    max_grad_norm: float = 1.0
    """Hard cap also applied (standard clipping during warm-up, ``min(adaptive, cap)`` after)."""

    def __post_init__(self) -> None:
        check_float("zclip alpha", self.alpha, low=0.0, high=1.0, low_open=True, high_open=True)
        check_float("zclip z_threshold", self.z_threshold, low=0.0, low_open=True)
        check_float("zclip max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        check_non_negative("zclip warmup", self.warmup)


class ZClip:
    """Adaptive gradient clipping: one fused norm, one host sync per step."""

    def __init__(self, config: ZClipConfig | None = None) -> None:
        self.config = config or ZClipConfig()
        self.mean: float | None = None
        self.var = 0.0
        self.seen: list[float] = []

    def limit(self, norm: float) -> float:
        """The clipping threshold for a gradient of this norm (and update the statistics). A
        non-finite norm leaves the statistics alone (one NaN would poison them for good) and
        gets the hard cap."""
        c = self.config
        if not math.isfinite(norm):
            return c.max_grad_norm
        if self.mean is None or len(self.seen) < c.warmup:
            self.seen.append(min(norm, c.max_grad_norm))
            if len(self.seen) >= max(c.warmup, 1):
                self.mean = sum(self.seen) / len(self.seen)
                self.var = sum((x - self.mean) ** 2 for x in self.seen) / len(self.seen)
            return c.max_grad_norm
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + 1e-12)
        limit = self.mean + c.z_threshold**2 * std / z if z > c.z_threshold else norm
        limit = min(limit, c.max_grad_norm)
        clipped = min(norm, limit)
        self.mean = c.alpha * self.mean + (1 - c.alpha) * clipped
        self.var = c.alpha * self.var + (1 - c.alpha) * (clipped - self.mean) ** 2
        return limit

    @torch.no_grad()
    def clip_(self, parameters, norm: float | None = None) -> tuple[float, float]:
        """Clip gradients in place; returns (norm before, limit used). A sparse gradient
        (``nn.Embedding(sparse=True)``) is measured by its coalesced values and scaled as it is."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if norm is None:
            norm = float(total_norm(dense_values(grads)))
        limit = self.limit(norm)
        if math.isfinite(norm) and norm > limit:
            factor = limit / (norm + 1e-6)
            dense = [g for g in grads if not g.is_sparse]
            if dense:
                torch._foreach_mul_(dense, factor)
            for g in grads:
                if g.is_sparse:
                    g.mul_(factor)
        return norm, limit


@dataclass(kw_only=True)
class LRBackoffConfig:
    factor: float = 0.5
    """Multiply the learning rate by this on a backoff (OPT/PaLM practice: 10–50 %)."""
    recover_steps: int = 100
    """Steps over which the scale returns linearly to 1."""

    def __post_init__(self) -> None:
        check_float("lr backoff factor", self.factor, low=0.0, high=1.0, low_open=True, high_open=True)
        check_positive("lr backoff recover_steps", self.recover_steps)


class LRBackoff:
    """A learning-rate scale that drops on a backoff and recovers linearly.

    ``step`` counts optimizer steps (the Guard passes its own monotonic count, so loops whose step
    numbers restart per epoch, or go back on a rollback, still recover over ``recover_steps``). A
    step before the trigger gets the floor: the scale stays within [floor, 1]."""

    def __init__(self, config: LRBackoffConfig | None = None) -> None:
        self.config = config or LRBackoffConfig()
        self._since: int | None = None
        self._floor = 1.0

    def trigger(self, step: int) -> None:
        self._floor = self.scale(step) * self.config.factor
        self._since = step

    def scale(self, step: int) -> float:
        if self._since is None:
            return 1.0
        t = min(1.0, max(0.0, (step - self._since) / self.config.recover_steps))
        return self._floor + (1.0 - self._floor) * t


@torch.no_grad()
def qk_clip_(q_proj: nn.Linear, k_proj: nn.Linear, max_logit: float, threshold: float) -> float:
    """QK-clip (MuonClip-style): when a layer's max attention logit exceeds ``threshold``,
    scale W_q and W_k (and biases) by sqrt(threshold / max_logit), so q·k shrinks by exactly
    that ratio. Returns the factor applied (1.0: nothing done)."""
    if not (math.isfinite(max_logit) and max_logit > threshold > 0):
        return 1.0
    gamma = math.sqrt(threshold / max_logit)
    for lin in (q_proj, k_proj):
        lin.weight.mul_(gamma)
        if lin.bias is not None:
            lin.bias.mul_(gamma)
    return gamma
