"""The causality probe: do a sequence model's outputs before position t depend on its inputs from t on?

An autoregressive model (a GPT) computes its output at position i from the tokens at positions
<= i only; a causal-mask bug breaks that silently (a mask of ones, a mask off by one diagonal, a
mask applied along the wrong axis, any future-token leak): the loss even goes down faster.  The
trace of the loop cannot see it, so the recorder asks the model, now and then (see
``TraceConfig.causal_probe``): when the model's root forward is given token ids (a 2-D integer
tensor ``[B, T]``, ``T >= 2``, ``B >= 2``, as its first positional argument or by the keyword
``input_ids``, as in ``model(**batch)``) and returns per-position outputs (a floating tensor with
leading shape ``[B, T]``, or a tuple/list/dict holding one: the first such tensor, so the logits
of ``{"loss": ..., "logits": ...}``), it is run again on the first sequence of the batch and on
copies of it whose tokens from a cut ``t`` on are replaced (cuts ``1`` and ``T // 2``: position 0
seeing anything but itself, and a leak across the middle), in one forward of ``1 + len(cuts)``
rows, the ids passed the way the model was given them (the other batch-sized arguments, an
``attention_mask``, sliced to the first sequence).  A replacement at position ``j`` is the
smallest or the largest id of column ``j`` of the batch (whichever differs from the token):
every id the probe feeds was fed at that same position, so a model whose columns have separate
vocabularies (``[B, 2]`` (user id, item id) pairs) never gets an id out of range (on a GPU a
device-side assert, which no ``except`` catches).  A column holding one id throughout the batch
is left as it is.  With ``Δ_i`` the largest change of the outputs at position ``i``, the probe's
value is the leak ratio

    max over cuts t of  max_{i < t} Δ_i / max(max_{i >= t} Δ_i, TINY)

0 for a causal model (its outputs before t are computed from the same tokens), and of the
order of an attention weight (1/2 at cut 1 under a mask of ones) for a leaking one.

The re-run changes nothing the training sees: it runs under ``torch.no_grad()``, in eval mode
(dropout off, batch-norm statistics frozen), inside ``torch.random.fork_rng`` (the RNG streams
are where they were), and while it runs every recorder's hooks and wrapped torch functions
ignore what they see (``running()``), so it is neither recorded nor probed again.  Eval mode
is set, and the modes put back, through each module's ``training`` flag, not ``train()`` /
``eval()``: an override of those may have side effects (a LoRA layer merging B·A into its
weight on ``eval()`` -- and unmerging is not bitwise the inverse); the probe needs none of them.
Every buffer (what the forward may change whatever the mode: a step counter, a fake-quant
observer's min/max, a cache) is put back in place afterwards (``.data.copy_``: references to it
stay valid, and autograd's version counter does not move, so the pending backward is
undisturbed), at the cost of a copy of the model's buffers per probe (usually small next to the
parameters: batch-norm statistics, masks).  A traced run stays bitwise identical to an untraced
one.  Hooks of other tools on the model do see the probe's forward.
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


KEYWORD = "input_ids"
"""The keyword token ids may be passed by (``model(input_ids=..., attention_mask=...)``)."""


def _is_tokens(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.ndim == 2
        and x.shape[1] >= 2
        and x.numel() > 0
        and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    )


def token_input(args: tuple, kwargs: Mapping[str, Any] | None = None) -> torch.Tensor | None:
    """The token ids of a forward, if any: the first positional argument, or else the keyword
    ``input_ids``, if it is 2-D, integer, with ``T >= 2``."""
    where = token_arg(args, kwargs)
    if where is None:
        return None
    return args[0] if where == 0 else kwargs[where]  # type: ignore[index]


def token_arg(args: tuple, kwargs: Mapping[str, Any] | None = None) -> int | str | None:
    """Where a forward's token ids are: 0 (the first positional argument), ``KEYWORD``, or None."""
    if args and _is_tokens(args[0]):
        return 0
    if kwargs and _is_tokens(kwargs.get(KEYWORD)):
        return KEYWORD
    return None


def _where(output: Any, b: int, t: int) -> Any:
    """The key of the output's per-position tensor: ``()`` for a tensor output, the index or key
    of the first floating tensor with leading shape ``[b, t]`` of a tuple/list/dict output (one
    level deep), or None."""

    def fits(o: Any) -> bool:
        return isinstance(o, torch.Tensor) and o.is_floating_point() and o.ndim >= 2 and tuple(o.shape[:2]) == (b, t)

    if isinstance(output, torch.Tensor):
        return () if fits(output) else None
    if isinstance(output, Mapping):
        return next((k for k, o in output.items() if fits(o)), None)
    if isinstance(output, (tuple, list)):
        return next((i for i, o in enumerate(output) if fits(o)), None)
    return None


