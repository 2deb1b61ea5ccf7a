r"""Row/column checksums of one GEMM and the rounding-error model that sets their thresholds.

For C = A·B (+ bias), A: (..., n, k), B: (..., k, m), C: (..., n, m) (Huang & Abraham 1984;
production_sdc.md §5)::

    column checksum  1ᵀC  vs (1ᵀA)·B + n·bias       one value per output column j
    row checksum     C·1  vs A·(B·1) + Σ bias        one value per output row i

A single wrong element (i, j) moves row checksum i and column checksum j by the same amount, so
the row and column residuals that exceed their thresholds intersect at the element.

Threshold model
---------------
Checksums are formed in ``checksum_dtype`` (fp32 by default — AEGIS's "take checksums from FP32
accumulators", production_sdc.md §7 anchors; fp64 on request). The residual of a correct GEMM is
its own rounding error summed over the checksum line, plus the rounding of the checksum
arithmetic. With unit roundoff u of each stage (fp32 2⁻²⁴, TF32 2⁻¹¹, bf16 2⁻⁸, fp16 2⁻¹¹):

* **accumulation** of a length-k dot product: the error of sequential (or blocked) summation is
  ≤ u·Σₜ|sₜ| over the partial sums sₜ; modelling the per-step errors as independent gives a
  standard deviation ≤ u·√k·maxₜ|sₜ| ≤ u·√k·‖aᵢ‖‖bⱼ‖ (Cauchy-Schwarz). Errors of different
  elements are independent, so the column-j checksum error has std ≤ u·√k·‖A‖_F·‖B_{:,j}‖ and
  the row-i checksum error std ≤ u·√k·‖A_{i,:}‖·‖B‖_F. This is the usual worst-case bound
  γ_k·|A||B| (τ = c·u·k·(|a|ᵀ|b|), Higham) with k replaced by √k (probabilistic rounding, as in
  V-ABFT's variance-based bound, production_sdc.md §5) and |a|ᵀ|b| by norms so that the bound
  costs O(nk + km) instead of a second GEMM.
* **operand rounding** inside the unit (TF32 on CUDA, ``float32_matmul_precision`` 'high' or
  'medium'): each product is off by ≤ 2u_in relative: std ≤ 2u_in·‖aᵢ‖‖bⱼ‖, no √k.
* **output rounding** (to bf16/fp16, or of the final fp32 add): each element is off by
  ≤ u_out·|ĉᵢⱼ|. Independent errors give a column std ≤ u_out·‖Ĉ_{:,j}‖₂, but they are *not*
  independent when a column's values cluster within an ulp of a common value (a bias- or
  mean-dominated column rounds the same way in every row): measured on a bf16 GPT, such
  columns reached 7× the independent model. The correlated part is bounded by the common
  component, u_out·|Σᵢ ĉᵢⱼ| (the checksum itself, free), so the output term is
  u_out·(‖Ĉ_{:,j}‖₂ + |1ᵀĈ_{:,j}|); with it the largest clean ratio fell to ≤ 1.9. The 2-norm is
  read from the output clamped to the Cauchy-Schwarz bound 2·(maxᵢ‖aᵢ‖·maxⱼ‖bⱼ‖ + max|bias|),
  so a corrupted element (up to 3e38) cannot inflate its own threshold: it adds at most
  2c·u_out·|δ| ≪ |δ|. For fp32 outputs the 2-norm part is bounded by ‖A‖_F‖B_{:,j}‖ instead (no
  pass over the output). With reduced-precision split-K reductions allowed on CUDA (the PyTorch
  default for bf16/fp16), u_out counts twice.
* **checksum arithmetic** (u_cs of ``checksum_dtype``): the sum of n outputs adds
  ≤ u_cs·√n·(‖A‖_F‖B_{:,j}‖ + |1ᵀĈ_{:,j}|); forming 1ᵀA adds ≤ u_cs·√n·(‖A‖_F + ‖1ᵀA‖)·‖B_{:,j}‖ and
  the GEMV (1ᵀA)·B another u_cs·√k·‖1ᵀA‖·‖B_{:,j}‖ (same √-model; ‖1ᵀA‖ is computed, not bounded).
  In fp32 these terms dominate the threshold of an fp32 GEMM (a 1024×64×256 GEMM: column
  threshold 36× wider than with fp64 checksums; largest clean ratio on the tiny GPT 0.34):
  calibration (``ABFTConfig.calibration_steps``) recovers much of the sensitivity. Negligible
  in fp64 and for bf16/fp16 GEMMs.

The threshold is τ = c · (sum of the stds above) with c = ``ABFTConfig.c`` (default 8: the model
std is an upper bound, and 8 of them is far in the tail of the sum of many independent rounding
errors). On clean training of the 2-layer byte-level GPT (80 fp32 steps, 25 bf16 steps; every
GEMM forward and backward) the largest residual was 0.34 model std in fp32 and 1.9 in bf16: a
margin of 4× or more; calibration can tighten c per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdcscope.observe._util import no_autocast

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0 ** -53,
    torch.float32: 2.0 ** -24,
    torch.bfloat16: 2.0 ** -8,
    torch.float16: 2.0 ** -11,
}
for _name, _u in (("float8_e4m3fn", 2.0 ** -4), ("float8_e5m2", 2.0 ** -3),
                  ("float8_e4m3fnuz", 2.0 ** -4), ("float8_e5m2fnuz", 2.0 ** -3)):
    if hasattr(torch, _name):
        UNIT_ROUNDOFF[getattr(torch, _name)] = _u
TF32_ROUNDOFF = 2.0 ** -11
_TINY = torch.finfo(torch.float32).tiny

# what GemmCheck.locate() reports (host values), in this order
SUMMARY = ("judged", "ratio", "batch", "row", "row_ratio", "row_residual", "row_threshold",
           "col", "col_ratio", "col_residual", "col_threshold")


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
        raise ValueError(f"no unit roundoff for dtype {dtype}; floating dtypes: "
                         f"{', '.join(str(d) for d in UNIT_ROUNDOFF)}") from None


def rounding_model(compute_dtype: torch.dtype, device: torch.device | str,
                   checksum_dtype: torch.dtype) -> RoundingModel:
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
        reduced = (m.allow_bf16_reduced_precision_reduction if compute_dtype == torch.bfloat16
                   else m.allow_fp16_reduced_precision_reduction)
        if reduced:
            u_out = 2 * u
    return RoundingModel(compute_dtype, 0.0, UNIT_ROUNDOFF[torch.float32], u_out, u_cs, narrow=True)


@dataclass
class GemmCheck:
    """Device tensors of one check (batch dims flattened to one leading dim B).

    The hot path keeps only :attr:`ratio` (one 0-d tensor per check, read back together with all
    other checks in one ``.tolist()``); :meth:`locate` reads the details, for failing checks only.
    """

    ratio: torch.Tensor
    """0-d: max over batch, rows and columns of |residual| / model std (NaN or inf when the
    output is non-finite). The check fails where ratio > c."""
    row: tuple[torch.Tensor, torch.Tensor] | None
    """(residual, model std), each (B, n), or None when not computed."""
    col: tuple[torch.Tensor, torch.Tensor] | None
    """(residual, model std), each (B, m), or None when not computed."""
    exp_total: torch.Tensor
    """0-d sum of the expected checksums: finite iff the operands were (the check is judged)."""

    def locate(self) -> dict[str, float]:
        """Worst batch entry, its worst row and column (keys :data:`SUMMARY`), read to the host:
        meant for failing checks only. An unjudged check (non-finite operands) reports ratio 0;
        a side not computed reports NaN."""
        inf = math.inf
        lines = []
        for line in (self.row, self.col):
            if line is None:
                lines.append(None)
                continue
            res, tau = line
            q = torch.nan_to_num(res.abs() / tau, nan=inf)
            lines.append((res, tau, q))
        score = torch.stack([ln[2].amax(-1) for ln in lines if ln is not None]).amax(0)
        bi = int(score.argmax())
        judged = bool(torch.isfinite(self.exp_total))
        out = {"judged": float(judged), "ratio": float(score[bi]) if judged else 0.0,
               "batch": float(bi)}
        for name, ln in zip(("row", "col"), lines):
            if ln is None:
                out.update({name: math.nan, f"{name}_ratio": math.nan,
                            f"{name}_residual": math.nan, f"{name}_threshold": math.nan})
                continue
            res, tau, q = ln
            i = int(q[bi].argmax())
            out.update({name: float(i), f"{name}_ratio": float(q[bi, i]),
                        f"{name}_residual": float(res[bi, i]), f"{name}_threshold": float(tau[bi, i])})
        return out


def _vec_norms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """2-norms along ``dim`` in fp32. ``vector_norm`` along a strided (not unit-stride) dim is
    ~15× slower on CPU than squaring and summing, so that case squares explicitly."""
    if x.stride(dim) == 1 or x.shape[dim] == 1:
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)
    return x.float().square().sum(dim).sqrt()


def _matvec(mat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """(B, p, q) @ (B, q) -> (B, p). A 2-D GEMV when B == 1; batched as vᵀ·matᵀ, which CPU
    bmm runs ~20× faster than mat·v."""
    if mat.shape[0] == 1:
        return (mat[0] @ vec[0]).unsqueeze(0)
    return torch.bmm(vec.unsqueeze(1), mat.transpose(-2, -1)).squeeze(1)


def gemm_check(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    model: RoundingModel,
    checksum_dtype: torch.dtype,
    which: str = "both",
    prev: tuple[torch.Tensor, torch.Tensor] | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    b_stats: tuple[torch.Tensor, ...] | None = None,
) -> GemmCheck:
    """Check C = A·B (+ bias). ``a``, ``b`` are the operands exactly as the GEMM consumed them
    (cast them to the compute dtype first); ``c`` the result as produced.

    ``prev`` = (row sums, column sums) already in C before this product (gradient accumulation:
    C is ``param.grad`` after accumulating, the check is on the increment); ``extra`` = additional
    (row, column) model stds, e.g. the rounding of that accumulation; ``b_stats`` = the cached
    :func:`operand_stats` of ``b`` (a weight reused across micro-batches).
    """
    with no_autocast(c.device):  # hooks run inside the model's autocast region
        return _gemm_check(a, b, c, bias=bias, model=model, checksum_dtype=checksum_dtype,
                           which=which, prev=prev, extra=extra, b_stats=b_stats)


def _gemm_check(a, b, c, *, bias, model, checksum_dtype, which, prev, extra, b_stats) -> GemmCheck:
    cs = checksum_dtype
    n, k = a.shape[-2], a.shape[-1]
    m = b.shape[-1]
    a3 = a.reshape(-1, n, k)
    b3 = b.reshape(-1, k, m)
    c3 = c.reshape(-1, n, m)
    if b3.shape[0] != c3.shape[0]:
        b3 = b3.expand(c3.shape[0], k, m)
    if a3.shape[0] != c3.shape[0]:
        a3 = a3.expand(c3.shape[0], n, k)
    rows = which in ("both", "row")
    cols = which in ("both", "column")

    nA_row = _vec_norms(a3, -1)                        # (B, n)
    nA = torch.linalg.vector_norm(nA_row, dim=-1, keepdim=True)   # (B, 1)
    nB_col, nB, s_b, b_cs = b_stats if b_stats is not None else operand_stats(b3, cs)
    u_base = model.u_in + model.u_acc * math.sqrt(k) + (0.0 if model.narrow else model.u_out)
    u_cs = model.u_cs
    cc = None
    if model.narrow:
        cap = 2 * nA_row.amax(-1) * nB_col.amax(-1)    # Cauchy-Schwarz bound of any |c_ij|, ×2
        if bias is not None:
            cap = cap + 2 * bias.detach().abs().amax().float()
        cap = cap[:, None, None]
        cc = c3.float().clamp(-cap, cap)

    col = row = None
    maxima = []
    exp_total = 0.0
    if cols:
        act = c3.sum(-2, dtype=cs)                                  # 1ᵀC          (B, m)
        if prev is not None:
            act = act - prev[1].reshape(act.shape).to(cs)
        s_a = a3.sum(-2, dtype=cs)                                  # 1ᵀA          (B, k)
        exp = _matvec(b_cs.transpose(-2, -1), s_a)                  # (1ᵀA)B       (B, m)
        if bias is not None:
            exp = exp + n * bias.detach().to(cs)
        n_sa = torch.linalg.vector_norm(s_a, dim=-1, keepdim=True).float()
        # GEMM rounding + checksum arithmetic (sum over n, 1ᵀA, the GEMV) + output rounding
        coef = (u_base + 2 * u_cs * math.sqrt(n)) * nA + \
            u_cs * (math.sqrt(n) + math.sqrt(k)) * n_sa
        tau = torch.addcmul((model.u_out + u_cs * math.sqrt(n)) * act.abs().float(), coef, nB_col)
        if cc is not None:
            tau = tau + model.u_out * _vec_norms(cc, -2)
        if extra is not None:
            tau = tau + extra[1].reshape(tau.shape).float()
        tau = tau.clamp_min_(_TINY)
        res = (act - exp).float()
        col = (res, tau)
        maxima.append((res.abs() / tau).amax())
        exp_total = exp.sum()
    if rows:
        act = c3.sum(-1, dtype=cs)                                  # C1           (B, n)
        if prev is not None:
            act = act - prev[0].reshape(act.shape).to(cs)
        exp = _matvec(a3.to(cs), s_b)                               # A(B1)        (B, n)
        if bias is not None:
            exp = exp + bias.detach().sum(dtype=cs)
        n_sb = torch.linalg.vector_norm(s_b, dim=-1, keepdim=True).float()
        coef = (u_base + 2 * u_cs * math.sqrt(m)) * nB + \
            u_cs * (math.sqrt(m) + math.sqrt(k)) * n_sb
        tau = torch.addcmul((model.u_out + u_cs * math.sqrt(m)) * act.abs().float(), coef, nA_row)
        if cc is not None:
            tau = tau + model.u_out * _vec_norms(cc, -1)
        if extra is not None:
            tau = tau + extra[0].reshape(tau.shape).float()
        tau = tau.clamp_min_(_TINY)
        res = (act - exp).float()
        row = (res, tau)
        maxima.append((res.abs() / tau).amax())
        exp_total = exp_total + exp.sum()
    ratio = maxima[0] if len(maxima) == 1 else torch.maximum(*maxima)
    return GemmCheck(ratio, row, col, exp_total)


def operand_stats(b: torch.Tensor, checksum_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(column norms (B, m), Frobenius norm (B, 1), row sums B·1 (B, k), b in checksum dtype) of
    the right operand b: (B, k, m), cacheable for a weight used by several checks."""
    b3 = b if b.dim() == 3 else b.reshape(-1, *b.shape[-2:])
    n_col = _vec_norms(b3, -2)
    return (n_col, torch.linalg.vector_norm(n_col, dim=-1, keepdim=True),
            b3.sum(-1, dtype=checksum_dtype), b3.to(checksum_dtype))
