r"""Checksums of a convolution's three GEMMs — forward Y, dX and dW — without forming im2col.

Per group ``j`` a convolution is the GEMM Y_j[P, O_g] = A_j[P, k] · W_jᵀ[k, O_g] of im2col (P
positions, k = C_g·T channels × taps); dX_j = (patches of dY) · W_j and dW_j = dY_jᵀ · A_j are
GEMMs of the same operands. Each check is one :class:`~sdcscope.detect.checksum.Line` of those
GEMMs (one batch entry per group), whose expected side is one convolution with ``g`` output
channels: Y per output position and dX per input position (summed over the group's channels,
so an event names the position, not the channel), dW per weight column (i, t). A transposed
convolution is the adjoint of a convolution: the same three checks, roles swapped. A module that
pads its input itself is checked on its own, unpadded input's gradient, through the padding's adjoint.

The rounding model treats the conv as dot products of length k (Y), O_g·T (dX) and P (dW), which
fits direct, im2col and implicit-GEMM algorithms; FFT or Winograd ones (cuDNN may pick them with
``torch.backends.cudnn.benchmark``) round differently: calibrate there. TF32 convolutions count
as operand rounding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.graph import through_casts
from sdcscope.common.modules import CONV_TYPES, TRANSPOSED_TYPES
from sdcscope.detect.checksum import Line, bias_augmented
from sdcscope.detect.rounding import (
    TF32_ROUNDOFF,
    UNIT_ROUNDOFF,
    RoundingModel,
    line_coefs,
    norm_floor,
    subnormal_error,
)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_INPUT = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
_WEIGHT = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def checkable_conv(module: nn.Module) -> bool:
    """An ``nn.Conv1d/2d/3d`` or ``nn.ConvTranspose1d/2d/3d`` running its own forward (a subclass
    overriding it computes something else) on a real floating-point weight."""
    base = next((c for c in CONV_TYPES + TRANSPOSED_TYPES if isinstance(module, c)), None)
    return (
        base is not None
        and type(module).forward is base.forward
        and module.weight.is_floating_point()
        and not module.weight.is_complex()
    )


def conv_model(model: RoundingModel, device: torch.device) -> RoundingModel:
    """``model`` (of the GEMMs in the conv's dtype) with cuDNN's TF32 setting for fp32 convs. A
    bf16/fp16 convolution's output rounding counts twice: blocked kernels round partial results
    to the output dtype on the way. On the CPU, a bf16/fp16 convolution is also taken to
    *accumulate* in its own dtype: depthwise kernels do (errors of u·|products| where the sum
    cancels), and weight gradients behind BatchNorm (zero-mean dY) showed per-image partial sums
    rounded to bf16. This widens the threshold of narrow CPU convolutions to u·√k·‖a‖‖b‖:
    exponent flips are still caught, low mantissa flips no longer."""
    if model.narrow:
        u = UNIT_ROUNDOFF[model.compute_dtype]
        return dataclasses.replace(model, u_out=2 * model.u_out, u_acc=u if device.type == "cpu" else model.u_acc)
    if (
        model.compute_dtype == torch.float32
        and device.type == "cuda"
        and torch.backends.cudnn.allow_tf32
        and model.u_in == 0.0
    ):
        return dataclasses.replace(model, u_in=2 * TF32_ROUNDOFF)
    return model


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The parameters of one convolution call (from its autograd node, or from the module), and
    the convolutions a check runs with them."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @property
    def dims(self) -> int:
        return len(self.stride)

    def conv(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _CONV[self.dims](x, w, None, self.stride, self.padding, self.dilation, self.groups)

    def input_grad(self, shape: tuple[int, ...], w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return _INPUT[self.dims](shape, w, dy, self.stride, self.padding, self.dilation, self.groups)

    def weight_grad(self, x: torch.Tensor, shape: tuple[int, ...], dy: torch.Tensor) -> torch.Tensor:
        return _WEIGHT[self.dims](x, shape, dy, self.stride, self.padding, self.dilation, self.groups)


def conv_node(out: torch.Tensor, weight: torch.Tensor, transposed: bool = False, max_depth: int = 3):
    """``(node, geometry)``: the ``ConvolutionBackward0`` node of the call that produced ``out``
    with ``weight`` (behind an unbatched input's squeeze, or a forward hook that replaced the
    output), or ``None``. A frozen weight has no edge: the first convolution with its shape."""
    frontier = [out.grad_fn] if out.grad_fn is not None else []
    seen: dict[int, object] = {}  # keeps the nodes alive: an id alone could be reused
    for _ in range(max_depth):
        nxt = []
        for node in frontier:
            if type(node).__name__ == "ConvolutionBackward0" and node._saved_transposed == transposed:
                edge = node.next_functions[1][0]
                if (
                    getattr(through_casts(edge), "variable", None) is weight
                    if edge is not None
                    else not weight.requires_grad and node._saved_weight.shape == weight.shape
                ):
                    return node, Geometry(
                        tuple(node._saved_stride),
                        tuple(node._saved_padding),
                        tuple(node._saved_dilation),
                        int(node._saved_groups),
                    )
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen and not hasattr(child, "variable"):
                    seen[id(child)] = child
                    nxt.append(child)
        frontier = nxt
    return None


def _to(t: torch.Tensor, cs: torch.dtype) -> torch.Tensor:
    return t if t.dtype == cs else t.to(cs)


def _groups_first(t: torch.Tensor, g: int) -> torch.Tensor:
    """(N, g, *sp) -> (g, N·sp): one row per group (free when g = 1)."""
    return t.reshape(1, -1) if g == 1 else t.movedim(1, 0).reshape(g, -1)


def _norms(t: torch.Tensor, g: int) -> torch.Tensor:
    """‖t‖_F of each group's slice along dim 0 of ``t`` (g, …) -> (g,)."""
    return torch.linalg.vector_norm(t.reshape(g, -1), dim=1)


def _line(
    model: RoundingModel,
    act,
    exp,
    scale,
    s1,
    v,
    *,
    rows: int,
    summed: int,
    k: int,
    scale_count: int,
    s1_count: int,
    dtype: torch.dtype,
    extra=None,
) -> Line:
    a1, a2, beta = line_coefs(model, summed, k)
    return Line(
        act.reshape(-1),
        exp.reshape(-1),
        scale.reshape(-1),
        s1,
        v.reshape(-1),
        a1,
        a2,
        beta,
        rows,
        act.numel() // rows,
        norm_floor(s1_count, dtype),
        norm_floor(scale_count, dtype),
        None if extra is None else extra.reshape(-1),
    )


def _rounding_extra(
    model: RoundingModel,
    c: torch.Tensor,
    act: torch.Tensor,
    reduce: Callable,
    cap: torch.Tensor,
    summed: int,
    roundings: int = 1,
) -> torch.Tensor | None:
    """Output rounding of a narrow (bf16/fp16) result: u_out·(‖line‖₂ + |Σ line|), the result
    clamped to twice its Cauchy-Schwarz bound so a corrupted element cannot hide itself, plus
    the absolute error of results below the smallest normal (half a subnormal spacing each, for
    the ``summed`` results of a checksum: fp16 gradients of 1e-5 are subnormal, and their
    relative error is no longer u_out — a clean fp16 dX check reached 90 model stds without it).
    ``roundings``: partial results rounded to the output dtype per result (a col2im sum over the
    overlapping taps), independent: √roundings times the term."""
    if not model.narrow:
        return None
    cc = c.float().clamp(-cap, cap)
    # rounded twice below the smallest normal too, like u_out (conv_model)
    return math.sqrt(roundings) * (
        model.u_out * (reduce(cc * cc).sqrt() + act.abs()) + 2 * summed * subnormal_error(c.dtype)
    )


def _adjoint(fn: Callable, shape: tuple[int, ...]) -> Callable:
    """t -> the adjoint of the linear map ``fn`` (from tensors of ``shape``) applied to t."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            z = torch.zeros(shape, dtype=t.dtype, device=t.device, requires_grad=True)
            return torch.autograd.grad(fn(z), z, t)[0]

    return apply


def forward_lines(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    conv: Callable,
    *,
    model: RoundingModel,
    cs: torch.dtype,
) -> list[Line]:
    """Σ_o Y[n, o, p] vs conv(X, Σ_o W_o) + Σ_o b_o per group and output position. ``x``, ``w``:
    the operands in the conv's compute dtype; ``conv(x, w)`` convolves like the call did (in its
    g groups). (Also a transposed convolution's dX: dY convolved with its weight.) The patch
    norms convolve X² summed over each group's channels (g channels, not C) with ones."""
    o = y.shape[1]
    g = x.shape[1] // w.shape[1]
    og, cg, taps = o // g, w.shape[1], math.prod(w.shape[2:])
    wf = _to(w, cs)
    wg = wf.unflatten(0, (g, og)).sum(1)  # (g, C_g, *ks)
    xc = _to(x, cs)  # (the norm dtype too: fp32, or fp64 checksums)
    exp = conv(xc, wg)
    ones = torch.ones((g, 1, *w.shape[2:]), dtype=xc.dtype, device=xc.device)
    patch = conv((xc * xc).unflatten(1, (g, cg)).sum(2), ones).clamp_min(0).sqrt()  # ‖A_p‖
    if bias is not None:
        exp = exp + _to(bias, cs).view(g, og).sum(1).view(1, g, *(1,) * (y.dim() - 2))
    act = y.unflatten(1, (g, og)).sum(2, dtype=cs)  # (N, g, *out)
    s1 = _norms(wf, g)
    extra = _rounding_extra(
        model,
        y,
        act,
        lambda t: t.unflatten(1, (g, og)).sum(2),
        2
        * (
            patch.amax() * torch.linalg.vector_norm(wf.flatten(1), dim=1).amax()
            + (0 if bias is None else _to(bias, cs).abs().amax())
        ),
        og,
    )
    v, k = wg.reshape(g, -1), cg * taps
    if bias is not None:  # one more term of every dot product, per group (the check sums output channels)
        patch, s1, v, k = bias_augmented(_to(bias, cs).view(g, -1), patch, s1, v, k)
    rows = lambda t: _groups_first(t, g)  # noqa: E731
    return [
        _line(
            model,
            rows(act),
            rows(exp),
            rows(patch),
            s1,
            v,
            rows=g,
            summed=og,
            k=k,
            scale_count=cg * taps,
            s1_count=og * cg * taps,
            dtype=wf.dtype,
            extra=None if extra is None else rows(extra),
        )
    ]


def grad_input_lines(
    dy: torch.Tensor,
    w: torch.Tensor,
    dx: torch.Tensor,
    geo: Geometry,
    *,
    model: RoundingModel,
    cs: torch.dtype,
    bias: torch.Tensor | None = None,
    pad: tuple | None = None,
) -> list[Line]:
    """Σ_i dX[n, i, q] vs conv_input(dY, Σ_i W_i) (+ Σ_i bias_i) per group and input position
    (also a transposed convolution's forward: dY the input, dX the output). ``pad`` =
    (padded spatial shape, padding function): ``dx`` is the gradient of the *unpadded* input of
    a module that pads it itself; the expected checksums and the row norms (summed where the
    padding folds positions together: an upper bound) are taken through the padding's adjoint."""
    g = geo.groups
    n, o = dy.shape[:2]
    og, cg, taps = o // g, w.shape[1], math.prod(w.shape[2:])
    wf = _to(w, cs)
    wi = wf.unflatten(0, (g, og)).sum(2).reshape(o, 1, *w.shape[2:])  # Σ_i W[o, i]: (O, 1, *ks)
    shape = (n, g, *(dx.shape[2:] if pad is None else pad[0]))
    dyf = _to(dy, cs)  # (the norm dtype too)
    exp = geo.input_grad(shape, wi, dyf)
    ones = torch.ones((g, 1, *w.shape[2:]), dtype=dyf.dtype, device=dyf.device)
    rown = geo.input_grad(shape, ones, (dyf * dyf).unflatten(1, (g, og)).sum(2)).clamp_min(0).sqrt()
    if bias is not None:
        exp = exp + _to(bias, cs).view(g, cg).sum(1).view(1, g, *(1,) * (dx.dim() - 2))
    act = dx.unflatten(1, (g, cg)).sum(2, dtype=cs)
    if pad is not None:
        adjoint = _adjoint(pad[1], (n, g, *dx.shape[2:]))
        exp, rown = adjoint(exp), adjoint(rown)
    extra = _rounding_extra(
        model,
        dx,
        act,
        lambda t: t.unflatten(1, (g, cg)).sum(2),
        2
        * (
            rown.amax() * torch.linalg.vector_norm(wf.transpose(0, 1).flatten(1), dim=1).amax()
            + (0 if bias is None else _to(bias, cs).abs().amax())
        ),
        cg,
        # the taps overlapping at an input position, summed by col2im in the
        # output dtype (clean bf16/fp16 ratios grew with the kernel: 1.0 at 1x1,
        # 2.2 at 3x3, 3.8 at 7x7 without this)
        math.prod(-(-k // s) for k, s in zip(w.shape[2:], geo.stride)),
    )
    s1, v, k = _norms(wf, g), wi.reshape(g, -1), og * taps
    if bias is not None:  # a transposed conv's forward: its bias, as in forward_lines
        rown, s1, v, k = bias_augmented(_to(bias, cs).view(g, -1), rown, s1, v, k)
    rows = lambda t: _groups_first(t, g)  # noqa: E731
    return [
        _line(
            model,
            rows(act),
            rows(exp),
            rows(rown),
            s1,
            v,
            rows=g,
            summed=cg,
            k=k,
            scale_count=og * taps,
            s1_count=og * cg * taps,
            dtype=wf.dtype,
            extra=None if extra is None else rows(extra),
        )
    ]


def grad_weight_lines(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, geo: Geometry, *, model: RoundingModel, cs: torch.dtype
) -> list[Line]:
    """Σ_o dW[o, i, t] vs conv_weight(X, Σ_o dY_o) per group and weight column (i, t). (Also a
    transposed convolution's dW, with its input as ``dy`` and its dY as ``x``.)"""
    g = geo.groups
    n, o = dy.shape[:2]
    og, cg, taps = o // g, dw.shape[1], math.prod(dw.shape[2:])
    dys = dy.unflatten(1, (g, og)).sum(2, dtype=cs)  # (N, g, *out)
    xf = _to(x, cs)
    exp = geo.weight_grad(xf, (g, cg, *dw.shape[2:]), dys)  # (g, C_g, *ks)
    act = dw.unflatten(0, (g, og)).sum(1, dtype=cs)
    xn = torch.linalg.vector_norm(xf.transpose(0, 1).flatten(1), dim=1)  # ‖X[:, i]‖ over all positions
    scale = xn.view(g, cg, 1).expand(g, cg, taps)
    dyf = _to(dy, cs)
    s1 = _norms(dyf.unflatten(1, (g, og)).movedim(1, 0), g)
    positions = n * math.prod(dy.shape[2:])
    extra = _rounding_extra(
        model,
        dw,
        act,
        lambda t: t.unflatten(0, (g, og)).sum(1),
        2 * xn.amax() * torch.linalg.vector_norm(dyf.transpose(0, 1).flatten(1), dim=1).amax(),
        og,
    )
    return [
        _line(
            model,
            act,
            exp,
            scale,
            s1,
            _groups_first(dys, g),
            rows=g,
            summed=og,
            k=positions,
            scale_count=positions,
            s1_count=positions * og,
            dtype=xf.dtype,
            extra=extra,
        )
    ]
