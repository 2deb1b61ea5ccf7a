"""ABFT's checks of convolution layers: Y at the forward hook, dX and dW at the call's
``ConvolutionBackward0`` node (where the injector's conv faults land too), each as the checksum
lines of :mod:`sdcscope.detect.abft.convcheck`."""

from __future__ import annotations

import math

import torch
from torch import nn

from sdcscope.common.modules import TRANSPOSED_TYPES
from sdcscope.common.tensors import no_autocast
from sdcscope.detect.abft.convcheck import (
    Geometry,
    conv_model,
    conv_node,
    forward_lines,
    grad_input_lines,
    grad_weight_lines,
)
from sdcscope.detect.abft.records import CallContext, CheckRecord, Layer
from sdcscope.detect.checksum import GemmCheck


class ConvChecks:
    """The :class:`ABFTDetector` part that checks convolutions (uses its ``_cs``, ``_records``,
    ``_model``, ``_shielded``, ``_backward_ran`` and ``skipped_higher_order``)."""

    def _conv_forward(
        self, layer: Layer, ctx: CallContext, module: nn.Module, x, out: torch.Tensor, gemms: set[str]
    ) -> None:
        """Check Y; hook the call's ``ConvolutionBackward0`` node for dX and dW. The node holds
        the input as the GEMM consumed it (padded by the module, cast under autocast) and the
        convolution's parameters; without one (no grad), the module convolves the checksum."""
        with no_autocast(out.device):
            self._conv_checks(layer, ctx, module, x, out, gemms)
        if not ctx.need:
            ctx.release()  # a conv keeps no operands in the context: its node has them

    def _conv_checks(
        self, layer: Layer, ctx: CallContext, module: nn.Module, x, out: torch.Tensor, gemms: set[str]
    ) -> None:
        call = ctx.call
        transposed = isinstance(module, TRANSPOSED_TYPES)
        # Saved-tensor hooks (non-reentrant activation checkpointing, offloading) would run on the
        # node's saved operands if read here: a checkpoint recomputes its region at once and keeps
        # the result (its memory saving lost); such a call's forward is checked from the module's
        # input, its dX and dW are not (nor can a hook read them in backward: a checkpoint lets each
        # saved tensor be unpacked once, by the node itself).
        hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        found = conv_node(out, module.weight, transposed) if out.requires_grad and not hooked else None
        y = out if out.dim() == module.weight.dim() else out.unsqueeze(0)  # unbatched input
        cd = out.dtype
        model = conv_model(self._model(cd, out.device), out.device)
        if found is not None:
            node, geo = found
            xc, w = node._saved_input, node._saved_weight
        else:
            xc = x.to(cd) if x.dim() == y.dim() else x.to(cd).unsqueeze(0)
            w = module.weight.to(cd)
            geo = (
                Geometry(tuple(module.stride), tuple(module.padding), tuple(module.dilation), module.groups)
                if transposed
                else None
            )
        if "forward" in gemms:
            bias = None if module.bias is None else module.bias.to(cd)
            if transposed:  # the forward of a transposed conv is a conv's dX product
                lines = grad_input_lines(xc, w, y, geo, model=model, cs=self._cs, bias=bias)
                k = (w.shape[0] // geo.groups) * math.prod(w.shape[2:])
            else:
                conv = geo.conv if found is not None else (lambda a, b: module._conv_forward(a, b, None))
                lines = forward_lines(xc, w, bias, y, conv, model=model, cs=self._cs)
                k = math.prod(w.shape[1:])
            self._conv_record(layer, "forward", call, lines, "row", (y.shape[0], *y.shape[2:]), k, cd)
        pad = None  # a module padding its input itself: dX is checked where the module's input gets it
        if "op0" in ctx.need:
            pad = padding_of(module, node) if found is not None else None
            if pad is None:
                ctx.done("op0")
        if found is None or not ({"grad_input", "grad_weight"} & gemms):
            return
        node.register_hook(
            self._shielded(
                lambda grad_inputs, grad_outputs: self._conv_backward(
                    layer,
                    call,
                    geo,
                    transposed,
                    xc,
                    w,
                    grad_inputs,
                    grad_outputs,
                    gemms,
                    None if pad is None else (ctx, pad),
                )
            )
        )

    def _conv_backward(
        self,
        layer: Layer,
        call: tuple,
        geo: Geometry,
        transposed: bool,
        xc: torch.Tensor,
        w: torch.Tensor,
        grad_inputs,
        grad_outputs,
        gemms: set[str],
        deferred=None,
    ) -> None:
        """Post-hook of a convolution's node: dY in, dX and dW out (after any fault an injector's
        earlier hook on the node wrote into them); ``xc``, ``w``: the operands the node saved. A
        transposed convolution's dX is a convolution of dY, its dW a conv's dW, roles swapped.
        ``deferred`` = (context, padding): the dX check waits for the module's own dX (the
        gradient of its unpadded input, :meth:`_conv_module_dx`), where the injector's faults
        on it land and whose coordinates the event names."""
        dy, dx, dw = grad_outputs[0], grad_inputs[0], grad_inputs[1]
        self._backward_ran = True
        if dy is None:
            return None
        if torch.is_grad_enabled():  # a create_graph backward (see _set_dy): not this call's alone
            self.skipped_higher_order += 1
            return None
        with torch.no_grad(), no_autocast(dy.device):
            model = conv_model(self._model(dy.dtype, dy.device), dy.device)
            if deferred is not None:
                ctx, pad = deferred
                ctx.conv = (dy, w, geo, model, pad, dx.shape[2:])
            elif dx is not None and "grad_input" in gemms:
                if transposed:
                    lines = forward_lines(dy, w, None, dx, geo.conv, model=model, cs=self._cs)
                    k = math.prod(w.shape[1:])
                else:
                    lines = grad_input_lines(dy, w, dx, geo, model=model, cs=self._cs)
                    k = (dy.shape[1] // geo.groups) * math.prod(w.shape[2:])
                self._conv_record(layer, "grad_input", call, lines, "row", (dx.shape[0], *dx.shape[2:]), k, dy.dtype)
            if dw is not None and "grad_weight" in gemms:
                a, b = (dy, xc) if transposed else (xc, dy)  # (the conv's input, its output gradient)
                lines = grad_weight_lines(b, a, dw, geo, model=model, cs=self._cs)
                self._conv_record(
                    layer,
                    "grad_weight",
                    call,
                    lines,
                    "col",
                    tuple(dw.shape[1:]),
                    b.shape[0] * math.prod(b.shape[2:]),
                    dy.dtype,
                )
        return None

    def _conv_record(
        self,
        layer: Layer,
        gemm: str,
        call: tuple,
        lines: list,
        side: str,
        dims: tuple[int, ...],
        k: int,
        cd: torch.dtype,
    ) -> None:
        """Record a convolution check; its event index: forward / grad_input (n, None, *position)
        — the checksum sums the group's channels —, grad_weight (None, input channel, *tap)."""
        self._records.append(
            CheckRecord(
                layer.name,
                gemm,
                call,
                k,
                str(cd),
                GemmCheck(lines, (side,)),
                layout="position" if side == "row" else "weight",
                dims=dims,
            )
        )

    def _conv_module_dx(self, layer: Layer, ctx: CallContext, grad: torch.Tensor) -> None:
        """A self-padding conv's dX as the module's input receives it (the gradient of its own,
        unpadded input), checked through the padding's adjoint."""
        if ctx.conv is not None:
            dy, w, geo, model, pad, padded = ctx.conv
            with torch.no_grad(), no_autocast(grad.device):
                g = grad if grad.dim() == w.dim() else grad.unsqueeze(0)
                lines = grad_input_lines(dy, w, g, geo, model=model, cs=self._cs, pad=(padded, pad))
                self._conv_record(
                    layer,
                    "grad_input",
                    ctx.call,
                    lines,
                    "row",
                    (g.shape[0], *g.shape[2:]),
                    (dy.shape[1] // geo.groups) * math.prod(w.shape[2:]),
                    dy.dtype,
                )
        ctx.done("op0")


def self_padding(module: nn.Module) -> bool:
    """A convolution that pads its input itself before the GEMM (``padding_mode`` other than
    ``'zeros'``; ``padding='same'``, asymmetric for an even kernel): its GEMM's dX is the padded
    input's gradient, not the module's."""
    return getattr(module, "padding_mode", "zeros") != "zeros" or getattr(module, "padding", None) == "same"


def padding_of(module: nn.Module, node):
    """The module's own padding of its input as a function of a g-channel proxy, or ``None``
    when this call's GEMM consumed the input unpadded (an odd kernel's symmetric ``'same'``)."""
    if module.padding_mode != "zeros":
        pads, mode = module._reversed_padding_repeated_twice, module.padding_mode
    else:
        pad_node = node.next_functions[0][0]
        if type(pad_node).__name__ != "ConstantPadNdBackward0":
            return None
        pads, mode = tuple(pad_node._saved_pad), "constant"
    return lambda z: torch.nn.functional.pad(z, pads, mode=mode)
