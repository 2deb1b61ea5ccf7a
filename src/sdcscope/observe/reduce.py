"""Fused reductions over a model's parameters, gradients and optimizer state, kept on device: the
gradient norms, the sums of dot products, and the update an optimizer step just applied (rebuilt
from its state, so no copy of the parameters is taken before the step)."""

from __future__ import annotations

import functools
import math

import torch

from sdcscope.common.tensors import dense_values


def stack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    try:  # the common case: one device, fp32 — no per-tensor conversion calls
        out = torch.stack(tensors)
        if out.device == device and out.dtype == torch.float32:
            return out
    except RuntimeError:
        pass
    return torch.stack([t.to(device=device, dtype=torch.float32) for t in tensors])


def grad_norms(params: list[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
    """(indices of the parameters that have a gradient, their 2-norms as one device vector, as
    ``torch._foreach_norm`` computes them: what ``clip_grad_norm_`` reduces) in one fused pass;
    ``None`` when no parameter has a gradient."""
    idx = [i for i, p in enumerate(params) if p.grad is not None]
    if not idx:
        return idx, None
    grads = dense_values([params[i].grad for i in idx])
    return idx, stack(list(torch._foreach_norm(grads)), grads[0].device)


def grad_sq_norms(params: list[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
    """:func:`grad_norms` squared in fp64, so that summing them cannot overflow (fp32 squares of
    norms above ~1.8e19 would). A norm ``torch._foreach_norm`` itself overflowed -- an fp32
    gradient with an element above ~1.8e19 (an exponent-bit flip), an fp16 one above 65504 -- is
    infinite already: the guard reports such finite gradients as a ``grad_norm`` overflow."""
    idx, norms = grad_norms(params)
    return idx, None if norms is None else norms.double().square()


def total_dot(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """Σᵢ ⟨xᵢ, yᵢ⟩ as a 0-d fp32 tensor on the device of ``xs``: one dot of the concatenations
    (one copy each) instead of a dot per tensor (dispatch-bound on small models)."""
    try:
        x = torch.cat([t.reshape(-1) for t in xs])
        y = torch.cat([t.reshape(-1) for t in ys]).to(x.dtype)
        return torch.dot(x, y).float()
    except RuntimeError:  # tensors on several devices
        dev = xs[0].device
        return torch.stack(
            [torch.dot(a.reshape(-1), b.reshape(-1).to(a.dtype)).float().to(dev) for a, b in zip(xs, ys)]
        ).sum()


def reconstruct_update(opt: torch.optim.Optimizer, index_of: dict[int, int]) -> tuple[list[int], list[torch.Tensor]]:
    """Δθ of the step just taken, rebuilt from the optimizer state (Adam/AdamW, SGD).

    Adam: θ_t = θ_{t-1}(1 − η·λ_decoupled) − η/(1−β₁ᵗ) · m_t / (√v_t/√(1−β₂ᵗ) + ε), so
    θ_{t-1} = (θ_t + u)/(1 − ηλ) and Δθ = θ_t − θ_{t-1}. SGD: Δθ = −η·d with d the momentum
    buffer (or, without momentum, the gradient plus weight decay). Fused over each group.
    """
    idx: list[int] = []
    deltas: list[torch.Tensor] = []
    adam = isinstance(opt, torch.optim.Adam)
    if not (adam or isinstance(opt, torch.optim.SGD)):
        return idx, deltas
    with torch.no_grad():
        for group in opt.param_groups:
            lr = float(group["lr"])
            wd = float(group.get("weight_decay", 0.0))
            rows = [(p, opt.state.get(p, {})) for p in group["params"] if id(p) in index_of and dense_grad(p)]
            if adam:
                rows = [(p, st) for p, st in rows if "exp_avg" in st and float(st.get("step", 0)) >= 1]
            if not rows:
                continue
            theta = [p.detach() for p, _ in rows]
            if adam:
                b1, b2 = (float(b) for b in group["betas"])
                ts = [float(st["step"]) for _, st in rows]
                v = [st["max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"] for _, st in rows]
                denom = torch._foreach_sqrt(v)
                torch._foreach_div_(denom, [math.sqrt(1 - b2**t) for t in ts])
                torch._foreach_add_(denom, float(group["eps"]))
                upd = torch._foreach_div([st["exp_avg"] for _, st in rows], denom)
                torch._foreach_mul_(upd, [lr / (1 - b1**t) for t in ts])
                decoupled = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
                if decoupled and wd:  # Δθ = θ_t − (θ_t + u)/(1 − ηλ)
                    old = torch._foreach_add(theta, upd)
                    torch._foreach_div_(old, 1 - lr * wd)
                    delta = torch._foreach_sub(theta, old)
                else:
                    delta = torch._foreach_neg(upd)
            else:
                delta = [_sgd_delta(p, st, group, lr, wd) for p, st in rows]
            idx += [index_of[id(p)] for p, _ in rows]
            deltas += list(delta)
    return idx, deltas


def dense_grad(p: torch.Tensor) -> bool:
    """``p`` has a dense gradient: the metrics pairing gradients with dense tensors (cosines,
    reconstructed updates) leave sparse ones (``nn.Embedding(sparse=True)``) out."""
    return p.grad is not None and not p.grad.is_sparse


def _sgd_delta(p: torch.Tensor, st: dict, group: dict, lr: float, wd: float) -> torch.Tensor:
    theta = p.detach()
    g = -p.grad if group.get("maximize") else p.grad
    mom = float(group.get("momentum", 0.0))
    buf = st.get("momentum_buffer")
    if mom and buf is not None:
        if not group.get("nesterov"):
            return -lr * buf
        # θ_t = θ_{t-1}(1 − ηλ) − η(g + μ·buf)
        return theta - (theta + lr * (g + mom * buf)) / (1 - lr * wd)
    return theta - (theta + lr * g) / (1 - lr * wd)


_SUMMARIES = {  # per-layer family -> (summary key, reducer)
    "attn/max_logit_bound/": ("attn/max_logit_bound", max),
    "attn/max_logit/": ("attn/max_logit", max),
    "attn/entropy/": ("attn/entropy_min", min),
    "act/kurtosis/": ("act/kurtosis_max", max),
    "stable_rank/": ("stable_rank_min", min),
}


def summarize(out: dict[str, float]) -> None:
    """Add to a collected row the summary of each per-layer family in it (:data:`_SUMMARIES`)."""
    for family, keys in _families(tuple(out)):
        vals = [out[k] for k in keys]
        summary, reduce = _SUMMARIES[family]
        kept = [v for v in vals if not math.isnan(v)]
        if kept:
            out[summary] = reduce(kept)
        if family == "attn/entropy/":
            out["attn/entropy"] = sum(vals) / len(vals)


@functools.lru_cache(maxsize=256)
def prefixed(key: str, names: tuple[str, ...]) -> list[str]:
    return [key + n for n in names]


@functools.lru_cache(maxsize=64)
def _families(keys: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The per-layer families among ``keys`` with their keys (a family is a key up to its last
    '/'; module names have none). Cached: a run's rows have the same few key sets."""
    found: dict[str, list[str]] = {}
    for k in keys:
        family = k[: k.rfind("/") + 1]
        if family in _SUMMARIES:
            found.setdefault(family, []).append(k)
    return tuple((f, tuple(ks)) for f, ks in found.items())
