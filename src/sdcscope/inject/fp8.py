"""GEMM faults of FP8 layers (:class:`~sdcscope.common.fp8.Fp8Linear`, torchao's ``Float8Linear``):
a ``gemm.*`` spec on one
is carried by a wrapper on the layer's GEMM site, next to ``torch._scaled_mm`` (inside any
detector's wrapper), so the fault is in the computation as the unit runs it.

``operand`` picks what is hit (:data:`~sdcscope.faults.vocab.GEMM_OPERANDS`): the fp32 result
(``output``, the default), an fp8 operand (``a``, ``b``: the fault lives in the operand's fp8
format, ``float8_e4m3fn`` or ``float8_e5m2``, exact bits recorded) or a per-tensor scale
(``scale_a``, ``scale_b``: fp32). The operand or scale is corrupted in a copy the GEMM reads: the
quantizer's own tensors (which the backward GEMMs and ABFT read) stay as they were. Records name
the module with the operand as a suffix (``blocks.0.mlp.fc:scale_b``); the forward call's
number is carried to its dX and dW.
"""

from __future__ import annotations

import torch

from sdcscope.common.fp8 import ScaledGemm, add_fp8_wrapper, is_fp8_linear, operand_dtype
from sdcscope.faults import FaultSpec
from sdcscope.inject.targets import Target

GEMM_OF_SITE = {"gemm.forward": "forward", "gemm.grad_input": "grad_input", "gemm.grad_weight": "grad_weight"}


def fp8_site(spec: FaultSpec, t: Target) -> bool:
    """Whether ``spec`` lands on an FP8 layer's GEMM (carried by :class:`Fp8Sites`)."""
    return spec.site in GEMM_OF_SITE and is_fp8_linear(t.module)


def fp8_view(spec: FaultSpec, t: Target) -> tuple[None, torch.dtype, None]:
    """The (shape unknown, dtype, channel dim) of the tensor ``spec`` hits on FP8 layer ``t``."""
    return (None, operand_dtype(t.module, GEMM_OF_SITE[spec.site], spec.operand or "output"), None)


def refuse_operand(spec: FaultSpec, targets: list[Target]) -> None:
    """``operand`` means something on FP8 layers only: refuse it on any other target."""
    if spec.operand is None:
        return
    for t in targets:
        if not is_fp8_linear(t.module):
            raise ValueError(
                f"operand {spec.operand!r} selects an operand or a scale of an FP8 GEMM; {t.name!r} is a "
                f"{type(t.module).__name__}, not an FP8 layer (Fp8Linear, torchao's Float8Linear); leave operand out "
                "to fault its result"
            )


class Fp8Sites:
    """The FP8 half of the injector's site hooks (uses ``_index``, ``_call``, ``_corrupt``)."""

    def _fp8_hook(self, i: int, spec: FaultSpec, t: Target):
        return add_fp8_wrapper(t.module, _Fault(self, i, spec, t), order=0)


class _Fault:
    """Spec ``i`` on FP8 layer ``t``: corrupts the result, an fp8 operand or a scale of the GEMM
    its site names, on the calls where the injector says the fault acts."""

    def __init__(self, injector, i: int, spec: FaultSpec, t: Target) -> None:
        self.injector, self.i, self.spec, self.t = injector, i, spec, t
        self.gemm, self.what = GEMM_OF_SITE[spec.site], spec.operand or "output"
        self.key = ("inject", id(injector), i)

    def around(self, module, call: ScaledGemm, inner) -> torch.Tensor:
        inj, i, spec, t = self.injector, self.i, self.spec, self.t
        if call.gemm == "forward":  # this forward call's number, carried to its dX and dW
            call.state[self.key] = inj._index(i, t)
        if call.gemm != self.gemm:
            return inner(call)
        index = call.state.get(self.key)
        backward = self.gemm != "forward"
        log = inj._call(i, spec, t, index, None if backward else call.a, backward=backward)
        if log is None:
            return inner(call)
        if self.what == "output":
            out = inner(call).clone()
            inj._corrupt(i, spec, t, out, call=index, log=log)
            return out
        faulty = getattr(call, self.what).clone()
        inj._corrupt(i, spec, t, faulty, suffix=f":{self.what}", call=index, log=log)
        return inner(call.replace(**{self.what: faulty}))
