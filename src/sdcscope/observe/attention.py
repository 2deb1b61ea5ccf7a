"""Attention metrics of models that call ``F.scaled_dot_product_attention`` (SDPA).

A fused SDPA kernel never materialises the logits, so there is no module output to hook: Hugging
Face models (``attn_implementation="sdpa"``, their default), ``nn.TransformerEncoderLayer`` /
``DecoderLayer`` and ``nn.MultiheadAttention(need_weights=False)`` all compute attention this way.
While a :class:`~sdcscope.observe.Metrics` is attached, ``torch.nn.functional.scaled_dot_product_attention``
is replaced by a wrapper that runs the original and then hands q, k and the mask to every attached
:class:`SDPATap`. The call is credited to the innermost module of the tap's model whose ``forward``
is on the Python stack (the attention module: ``LlamaAttention``, ``MultiheadAttention``), which
names the metrics; a call from no module of the model (another model in the process) is not its.

* every step: ``attn/max_logit_bound/<attn>`` = scale · maxᵢ‖qᵢ‖ · maxⱼ‖kⱼ‖ per (batch, key head):
  two row-norm reductions, no logits. Grouped-query attention pairs each
  query head with its key head.
* probe steps: the logits scale·q·kᵀ are formed once (a batched GEMM): ``attn/max_logit/<attn>``
  (before masking, like the MatMul path) and ``attn/entropy/<attn>``, the mean −Σ p log p of the
  softmax of the masked logits (``attn_mask`` boolean or additive, ``is_causal``); rows with every
  key masked are left out. Attention dropout is not applied: it is the entropy of the attention
  distribution, where the MatMul path sees the dropped-out rows.

Not seen: code that bound the function before the tap was installed (``from
torch.nn.functional import scaled_dot_product_attention`` at import time),
``nn.MultiheadAttention`` called with ``need_weights=True`` (its default; it forms the logits by
``bmm``, not SDPA), traced code (``torch.compile``: the wrapper records nothing while compiling),
and the logits of fused kernels that are not SDPA (FlashAttention's own package, xFormers).
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import warnings
import weakref

import torch
from torch import nn

from sdcscope.common.tensors import no_autocast

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MAX_DEPTH = 16
"""Frames searched above the SDPA call for the module that made it."""

_lock = threading.Lock()
_taps: weakref.WeakSet = weakref.WeakSet()  # an observer dropped without removal leaves by itself
_original: list = []


def _sdpa(*args, **kwargs):
    # (a copy of the wrapper restored by code that saved it after the last observer left: the kernel)
    out = (_original[0] if _original else torch._C._nn.scaled_dot_product_attention)(*args, **kwargs)
    if _taps and not torch.compiler.is_compiling():
        call = dict(zip(_ARGS, args), **kwargs)
        frame = sys._getframe(1)
        for tap in list(_taps):
            tap.observe(call, out, frame)
    return out


def add_sdpa_observer(observer) -> None:
    """Hand every SDPA call to ``observer.observe(call, out, frame)`` (``call``: the arguments by
    name, ``out``: the kernel's result, ``frame``: the caller's). One wrapper serves every
    observer -- the metrics' taps here and the guard's attention check -- reference counted, so
    observers can come and go in any order and the last one out restores torch's function."""
    with _lock:
        current = torch.nn.functional.scaled_dot_product_attention
        if current is not _sdpa:  # not installed, or replaced since (a test's monkeypatch undone)
            _original[:] = [current]
            torch.nn.functional.scaled_dot_product_attention = _sdpa
        _taps.add(observer)


def remove_sdpa_observer(observer) -> None:
    with _lock:
        _taps.discard(observer)
        if _taps:  # observers of models dropped without removal (held in reference cycles) leave now
            gc.collect()
        if not _taps and _original:
            if torch.nn.functional.scaled_dot_product_attention is _sdpa:
                torch.nn.functional.scaled_dot_product_attention = _original[0]
            _original.clear()