def per_position(output: Any, b: int, t: int) -> torch.Tensor | None:
    """The output if it is a floating tensor with leading shape ``[b, t]``, or the first such
    tensor of a tuple/list/dict output (one level deep: the logits of ``{"loss", "logits"}``)."""
    key = _where(output, b, t)
    return None if key is None else output if key == () else output[key]


def _replacements(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Per position j, an id of column j of the batch ``x`` other than ``row[:, j]`` where there is
    one: the column's minimum, or its maximum where the row holds the minimum."""
    lo, hi = x.amin(0, keepdim=True), x.amax(0, keepdim=True)
    return torch.where(row == lo, hi, lo)


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
        self.disabled: str | None = None  # why the probe stopped (it raised once)

    def __call__(
        self, x: torch.Tensor, args: tuple, kwargs: dict, output: Any, where: int | str = 0
    ) -> dict[str, torch.Tensor | int] | None:
        """``{"leak", "cut", "pos", "len"}`` (tensors on the device for the first three, kept
        there: the recorder fetches them with the step's other values), or None when the
        forward is not a sequence model's or the probe is disabled.  ``x`` is the token ids,
        ``where`` where the forward got them (0: ``args[0]``, or a keyword; see ``token_arg``)."""
        b, t = x.shape
        # A batch of one sequence has no other ids to put at a position (see the module doc).
        if self.disabled is not None or b < 2:
            return None
        key = _where(output, b, t)
        if key is None:
            return None
        cuts_ = cuts(t)
        row = x[:1]
        other = _replacements(x, row)
        copies = [torch.cat([row[:, :c], other[:, c:]], dim=1) for c in cuts_]
        n = 1 + len(cuts_)
        probe = torch.cat([row, *copies])
        if where == 0:
            more = (probe, *(_rows(a, b, n) for a in args[1:]))
            kw = {k: _rows(v, b, n) for k, v in kwargs.items()}
        else:
            more = tuple(_rows(a, b, n) for a in args)
            kw = {k: probe if k == where else _rows(v, b, n) for k, v in kwargs.items()}
        try:
            out = self._run(probe.device, more, kw)
        except Exception as exc:  # a probe must never break the training it watches
            self.disabled = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"causality probe disabled: {type(self.model).__name__} raised on the probe batch ({self.disabled})",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        if _where(out, n, t) != key:  # in eval mode the model returns something else
            return None
        out = out if key == () else out[key]
        kind = torch.promote_types(out.dtype, torch.float32)
        delta = (out[1:].to(kind) - out[:1].to(kind)).abs().reshape(n - 1, t, -1).amax(-1)  # [cuts, t]
        ratios, positions = [], []
        for i, c in enumerate(cuts_):
            before, after = delta[i, :c], delta[i, c:]
            ratios.append(before.max() / after.max().clamp_min(TINY))
            positions.append(before.argmax())
        ratios_t = torch.stack(ratios)
        k = ratios_t.argmax()
        cut = torch.zeros((), dtype=torch.int64, device=x.device)
        for i, c in enumerate(cuts_):  # cuts_[k], without a host sync (k stays on the device)
            cut = torch.where(k == i, c, cut)
        return {"leak": ratios_t[k], "cut": cut, "pos": torch.stack(positions)[k], "len": t}

    def _run(self, device: torch.device, args: tuple, kwargs: dict) -> Any:
        model = self.model
        modules = list(model.modules())  # pre-order: a parent before its children
        modes = [m.training for m in modules]
        saved = [(m._buffers, name, b, b.clone()) for m in modules for name, b in m._buffers.items() if b is not None]
        devices = [] if device.type == "cpu" else [device]
        try:
            with _probing(), torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=device.type):
                for m in modules:  # the flags only: no train()/eval() override runs
                    m.training = False
                return model(*args, **kwargs)
        finally:
            with _probing(), torch.no_grad():
                for m, mode in zip(modules, modes):
                    m.training = mode
                for where, name, t, value in saved:
                    if where.get(name) is not t:  # rebound (x = x + 1)
                        where[name] = t
                    # Through .data: the same storage, without bumping the version counter that
                    # autograd checks (the training forward may have saved the tensor).
                    t.data.copy_(value)
