r"""ABFT of FP8 GEMMs: the Y, dX and dW of an :class:`~sdcscope.common.fp8.Fp8Linear`, checked
at each ``torch._scaled_mm`` call through the layer's site (a wrapper outside the injector's).

Each call is C = (s_a·A)·(s_b·B) with A, B in fp8 and C in fp32. The reference checksums are
formed from the *dequantized* operands s_a·A and s_b·B in fp32 -- the values the rest of training
means by the operands, read as the quantizer produced them, before the GEMM unit --, and compared
with the checksums of C before any output quantization (C stays fp32). The threshold follows the
accumulator model of :func:`~sdcscope.detect.rounding.fp8_rounding_model` (fp8·fp8 products are
exact in fp32; the accumulator's unit roundoff per device; the scaling and the dequantization
round in fp32). So a fault in the result, in an fp8 operand as the unit reads it, or in a scale
the GEMM applies moves C away from the reference and is caught; events name the layer and the
GEMM (``forward``, ``grad_input``, ``grad_weight``) like every other ABFT event.
"""

from __future__ import annotations

import torch

from sdcscope.common.fp8 import ScaledGemm, add_fp8_wrapper
from sdcscope.detect.abft.records import CheckRecord, Layer
from sdcscope.detect.checksum import SIDES, GemmCheck, Operand, gemm_lines
from sdcscope.detect.rounding import fp8_rounding_model


class Fp8Checks:
    """The :class:`ABFTDetector` part that checks FP8 layers (uses its ``config``, ``_cs``,
    ``_records``, ``_on``, ``_call``, ``_shielded`` and ``_backward_ran``)."""

    def _sync_fp8(self, layer: Layer, on: bool) -> None:
        """The check wrapper on ``layer``'s GEMMs while it is sampled (``layer.fwd``: its handle)."""
        if on and layer.fwd is None:
            layer.fwd = add_fp8_wrapper(layer.module, _Fp8Wrapper(self._shielded(self._fp8_gemm), layer), order=1)
        elif not on and layer.fwd is not None:
            layer.fwd.remove()
            layer.fwd = None

    def _fp8_gemm(self, layer: Layer, call: ScaledGemm, out: torch.Tensor) -> None:
        """Record the check of one GEMM; the forward call's number is kept in the call's state for
        its dX and dW."""
        key = ("abft", id(self))
        if call.gemm == "forward":
            if not self._on(layer):
                return
            layer.hits += 1
            call.state[key] = self._call(layer)
        else:
            self._backward_ran = True  # the next forward begins a new micro-batch
        number = call.state.get(key)
        if number is None or call.gemm not in self.config.gemms:
            return
        with torch.no_grad():
            a = self._fp8_operand(call, call.a, call.scale_a)
            b = self._fp8_operand(call, call.b, call.scale_b)
            model = self._models.get(("fp8", out.device))
            if model is None:
                model = self._models[("fp8", out.device)] = fp8_rounding_model(out.device, self._cs)
            which = self.config.checksums
            lines = gemm_lines(a, b, out, model=model, which=which)
        dtype = f"{str(call.a.dtype)[6:]}x{str(call.b.dtype)[6:]}->{str(out.dtype)[6:]}"
        self._records.append(
            CheckRecord(layer.name, call.gemm, number, a.shape[1], dtype, GemmCheck(lines, SIDES[which]))
        )

    def _fp8_operand(self, call: ScaledGemm, t: torch.Tensor, scale: torch.Tensor) -> Operand:
        """The dequantized operand scale·t in fp32. X, W and dY are each read by two GEMMs of the
        call (W as Wᵀ in Y): dequantized once, kept in the call's state until its backward ends."""
        base = t if t._base is None else t._base
        key = ("abft", id(self), id(base))
        got = call.state.get(key)
        if got is None or got[0] is not base or got[1] is not scale:
            transposed = t is not base and t.shape == base.shape[::-1] and t.stride() == base.stride()[::-1]
            if t is not base and not transposed:  # another view: not shared
                return Operand(t.float().mul_(scale), self._cs)
            got = call.state[key] = (base, scale, Operand(base.float().mul_(scale), self._cs))
        return got[2] if t is base else got[2].T


class _Fp8Wrapper:
    """The detector's wrapper of one layer's GEMMs: the GEMM (and the injector's wrapper inside),
    then the check of its result."""

    def __init__(self, record, layer: Layer) -> None:
        self.record, self.layer = record, layer

    def around(self, module, call: ScaledGemm, inner) -> torch.Tensor:
        out = inner(call)
        self.record(self.layer, call, out)
        return out
