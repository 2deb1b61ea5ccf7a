r"""The rounding-error model of a GEMM: how far a correct GEMM's checksums may be off.

Checksums are formed in ``checksum_dtype`` (fp32 by default — AEGIS's "take checksums from FP32
accumulators"; fp64 on request). The residual of a correct GEMM is
its own rounding error summed over the checksum line, plus the rounding of the checksum
arithmetic. With unit roundoff u of each stage (fp32 2⁻²⁴, TF32 2⁻¹¹, bf16 2⁻⁸, fp16 2⁻¹¹):

* **accumulation** of a length-k dot product: the error of sequential (or blocked) summation is
  ≤ u·Σₜ|sₜ| over the partial sums sₜ; modelling the per-step errors as independent gives a
  standard deviation ≤ u·√k·maxₜ|sₜ| ≤ u·√k·‖aᵢ‖‖bⱼ‖ (Cauchy-Schwarz). Errors of different
  elements are independent, so the column-j checksum error has std ≤ u·√k·‖A‖_F·‖B_{:,j}‖ and
  the row-i checksum error std ≤ u·√k·‖A_{i,:}‖·‖B‖_F. This is the usual worst-case bound
  γ_k·|A||B| (τ = c·u·k·(|a|ᵀ|b|), Higham) with k replaced by √k (probabilistic rounding, as in
  V-ABFT's variance-based bound) and |a|ᵀ|b| by norms so that the bound
  costs O(nk + km) instead of a second GEMM. Rows that repeat (dY of a mean-pooled output, a
  broadcast input) make equal errors, which add linearly: n equal rows aᵢ = a sum to
  n·u√k‖a‖‖bⱼ‖ = u√k‖1ᵀA‖‖bⱼ‖, so the model adds u√k‖1ᵀA‖‖B_{:,j}‖ (‖1ᵀA‖ is computed anyway;
  for independent rows it is about ‖A‖_F, at most doubling the term).
* **operand rounding** inside the unit (TF32 on CUDA, ``float32_matmul_precision`` 'high' or
  'medium'): each product is off by ≤ 2u_in relative: std ≤ 2u_in·‖aᵢ‖‖bⱼ‖, no √k.
* **output rounding** (to bf16/fp16, or of the final fp32 add): each element is off by
  ≤ u_out·|ĉᵢⱼ|. Independent errors give a column std ≤ u_out·‖Ĉ_{:,j}‖₂, but they are *not*
  independent when a column's values cluster within an ulp of a common value (a bias- or
  mean-dominated column rounds the same way in every row, far beyond the independent model).
  The correlated part is bounded by the common component, u_out·|Σᵢ ĉᵢⱼ| (the checksum itself,
  free), so the output term is u_out·(‖Ĉ_{:,j}‖₂ + |1ᵀĈ_{:,j}|). The common component of a
  (batch, sequence, ·) output is also taken per sequence, Σ_b|Σ_t ĉ_btj|, so rows repeated within
  each sequence (mean pooling) are covered even when the sequences' sums cancel. The 2-norm is
  read from the output clamped to the Cauchy-Schwarz bound 2·(maxᵢ‖aᵢ‖·maxⱼ‖bⱼ‖ + max|bias|),
  so a corrupted element (up to 3e38) cannot inflate its own threshold: it adds at most
  2c·u_out·|δ| ≪ |δ|. For fp32 outputs the 2-norm part is bounded by ‖A‖_F‖B_{:,j}‖ instead (no
  pass over the output). With reduced-precision split-K reductions allowed on CUDA (the PyTorch
  default for bf16/fp16), u_out counts twice. Results below the smallest normal (fp16 gradients
  of ~1e-6) round with an absolute error of up to half the subnormal spacing, which the term adds
  once per summed result.
* **checksum arithmetic** (u_cs of ``checksum_dtype``): the sum of n outputs adds
  ≤ u_cs·√n·(‖A‖_F‖B_{:,j}‖ + |1ᵀĈ_{:,j}|); forming 1ᵀA adds ≤ u_cs·√n·(‖A‖_F + ‖1ᵀA‖)·‖B_{:,j}‖ and
  the GEMV (1ᵀA)·B another u_cs·√k·‖1ᵀA‖·‖B_{:,j}‖ (same √-model; ‖1ᵀA‖ is computed, not bounded).
  In fp32 these terms dominate the threshold of an fp32 GEMM (far wider than with fp64
  checksums): calibration (``ABFTConfig.calibration_steps``) recovers much of the sensitivity. Negligible
  in fp64 and for bf16/fp16 GEMMs.

The threshold is τ = c · (sum of the stds above) with c = ``ABFTConfig.c`` (default 8: the model
std is an upper bound, and 8 of them is far in the tail of the sum of many independent rounding
errors).

"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
for _name, _u in (
    ("float8_e4m3fn", 2.0**-4),
    ("float8_e5m2", 2.0**-3),
    ("float8_e4m3fnuz", 2.0**-4),
    ("float8_e5m2fnuz", 2.0**-3),
):
    if hasattr(torch, _name):
        UNIT_ROUNDOFF[getattr(torch, _name)] = _u
TF32_ROUNDOFF = 2.0**-11
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class RoundingModel:
    """Unit roundoffs of the stages of one GEMM (see the module docstring)."""

    compute_dtype: torch.dtype
    u_in: float
    u_acc: float
    u_out: float
    u_cs: float
    narrow: bool
    """Output narrower than the fp32 accumulator: the output-rounding term reads the output."""


def unit_roundoff(dtype: torch.dtype) -> float:
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(
            f"no unit roundoff for dtype {dtype}; floating dtypes: {', '.join(str(d) for d in UNIT_ROUNDOFF)}"
        ) from None


def rounding_model(
    compute_dtype: torch.dtype, device: torch.device | str, checksum_dtype: torch.dtype
) -> RoundingModel:
    """The model for a GEMM computing in ``compute_dtype`` on ``device`` under the current
    torch settings (TF32, float32 matmul precision, reduced-precision reductions)."""
    dev = torch.device(device).type
    u = unit_roundoff(compute_dtype)
    u_cs = unit_roundoff(checksum_dtype)
    if compute_dtype.itemsize >= 4:
        u_in = 0.0
        if compute_dtype == torch.float32:
            prec = torch.get_float32_matmul_precision()
            if prec == "medium":
                u_in = 2 * UNIT_ROUNDOFF[torch.bfloat16]
            elif prec == "high" or (dev == "cuda" and torch.backends.cuda.matmul.allow_tf32):
                u_in = 2 * TF32_ROUNDOFF
        return RoundingModel(compute_dtype, u_in, u, u, u_cs, narrow=False)
    u_out = u
    if dev == "cuda":
        m = torch.backends.cuda.matmul
        reduced = (
            m.allow_bf16_reduced_precision_reduction
            if compute_dtype == torch.bfloat16
            else m.allow_fp16_reduced_precision_reduction
        )
        if reduced:
            u_out = 2 * u
    return RoundingModel(compute_dtype, 0.0, UNIT_ROUNDOFF[torch.float32], u_out, u_cs, narrow=True)


FP8_ACCUMULATOR_BITS = {"cpu": 24, "cuda": 14}
"""Significand bits an FP8 GEMM's accumulator keeps, per device type: CPU's ``torch._scaled_mm``
accumulates the fp8 products in fp32; NVIDIA Hopper's FP8 tensor cores keep about 14 bits
(DeepSeek-V3 report, section 3.3.2), which the model takes as its unit roundoff 2⁻¹⁴. Other
devices: fp32's."""


