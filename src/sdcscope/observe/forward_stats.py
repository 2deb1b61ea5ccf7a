"""The forward-hook statistics of :class:`~sdcscope.observe.Metrics`: the attention-logit bound and
exact max, the attention entropy, the output's log-sum-exp and the activation kurtosis, recorded as
device tensors (max or mean over the micro-batches of a step)."""

from __future__ import annotations

import torch

from sdcscope.common.tensors import no_autocast

TINY = 1e-30


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class ForwardStats:
    """Mixin of :class:`~sdcscope.observe.Metrics`, which holds ``_max``, ``_mean`` and the tier
    flags ``_probe`` and ``_stats`` these hooks read."""

    def _record_max(self, key: str, value: torch.Tensor) -> None:
        value = value.detach()
        if value.dtype != torch.float32:
            value = value.float()
        prev = self._max.get(key)
        self._max[key] = value if prev is None else torch.maximum(prev, value)

    def _record_mean(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        prev = self._mean.get(key)
        self._mean[key] = (value, 1) if prev is None else (prev[0] + value, prev[1] + 1)

    def _score_hook(self, layer: str):
        bound_key, exact_key = f"attn/max_logit_bound/{layer}", f"attn/max_logit/{layer}"

        def hook(module, args, out):  # every step: one or two reductions, no casts
            if not module.training or len(args) < 2 or not isinstance(out, torch.Tensor):
                return
            a, b, out = args[0].detach(), args[1].detach(), out.detach()
            short = out.numel() <= a.numel() + b.numel()  # the logits cost less to read than q and k
            exact = out.amax() if self._probe or short else None
            if self._probe:
                self._record_max(exact_key, exact)
            if short:
                self._record_max(bound_key, exact)
                return
            acc = torch.promote_types(a.dtype, torch.float32)
            bound = torch.linalg.vector_norm(a, dim=-1, dtype=acc).amax(-1)
            bound.mul_(torch.linalg.vector_norm(b, dim=-2, dtype=acc).amax(-1))
            self._record_max(bound_key, bound.amax())

        return hook

    def _context_pre(self, layer: str):
        def hook(module, args):
            if not (module.training and self._probe and args):
                return
            with torch.no_grad(), no_autocast(args[0].device):
                p = args[0].float()
                p = p / p.sum(-1, keepdim=True).clamp_min(TINY)
                ent = -(p * p.clamp_min(TINY).log()).sum(-1).mean()
                self._record_mean(f"attn/entropy/{layer}", ent)

        return hook

    def _lse(self, module, args, out):
        logits = _first_tensor(out)
        if not (module.training and self._stats) or logits is None:
            return
        with torch.no_grad(), no_autocast(logits.device):
            lse = torch.logsumexp(logits.detach().float(), dim=-1)
            self._record_mean("logits/lse_mean", lse.mean())
            self._record_max("logits/lse_max", lse.amax())

    def _kurt(self, name: str):
        def hook(module, args, out):
            x = _first_tensor(out)
            if not (module.training and self._probe) or x is None or x.dim() == 0:
                return
            with torch.no_grad(), no_autocast(x.device):
                s2 = x.detach().float().reshape(-1, x.shape[-1]).pow(2).mean(0)
                kurt = s2.pow(2).mean() / s2.mean().pow(2).clamp_min(TINY)
                self._record_mean(f"act/kurtosis/{name}", kurt)

        return hook
