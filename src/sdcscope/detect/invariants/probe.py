"""The causality probe: do a sequence model's outputs before position t depend on its inputs from t on?

An autoregressive model (a GPT) computes its output at position i from the tokens at positions
<= i only; a causal-mask bug breaks that silently (a mask of ones, a mask off by one diagonal, a
mask applied along the wrong axis, any future-token leak): the loss even goes down faster.  The
trace of the loop cannot see it, so the recorder asks the model, now and then (see
``TraceConfig.causal_probe``): when the model's root forward is given token ids (a 2-D integer
tensor ``[B, T]``, ``T >= 2``) and returns per-position outputs (a floating tensor, or a
tuple/list/dict whose first tensor is one, with leading shape ``[B, T]``), it is run again on
the first sequence of the batch and on copies of it whose tokens from a cut ``t`` on are all
replaced by other token ids of the batch (cuts ``1`` and ``T // 2``: position 0 seeing anything
but itself, and a leak across the middle), in one forward of ``1 + len(cuts)`` rows.  With
``Δ_i`` the largest change of the outputs at position ``i``, the probe's value is the leak ratio

    max over cuts t of  max_{i < t} Δ_i / max(max_{i >= t} Δ_i, TINY)

0 for a causal model (its outputs before t are computed from the same tokens), and of the
order of an attention weight (1/2 at cut 1 under a mask of ones) for a leaking one.

The re-run changes nothing the training sees: it runs under ``torch.no_grad()``, in eval mode
(dropout off, batch-norm statistics frozen; every submodule's ``training`` flag is put back
afterwards), inside ``torch.random.fork_rng`` (the RNG streams are where they were), and while
it runs every recorder's hooks and wrapped torch functions ignore what they see (``running()``),
so it is neither recorded nor probed again.  A traced run stays bitwise identical to an
untraced one.  Hooks of other tools on the model do see the probe's forward.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

TINY = 1e-30
"""Floor of the denominator: a model whose outputs from t on do not change at all (tokens it
ignores) gives a ratio of 0 when nothing else changed either, and an overflow (a leak) when
earlier outputs did."""

_state = threading.local()


def running() -> bool:
    """True while a probe's forward runs on this thread (recorders ignore what they see)."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def _probing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def token_input(args: tuple) -> torch.Tensor | None:
    """The first positional argument if it looks like token ids: 2-D, integer, ``T >= 2``."""
    x = args[0] if args else None
    if (not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] < 2 or x.numel() == 0
            or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        return None
    return x


def first_tensor(output: Any) -> torch.Tensor | None:
    """The output tensor, or the first tensor of a tuple/list/dict output (one level deep)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


def per_position(output: Any, b: int, t: int) -> torch.Tensor | None:
    """The output's first tensor if it is floating with leading shape ``[b, t]``."""
    out = first_tensor(output)
    if out is None or not out.is_floating_point() or out.ndim < 2 or tuple(out.shape[:2]) != (b, t):
        return None
    return out


def cuts(t: int) -> list[int]:
    """Where the probe cuts a sequence of length t: its inputs from a cut on are replaced."""
    return sorted({1, t // 2})


def _rows(a: Any, b: int, n: int) -> Any:
    """An extra argument for the probe: a tensor with the batch's leading size becomes n
    copies of its first row; anything else is passed unchanged."""
    if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] == b:
        return a[:1].repeat(n, *[1] * (a.ndim - 1))
    return a


class CausalProbe:
    """Measures the leak ratio of one model (see the module doc); one per recorder."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.disabled: str | None = None   # why the probe stopped (it raised once)

    def __call__(self, x: torch.Tensor, args: tuple, kwargs: dict, output: Any
                 ) -> dict[str, torch.Tensor | int] | None:
        """``{"leak", "cut", "pos", "len"}`` (tensors on the device for the first three, kept
        there: the recorder fetches them with the step's other values), or None when the
        forward is not a sequence model's or the probe is disabled."""
        b, t = x.shape
        if self.disabled is not None or per_position(output, b, t) is None:
            return None
        where = cuts(t)
        row = x[:1]
        lo, hi = torch.aminmax(x)
        copies = [torch.cat([row[:, :c], torch.where(row[:, c:] == lo, hi, lo)], dim=1) for c in where]
        n = 1 + len(where)
        probe = torch.cat([row, *copies])
        more = tuple(_rows(a, b, n) for a in args[1:])
        kw = {k: _rows(v, b, n) for k, v in kwargs.items()}
        try:
            out = self._run(probe, more, kw)
        except Exception as exc:  # a probe must never break the training it watches
            self.disabled = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"causality probe disabled: {type(self.model).__name__} raised on the probe "
                          f"batch ({self.disabled})", RuntimeWarning, stacklevel=2)
            return None
        out = per_position(out, n, t)
        if out is None:   # in eval mode the model returns something else (e.g. the last position)
            return None
        kind = torch.promote_types(out.dtype, torch.float32)
        delta = (out[1:].to(kind) - out[:1].to(kind)).abs().reshape(n - 1, t, -1).amax(-1)  # [cuts, t]
        ratios, positions = [], []
        for i, c in enumerate(where):
            before, after = delta[i, :c], delta[i, c:]
            ratios.append(before.max() / after.max().clamp_min(TINY))
            positions.append(before.argmax())
        ratios_t = torch.stack(ratios)
        k = ratios_t.argmax()
        cut = torch.zeros((), dtype=torch.int64, device=x.device)
        for i, c in enumerate(where):   # where[k], without a host sync (k stays on the device)
            cut = torch.where(k == i, c, cut)
        return {"leak": ratios_t[k], "cut": cut, "pos": torch.stack(positions)[k], "len": t}

    def _run(self, probe: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        modules = list(self.model.modules())
        modes = [m.training for m in modules]
        device = probe.device
        devices = [] if device.type == "cpu" else [device]
        try:
            with _probing(), torch.no_grad(), torch.random.fork_rng(devices=devices,
                                                                    device_type=device.type):
                self.model.eval()
                return self.model(probe, *args, **kwargs)
        finally:
            for m, mode in zip(modules, modes):
                m.training = mode
