r"""Tile checks of a bf16/fp16 GEMM result against what the hardware accumulated.

A low-precision GEMM C = A·B multiplies the bf16/fp16 operands exactly and accumulates in fp32,
then rounds each result to bf16/fp16. Column checksums over all n rows must leave room for the
rounding of n outputs, which in bf16 is far wider than any single wrong element below the top
exponent bit (a halved or quadrupled value). Tile checks shrink the sum: C is cut into r×s tiles
(``ABFTConfig.tile``) and each tile sum is compared with

    (R·A)·(B·S)   in fp32, from the operands as the GEMM consumed them, upcast

(R sums blocks of r rows of A, S blocks of s columns of B: a GEMM of 1/(r·s) of the checked
one's work). The residual of a correct result is the rounding of its outputs, bounded per element
by round-to-nearest, |round(y) − y| ≤ u·|y| (u = 2⁻⁸ bf16, 2⁻¹¹ fp16; doubled where CUDA may
reduce in low precision), and summed over the tile: a *hard* bound, u·Σ_tile|ĉ| (from the output
itself; a corrupted element adds only u of its own error; below the smallest normal, half the
subnormal spacing per element), that is not multiplied by the
threshold's c. What c multiplies is the fp32 part alone -- the GEMM's accumulation over k, the
tile sums and the check's own GEMM --, modelled as u₃₂·(√k + r·s + 2)·‖A_P‖_F·‖B_Q‖_F per tile
(independent rounding errors bounded by Cauchy-Schwarz; ‖A_P‖ the Frobenius norm of the tile's
rows of A, ‖B_Q‖ of its columns of B), orders of magnitude below the hard part in bf16. A change δ
of one element is caught for certain when |δ| > 2u·Σ_tile|ĉ| + c·(fp32 part) (the rounding of the
tile's other elements may take back up to u·Σ_tile|ĉ| of it): with 8×8 tiles, a bf16 element
changed by more than 2·2⁻⁸·64 = 1/2 of the tile's mean magnitude, most often by far less.
"""

from __future__ import annotations

import math

import torch

from sdcscope.common.tensors import no_autocast
from sdcscope.detect.checksum import Line, Operand
from sdcscope.detect.rounding import UNIT_ROUNDOFF, RoundingModel, subnormal_error

_F32 = torch.float32


def matrix(op: Operand) -> torch.Tensor:
    """The operand as the GEMM consumed it: (n, k) for a flat one, (…, n, k) batched, transposition applied."""
    x = op.t
    if op.flat:
        x = x.reshape(-1, x.shape[-1])
    return x.transpose(-2, -1) if op._flip else x