def fp8_rounding_model(device: torch.device | str, checksum_dtype: torch.dtype) -> RoundingModel:
    """The model of an FP8 GEMM C = (s_a·A)·(s_b·B) returned in fp32, checked against its
    dequantized operands in fp32 (docs/guard.md, "FP8 GEMMs"): a product of two fp8 values (≤ 4
    significand bits each) is exact in fp32; the products are accumulated with the device's
    accumulator (:data:`FP8_ACCUMULATOR_BITS`, √k model); the GEMM's s_a·s_b and its product with
    the sum round twice in fp32, and the reference's s_a·a and s_b·b once per operand: 4u of fp32
    per product (``u_in``); the fp32 output rounds once (``u_out``); no output quantization."""
    u = UNIT_ROUNDOFF[torch.float32]
    bits = FP8_ACCUMULATOR_BITS.get(torch.device(device).type, 24)
    return RoundingModel(torch.float32, 4 * u, 2.0**-bits, u, unit_roundoff(checksum_dtype), narrow=False)


@functools.lru_cache(maxsize=4096)
def line_coefs(model: RoundingModel, summed: int, k: int) -> tuple[float, float, float]:
    """``(a1, a2, beta)`` of a :class:`Line` whose checksums each sum ``summed`` results of
    length-``k`` dot products (see the module docstring)."""
    u_base = model.u_in + model.u_acc * math.sqrt(k) + (0.0 if model.narrow else model.u_out)
    r, u_cs = math.sqrt(summed), model.u_cs
    return u_base + 2 * u_cs * r, u_base + u_cs * (r + math.sqrt(k)), model.u_out + u_cs * r


def subnormal_error(dtype: torch.dtype) -> float:
    """Largest rounding error of a result of ``dtype`` below its smallest normal (half the
    subnormal spacing): there the error is absolute, not relative to the result."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


_NORM_TINY = {torch.float64: torch.finfo(torch.float64).tiny}


def norm_floor(count: int, dtype: torch.dtype) -> float:
    """√(count·tiny) of the norm dtype of ``dtype`` (see :meth:`Operand.norm_floor`)."""
    return math.sqrt(count * _NORM_TINY.get(dtype, _TINY))
