r"""ABFT for fused attention: sampled query rows of ``F.scaled_dot_product_attention`` recomputed.

A fused SDPA kernel (every Hugging Face model, ``nn.TransformerEncoderLayer``) forms
softmax(Q·Kᵀ·scale + mask)·V without materialising the logits, so no module output exposes its
products. While an :class:`SDPACheck` is attached, ``torch.nn.functional.scaled_dot_product_attention``
is wrapped: after each call made in training (or with grad enabled), ``rows`` query positions drawn
per call are recomputed exactly in fp32 from the operands as the kernel consumed them (cast to the
output's dtype, as autocast does) -- logits, mask (boolean, additive, ``is_causal``), softmax, ·V
-- and compared with the kernel's output rows of every batch entry and head.

Bound. The kernel may round the logits and the probabilities to its dtype (u = 2⁻⁸ bf16, 2⁻¹¹
fp16) and accumulates in fp32; a logit off by u·|s| moves the output by at most
2u·max|s|·Σⱼpᵢⱼ|vⱼ|, the rounding of P by u·Σⱼpᵢⱼ|vⱼ|, the output's by u·|oᵢ|. So element (i, e)
passes when |o − ref| ≤ c·(u + u₃₂·(√L + √d + 2))·((3 + 2·maxⱼ|sᵢⱼ|)·Σⱼpᵢⱼ|vⱼₑ| + |refᵢₑ|).

Cost and coverage: ``rows`` of the L query rows per call (a share rows/L of the attention's work,
in fp32), so a fault confined to one output row is seen with probability rows/L per call, one
spread over the logits of a key (a corrupted K or V row) in every sampled row. Not checked:
calls with dropout (not reproducible), the backward pass (dQ, dK, dV), code that bound the
function before the wrapper was installed, traced code (``torch.compile``).
"""

from __future__ import annotations

import logging
import math
import random

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from sdcscope.common.tensors import no_autocast
from sdcscope.detect.events import Event
from sdcscope.detect.rounding import UNIT_ROUNDOFF
from sdcscope.observe.attention import add_sdpa_observer, calling_module, remove_sdpa_observer

log = logging.getLogger("sdcscope.detect.attention")


class SDPACheck:
    """Sampled-row recomputation of ``model``'s SDPA calls (see the module docstring). ``rows=0``
    checks nothing but still notes which modules call SDPA (:attr:`calls`), for the warning of
    what stays unchecked."""

    def __init__(self, model: nn.Module, *, rows: int = 2, c: float = 8.0, seed: int = 0, rank=None) -> None:
        self._modules = {id(m): (name or type(m).__name__, m) for name, m in model.named_modules()}
        self.rows, self.c, self.rank = rows, c, rank
        self._rng = random.Random(seed)
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor, tuple]] = []
        self.calls: dict[str, int] = {}
        """SDPA calls seen per attention module since attach (checked or not)."""
        self.unchecked_dropout = 0
        """Calls left unchecked because their dropout is not reproducible."""
        self.checks_run = 0
        self.enabled = True

    def attach(self) -> SDPACheck:
        add_sdpa_observer(self)
        return self

    def detach(self) -> None:
        remove_sdpa_observer(self)
        self._pending.clear()

    def _owner(self, frame) -> str | None:
        hit = calling_module(self._modules, frame)
        return hit[0] if hit is not None and (hit[1].training or torch.is_grad_enabled()) else None

    def observe(self, call: dict, out, frame) -> None:
        q, k, v = call.get("query"), call.get("key"), call.get("value")
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v, out)) or q.dim() < 2:
            return
        name = self._owner(frame)
        if name is None:
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        if not (self.enabled and self.rows):
            return
        if call.get("dropout_p", 0.0):
            self.unchecked_dropout += 1
            return
        try:
            # outside any dispatch mode: selective activation checkpointing's would count the check's
            # matmuls as the model's and hand them (or the model's recompute) saved outputs
            with torch.no_grad(), no_autocast(q.device), _disable_current_modes():
                self._check(name, q.detach(), k.detach(), v.detach(), out.detach(), call)
        except Exception as exc:  # a monitor must not break the model's forward
            log.warning("SDPA check of %r skipped: %r", name, exc)

    def _check(self, name: str, q, k, v, out, call: dict) -> None:
        length, s_len, d = q.shape[-2], k.shape[-2], q.shape[-1]
        n = min(self.rows, length)
        idx = sorted(self._rng.sample(range(length), n))
        rows = torch.tensor(idx, device=q.device)
        dt = out.dtype
        f32 = torch.float32
        qs = q.index_select(-2, rows).to(dt).to(f32)
        ks, vs = k.to(dt).to(f32), v.to(dt).to(f32)
        if q.dim() >= 3 and q.shape[-3] != k.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
            rep = q.shape[-3] // k.shape[-3]  # grouped-query heads
            ks, vs = ks.repeat_interleave(rep, dim=-3), vs.repeat_interleave(rep, dim=-3)
        scale = call.get("scale")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        s = torch.matmul(qs, ks.transpose(-2, -1)) * scale
        mask = call.get("attn_mask")
        if isinstance(mask, torch.Tensor):
            m = mask if mask.shape[-2] == 1 else mask.index_select(-2, rows)
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(f32)
        if call.get("is_causal"):
            keep = torch.arange(s_len, device=q.device).unsqueeze(0) <= rows.unsqueeze(1)
            s = s.masked_fill(~keep, -math.inf)
        p = torch.softmax(s, dim=-1)
        ref = torch.matmul(p, vs)
        got = out.index_select(-2, rows).to(f32)
        smax = s.masked_fill(~torch.isfinite(s), 0).abs().amax(-1, keepdim=True)
        spread = torch.matmul(p, vs.abs())
        u = UNIT_ROUNDOFF.get(dt, UNIT_ROUNDOFF[f32]) + UNIT_ROUNDOFF[f32] * (math.sqrt(s_len) + math.sqrt(d) + 2)
        tol = self.c * u * ((3 + 2 * smax) * spread + ref.abs())
        err = (got - ref).abs()
        live = torch.isfinite(ref)  # a row with every key masked: the kernel's value is its own
        ratio = torch.where(live, err / tol.clamp_min(torch.finfo(f32).tiny), torch.zeros_like(err))
        ratio = torch.nan_to_num(ratio, nan=math.inf)
        self._pending.append((name, ratio.amax(), ratio, tuple(idx)))
        self.checks_run += 1

    def check(self, step: int | None) -> list[Event]:
        """Judge the calls recorded since the last check (one host sync) -> events."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        worst = torch.stack([x[1] for x in pending]).tolist()
        events = []
        for (name, _, ratio, idx), r in zip(pending, worst):
            if r <= 1.0:
                continue
            flat = int(ratio.argmax())
            where = list(torch.unravel_index(torch.tensor(flat), ratio.shape))
            where[-2] = torch.tensor(idx[int(where[-2])])  # the query row
            events.append(
                Event(
                    step,
                    "abft",
                    "checksum_mismatch",
                    module=name,
                    gemm="forward",
                    rank=self.rank,
                    index=tuple(int(w) for w in where),
                    evidence={"ratio": r * self.c, "c": self.c, "check": "sdpa_rows", "rows": list(idx)},
                )
            )
        return events