def block_sum(t: torch.Tensor, dim: int, size: int, *, absolute: bool = False) -> torch.Tensor:
    """Sums (``absolute``: sums of magnitudes) of consecutive blocks of ``size`` along ``dim``, in
    fp32; a last, shorter block holds the remainder. Views only: no copy of ``t``."""
    dim = dim % t.dim()
    n = t.shape[dim]
    q, rem = divmod(n, size)
    parts = []

    def reduce(x: torch.Tensor, d: int) -> torch.Tensor:
        # |x| then a sum: a 1-norm vector_norm over a strided dim is far slower on CPU
        return (x.abs() if absolute else x).sum(d, dtype=_F32)

    if q:
        parts.append(reduce(t.narrow(dim, 0, q * size).unflatten(dim, (q, size)), dim + 1))
    if rem:
        parts.append(reduce(t.narrow(dim, q * size, rem), dim).unsqueeze(dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def tile_sums(c: torch.Tensor, r: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The r×s tile sums of ``c`` (…, n, m) and of its magnitudes, in fp32: rows first (a
    reduction across the contiguous last dim), then columns of the r-fold smaller partial sums."""
    rows = c.to(_F32, copy=True)
    act = block_sum(block_sum(rows, -2, r), -1, s)
    return act, block_sum(block_sum(rows.abs_(), -2, r), -1, s)


def tile_terms(
    am: torch.Tensor, bm: torch.Tensor, an: torch.Tensor, bn: torch.Tensor, bias: torch.Tensor | None, r: int, s: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the r×s tile check of C = A·B (+ bias) expects, from A (…, n, k), B (…, k, m) and
    their row / column norms ``an`` (…, n), ``bn`` (…, m): the tile sums of the product of A's
    row blocks and B's column blocks (…, P, Q), rows per tile row (P), and the squared norms of
    A's row blocks (…, P) and B's column blocks (…, Q), the bias counted as one more column of A
    (ones) and row of B."""
    n = am.shape[-2]
    exp = torch.matmul(block_sum(am, -2, r), block_sum(bm, -1, s))  # (…, P, Q) fp32
    counts = block_sum(torch.ones(n, device=am.device), 0, r)  # rows per tile row
    a_sq, b_sq = block_sum(an * an, -1, r), block_sum(bn * bn, -1, s)
    if bias is not None:
        exp = exp + counts.unsqueeze(-1) * block_sum(bias.detach().reshape(-1), 0, s)
        bb = bias.detach().float().reshape(-1)
        a_sq, b_sq = a_sq + counts, b_sq + block_sum(bb * bb, 0, s)
    return exp, counts, a_sq, b_sq


def tile_bounds(
    mag: torch.Tensor,
    counts: torch.Tensor,
    a_sq: torch.Tensor,
    b_sq: torch.Tensor,
    m: int,
    k: int,
    r: int,
    s: int,
    model: RoundingModel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(model std of the fp32 part, hard output-rounding bound) of each tile (see the module
    docstring), from the tile sums of |C| (``mag``) and :func:`tile_terms`' norms."""
    u32 = UNIT_ROUNDOFF[_F32]
    sigma = (u32 * (math.sqrt(k) + r * s + 2)) * (a_sq.sqrt().unsqueeze(-1) * b_sq.sqrt().unsqueeze(-2))
    u_out = model.u_out * (1 + 2 * model.u_out)  # |round(y) − y| ≤ u|y| ≤ u(1+2u)|round(y)|
    # below the smallest normal the error is absolute: half the subnormal spacing per element
    per_tile = counts.unsqueeze(-1) * block_sum(torch.ones(m, device=mag.device), 0, s)
    hard = torch.addcmul(u_out * mag, per_tile, torch.tensor(subnormal_error(model.compute_dtype), device=mag.device))
    return sigma, hard


def tile_line(
    a: Operand,
    b: Operand,
    c: torch.Tensor,
    *,
    model: RoundingModel,
    tile: int,
    bias: torch.Tensor | None = None,
) -> tuple[Line, int]:
    """The tile line of C = A·B (+ bias) (see the module docstring) and its number of tile
    columns (to name a failing tile). Operands as for :func:`~sdcscope.detect.checksum.gemm_lines`."""
    with torch.no_grad(), no_autocast(c.device):
        am, bm = matrix(a), matrix(b)
        n, k = am.shape[-2:]
        m = bm.shape[-1]
        cm = c.reshape(-1, c.shape[-1]) if a.flat else c
        r = s = tile
        an = a.stat("rn").float().reshape(*am.shape[:-2], n)
        bn = b.stat("cn").float().reshape(*bm.shape[:-2], m)
        exp, counts, a_sq, b_sq = tile_terms(am, bm, an, bn, bias, r, s)
        act, mag = tile_sums(cm, r, s)
        sigma, hard = tile_bounds(mag, counts, a_sq, b_sq, m, k, r, s, model)
        rows = act.numel() // max(act.shape[-2] * act.shape[-1], 1)
        width = act.shape[-2] * act.shape[-1]
        ones = torch.ones(rows, device=c.device, dtype=_F32)
        line = Line(
            act.reshape(-1),
            exp.reshape(-1),
            sigma.reshape(-1),
            ones,
            torch.zeros(rows, device=c.device, dtype=_F32),
            1.0,
            0.0,
            0.0,
            rows,
            width,
            hard=hard.reshape(-1),
        )
    return line, act.shape[-1]