def calling_module(modules: dict[int, tuple[str, nn.Module]], frame) -> tuple[str, nn.Module] | None:
    """The innermost ``(name, module)`` of ``modules`` (keyed by ``id``) whose method is on the
    stack at or above ``frame``: the attention module that made an SDPA call."""
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            hit = modules.get(id(frame.f_locals.get("self")))
            if hit is not None:
                return hit
        frame = frame.f_back
    return None


class SDPATap:
    """Records the attention metrics of ``model``'s SDPA calls through ``recorder``: an object
    with ``_record_max(key, tensor)``, ``_record_mean(key, tensor)`` and a boolean ``_probe``
    (the :class:`~sdcscope.observe.Metrics` that owns the tap)."""

    def __init__(self, model: nn.Module, recorder) -> None:
        self._modules = {id(m): (name or type(m).__name__, m) for name, m in model.named_modules()}
        self._recorder = recorder
        self.seen: set[str] = set()
        """Attention modules whose SDPA calls were recorded."""

    # -- installation (reference counted: several Metrics may be attached at once)
    def install(self) -> SDPATap:
        add_sdpa_observer(self)
        return self

    def remove(self) -> None:
        remove_sdpa_observer(self)

    # -- recording
    def _owner(self, frame) -> tuple[str, nn.Module] | None:
        return calling_module(self._modules, frame)

    def observe(self, call: dict, out, frame) -> None:
        q, k = call.get("query"), call.get("key")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
            return
        owner = self._owner(frame)
        if owner is None or not owner[1].training:
            return
        try:
            self._record(owner[0], q, k, call)
        except Exception as exc:  # a monitor must not break the model's forward
            warnings.warn(f"sdcscope: attention metrics of {owner[0]!r} skipped: {exc!r}", RuntimeWarning, stacklevel=3)

    def _record(self, name: str, q: torch.Tensor, k: torch.Tensor, call: dict) -> None:
        rec = self._recorder
        scale = call.get("scale")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(float(scale))
        with torch.no_grad(), no_autocast(q.device):
            q, k = q.detach(), k.detach()
            acc = torch.promote_types(q.dtype, torch.float32)
            qn = torch.linalg.vector_norm(q, dim=-1, dtype=acc).amax(-1)
            kn = torch.linalg.vector_norm(k, dim=-1, dtype=acc).amax(-1)
            rec._record_max(f"attn/max_logit_bound/{name}", _paired_max(qn, kn) * scale)
            self.seen.add(name)
            if not rec._probe:
                return
            if q.dim() >= 3 and q.shape[-3] != k.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)  # grouped-query heads
            logits = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(scale)
            rec._record_max(f"attn/max_logit/{name}", logits.amax())
            mask = call.get("attn_mask")
            if isinstance(mask, torch.Tensor):
                logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask
            if call.get("is_causal"):
                rows, cols = logits.shape[-2:]
                keep = torch.ones(rows, cols, dtype=torch.bool, device=logits.device).tril()
                logits = logits.masked_fill(~keep, -math.inf)
            ent = torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)
            rec._record_mean(f"attn/entropy/{name}", ent.nanmean())


def _paired_max(qn: torch.Tensor, kn: torch.Tensor) -> torch.Tensor:
    """max over (batch, head) of max‖q‖·max‖k‖, each query head with its own key head; grouped
    query heads (``enable_gqa``) share one; shapes that do not pair give the global maxima."""
    if qn.dim() and kn.dim() and qn.shape[-1] != kn.shape[-1] and qn.shape[-1] % kn.shape[-1] == 0:
        qn = qn.unflatten(-1, (kn.shape[-1], -1)).amax(-1)
    try:
        torch.broadcast_shapes(qn.shape, kn.shape)
    except RuntimeError:
        return qn.amax() * kn.amax()
    return (qn * kn).amax()
