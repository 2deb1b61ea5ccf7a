"""Judging one recorded call: the reference on its sampled rows, the bound, and the fp64 second
stage that confirms a flagged row (:mod:`sdcscope.detect.canary` states the bound)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sdcscope.common.tensors import no_autocast
from sdcscope.detect.canary.record import Call
from sdcscope.detect.rounding import UNIT_ROUNDOFF

log = logging.getLogger("sdcscope.detect.canary")

_TINY = torch.finfo(torch.float32).tiny


def bound(
    got: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype,
    rtol: float,
    atol: float,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per element of rows ``got`` against ``ref``: the error over the bound (> 1 fails; ``dtype``:
    the op's result's, whose rounding it allows; ``extra``: a per-row allowance added). An element
    whose reference is not finite (non-finite inputs: the non-finite detector's) is 0, a
    non-finite result against a finite reference inf."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32])
    got = got if got.dtype == ref.dtype else got.to(ref.dtype)
    mag = ref.abs()
    per_row = (-1,) + (1,) * (mag.dim() - 1)
    tol = (mag + mag.reshape(mag.shape[0], -1).mean(1).reshape(per_row)) * (2 * u + rtol) + atol
    if extra is not None:
        tol = tol + (extra.reshape(per_row) if extra.dim() else extra)
    ratio = (got - ref).abs_().div_(tol.clamp_min_(_TINY)).masked_fill_(~torch.isfinite(ref), 0.0)
    return ratio.nan_to_num_(nan=torch.inf)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """The largest finite |x| of each row."""
    x = x.abs().nan_to_num(nan=0.0, posinf=0.0)
    return x.reshape(x.shape[0], -1).amax(1)


@dataclass
class Comparison:
    """The sampled rows of one result of a call -- its output (``slot`` None) or the gradient of
    row argument ``slot`` -- against the reference's."""

    call: Call
    slot: int | None
    got: torch.Tensor
    ref: torch.Tensor
    dtype: torch.dtype
    rtol: float
    atol: float
    ratio: torch.Tensor
    confirmed: bool | None = None
    """Judged again against the fp64 reference (False: it could not run in fp64; None: not needed)."""
    ref_error: float | None = None
    """The fp32 reference's own error on the worst row (its distance to the fp64 one)."""


def reference(call: Call, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor | None]]:
    """The reference's rows and input-gradient rows of ``call``, its floating arguments in ``dtype``
    (None: as recorded, fp32)."""
    op = call.op

    def cast(v):
        return v.to(dtype) if dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point() else v

    args, kwargs = [cast(a) for a in call.args], {k: cast(v) for k, v in call.kwargs.items()}
    grads = call.grad_out is not None and bool(call.grad_in)
    if grads:
        args = [a.detach().requires_grad_() if i in call.grad_in else a for i, a in enumerate(args)]
    with no_autocast(call.out_rows.device), torch.enable_grad() if grads else torch.no_grad():
        ref = op.reference(*args, **kwargs)
        if not isinstance(ref, torch.Tensor) or ref.shape != call.out_rows.shape:
            got = tuple(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__
            raise ValueError(f"returned {got} for rows of shape {tuple(call.out_rows.shape)}")
        if not grads:
            return ref.detach(), {}
        slots = sorted(call.grad_in)
        dy = call.grad_out.to(ref.dtype)
        if op.backward is True:
            found = torch.autograd.grad(ref, [args[s] for s in slots], dy, allow_unused=True)
            by_slot = dict(zip(slots, found))
        else:
            given = op.backward(dy, *args, **kwargs)
            given = (given,) if isinstance(given, torch.Tensor) or given is None else tuple(given)
            by_slot = dict(zip(op.row_args, given))
    refs = {s: None if by_slot.get(s) is None else by_slot[s].detach() for s in slots}
    return ref.detach(), refs


def compare(call: Call, rtol: float) -> list[Comparison]:
    """The first stage: the output's rows and each checked input gradient's against the fp32
    reference. ``rtol``: the config's, for an op that sets none."""
    op = call.op
    rtol = rtol if op.rtol is None else op.rtol
    try:
        ref, refs = reference(call)
    except Exception as exc:
        raise RuntimeError(f"canary op {op.name!r}: its reference failed: {exc}") from exc
    dtype = call.out_rows.dtype
    out = [
        Comparison(
            call, None, call.out_rows, ref, dtype, rtol, op.atol, bound(call.out_rows, ref, dtype, rtol, op.atol)
        )
    ]
    for slot, want in refs.items():
        got = call.grad_in[slot]
        if want is None:
            continue
        if want.shape != got.shape:
            raise RuntimeError(
                f"canary op {op.name!r}: its backward reference gave argument {slot} "
                f"rows of shape {tuple(want.shape)}, not {tuple(got.shape)}"
            )
        dt = call.grad_dtype[slot]  # atol is in the output's units: not for gradients
        out.append(Comparison(call, slot, got, want, dt, rtol, 0.0, bound(got, want, dt, rtol, 0.0)))
    return out


def confirm(flagged: list[Comparison], factor: float) -> None:
    """The second stage, for comparisons of one call the first flagged: the reference again in
    fp64, and each result judged against it with ``factor`` times the fp32 reference's own error
    allowed besides the bound -- an op about as accurate as an fp32 evaluation of the reference
    passes, where a result is a small difference of large terms (a confident row's cross-entropy
    gradient, off by up to its whole size in a correct fp32 kernel) that no relative bound fits.
    The fp32 error is the largest over all sampled rows of the result (one row's own may round
    exactly by chance; the absolute rounding noise is alike across rows)."""
    call = flagged[0].call
    try:
        ref64, refs64 = reference(call, torch.float64)
    except Exception as exc:  # e.g. a reference that mixes its argument with fp32 parameters
        log.debug("canary op %r: no fp64 reference (%s): the fp32 judgement stands", call.op.name, exc)
        for c in flagged:
            c.confirmed = False
        return
    for c in flagged:
        want = ref64 if c.slot is None else refs64.get(c.slot)
        if want is None:
            c.confirmed = False
            continue
        noise = row_max(c.ref.to(want.dtype) - want).amax()  # pooled: one row's own may be 0 by chance
        c.ratio = bound(c.got, want, c.dtype, c.rtol, c.atol, extra=factor * noise)
        c.ref, c.confirmed = want, True
        c.ref_error = float(noise)


def rel_error(got: torch.Tensor, ref: torch.Tensor, row: int) -> float:
    """‖got − ref‖∞ / ‖ref‖∞ of row ``row`` (the elements with a finite reference)."""
    g, r = got[row].to(ref.dtype), ref[row]
    live = torch.isfinite(r)
    err = float(torch.where(live, (g - r).abs(), 0.0).amax().nan_to_num(nan=torch.inf))
    return err / max(float(torch.where(live, r.abs(), 0.0).amax()), _TINY)
