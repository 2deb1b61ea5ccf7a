r"""Row/column checksums of one GEMM and the rounding-error model that sets their thresholds.

For C = A·B (+ bias), A: (..., n, k), B: (..., k, m), C: (..., n, m) (Huang & Abraham 1984)::

    column checksum  1ᵀC  vs (1ᵀA)·B + n·bias       one value per output column j
    row checksum     C·1  vs A·(B·1) + Σ bias        one value per output row i

A single wrong element (i, j) moves row checksum i and column checksum j by the same amount, so
the row and column residuals that exceed their thresholds intersect at the element.

The threshold of each line comes from the rounding-error model of :mod:`sdcscope.detect.rounding`.

Cost
----
Each side of a check is a :class:`Line`: the actual checksums, the expected ones and the
ingredients of their model std, all small vectors. The per-operand statistics (sums along either
axis, row/column norms, Frobenius norm) live in an :class:`Operand` that computes each one at
most once, so a tensor used by several GEMMs (the input of q/k/v projections, X in both the
forward and the dW check, dY in dX and dW) is read once per statistic. :func:`line_ratios`
then turns any number of lines into their ratios with a fixed handful of fused operations. Clean
training stays well below c (``benchmarks/`` measures the margin); calibration can tighten c per
layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdcscope.common.tensors import no_autocast
from sdcscope.detect.rounding import (
    RoundingModel,
    line_coefs,
    norm_floor,
    subnormal_error,
)

_TINY = torch.finfo(torch.float32).tiny

# what GemmCheck.locate() reports (host values), in this order
SUMMARY = (
    "judged",
    "ratio",
    "batch",
    "row",
    "row_ratio",
    "row_residual",
    "row_threshold",
    "col",
    "col_ratio",
    "col_residual",
    "col_threshold",
)


class Operand:
    """One GEMM operand and its statistics in the checksum dtype, each computed on first use and
    cached; ``.T`` is the transposed operand sharing the cache.

    ``flat=True``: ``t`` is (…, c) and every leading index is a row (a Linear's input, output or
    gradient: one matrix of all tokens); statistics are 1-D. Otherwise ``t`` is (…, r, c) with
    batch dims (a MatMul operand) and statistics are (B, ·). Sums and norms are reductions of the
    tensor as it is — never a reshaped copy — so a strided gradient costs no more than a
    contiguous one. Keys: ``s0`` column sums 1ᵀT, ``s1`` row sums T·1, ``rn`` / ``cn`` row /
    column 2-norms, ``fn`` Frobenius norm (0-d or (B,)), ``x`` / ``xt`` the matrix / its
    transpose for a GEMV.

    ``bound=True`` (flat activations): the column norms — 2-norms over all tokens, a strided
    pass plus a squared copy — are replaced by their upper bound ‖T‖_F, which the check needs
    anyway. The model std stays an upper bound; the threshold widens by ≲ √(columns) on the
    lines that use them (the dW checks), and each check saves the most expensive pass it has."""

    __slots__ = ("t", "cs", "flat", "bound", "src", "_cache", "_flip", "__weakref__")

    def __init__(
        self,
        t: torch.Tensor,
        cs: torch.dtype,
        *,
        flat: bool = False,
        bound: bool = False,
        src: torch.Tensor | None = None,
        _cache: dict | None = None,
        _flip: bool = False,
    ) -> None:
        self.t, self.cs, self.flat, self.bound = t, cs, flat, bound
        self.src = src  # the tensor ``t`` was cast from, kept alive with it
        self._cache = {} if _cache is None else _cache
        self._flip = _flip

    @property
    def T(self) -> Operand:
        return Operand(
            self.t, self.cs, flat=self.flat, bound=self.bound, src=self.src, _cache=self._cache, _flip=not self._flip
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of one matrix, transposition applied."""
        c = self.t.shape[-1]
        r = self.t.numel() // max(c, 1) if self.flat else self.t.shape[-2]
        return (c, r) if self._flip else (r, c)

    _SWAP = {"s0": "s1", "s1": "s0", "rn": "cn", "cn": "rn"}

    def seed(self, key: str, value: torch.Tensor) -> None:
        """Provide statistic ``key`` already computed elsewhere (a bias gradient is dY's ``s0``)."""
        self._cache.setdefault(self._SWAP.get(key, key) if self._flip else key, value)

    def stat(self, key: str) -> torch.Tensor:
        if key in ("x", "xt"):
            got = self._cache.get("x")
            if got is None:
                got = self._cache["x"] = self._compute("x")
            return got.transpose(-2, -1) if (key == "xt") != self._flip else got
        base = self._SWAP.get(key, key) if self._flip else key
        got = self._cache.get(base)
        if got is None:
            got = self._cache[base] = self._compute(base)
        return got

    def norm_floor(self, key: str) -> float:
        """√(n·tiny) for norm ``key`` (``rn``/``cn``/``fn``, transposition applied) over n
        elements: a square below the norm dtype's smallest normal is lost (flushed or
        underflowed), so operands below ~1e-19 (fp32) have computed norms of ~0 and the threshold
        would collapse; their true norm is at most about this. Floored (in :func:`line_ratios`),
        a rounding residual of such tiny values is no mismatch, and any flip that matters is still
        orders of magnitude above."""
        key = self._SWAP.get(key, key) if self._flip else key
        if key == "cn" and self.bound and self.flat:
            key = "fn"  # bounded by the Frobenius norm
        t = self.t
        c = t.shape[-1]
        r = t.numel() // max(c, 1) if self.flat else t.shape[-2]
        return norm_floor({"rn": c, "cn": r, "fn": r * c}[key], t.dtype)

    def _compute(self, key: str) -> torch.Tensor:
        t, cs = self.t, self.cs
        if key == "fn":
            done = self._cache.get("rn", None if self.bound else self._cache.get("cn"))
            if done is not None:
                return torch.linalg.vector_norm(done, dim=-1, keepdim=self.flat)
            if self.flat:
                return frobenius(t)
            # per matrix: first along the dimension that is contiguous in memory (CPU norm kernels
            # are fast there and ~10-50x slower along any other), caching that statistic
            inner = "rn" if t.stride(-1) == 1 else "cn" if t.stride(-2) == 1 else None
            if inner is None:
                x = t.to(_norm_dtype(t))
                return (x * x).sum((-2, -1)).sqrt().reshape(-1)
            got = self._cache.get(inner)
            if got is None:
                got = self._cache[inner] = _reduce(t, False, inner, cs)
            return torch.linalg.vector_norm(got, dim=-1)
        if key == "x":  # batched operands keep their batch dims: reshaping a strided one copies it
            x = t if t.dtype == cs else t.to(cs)
            if self.flat:
                return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            return x if x.dim() > 2 else x.unsqueeze(0)
        if key == "cn" and self.bound and self.flat:
            return self.stat("fn").expand(t.shape[-1])
        return _reduce(t, self.flat, key, cs)


def _reduce(t: torch.Tensor, flat: bool, key: str, cs: torch.dtype) -> torch.Tensor:
    """``s0``/``s1``/``rn``/``cn`` of ``t`` laid out as an :class:`Operand` (or a GEMM result)."""
    c = t.shape[-1]
    if flat:
        lead = tuple(range(t.dim() - 1))
        if key == "s0":  # a 1-D result is one row: copied, an in-place op may change it later
            return t.sum(lead, dtype=cs) if lead else t.to(cs, copy=True)
        if key in ("s1", "rn"):
            got = t.sum(-1, dtype=cs) if key == "s1" else _vec_norms(t, -1)
            return got if t.dim() == 2 else got.reshape(-1)
        if t.dtype != _norm_dtype(t):
            t = t.to(_norm_dtype(t))  # cn: x·x beats x.square() and a strided vector_norm on CPU
        return (t * t).sum(lead).sqrt() if lead else t.abs()
    r = t.shape[-2]
    if key == "s0":
        return t.sum(-2, dtype=cs).reshape(-1, c)
    if key == "s1":
        return t.sum(-1, dtype=cs).reshape(-1, r)
    if key == "rn":
        return _vec_norms(t, -1).reshape(-1, r)
    return _vec_norms(t, -2).reshape(-1, c)


@dataclass
class Line:
    """One side (rows or columns) of one check: ``rows`` batch entries of ``width`` checksums,
    stored flat (``rows × width``). Model std of entry ℓ of batch entry b:
    ``(a1·s1[b] + a2·‖v[b]‖)·scale[ℓ] + beta·|act[ℓ]| + extra[ℓ]``, with ``s1`` and ``scale`` (norms)
    at least ``s1_floor`` and ``scale_floor`` (:meth:`Operand.norm_floor`)."""

    act: torch.Tensor  # checksums of the result
    exp: torch.Tensor  # checksums predicted from the operands
    scale: torch.Tensor
    s1: torch.Tensor  # (rows,)
    v: torch.Tensor  # (rows, ·) or 1-D: the checksum vector the GEMV multiplied
    a1: float
    a2: float
    beta: float
    rows: int
    width: int
    s1_floor: float = 0.0
    scale_floor: float = 0.0
    extra: torch.Tensor | None = None
    hard: torch.Tensor | None = None
    """A hard bound of each entry's rounding (not scaled by c): the ratio is (|residual| − hard)⁺
    / model std (:mod:`sdcscope.detect.abft.tiles`)."""

    def detail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual beyond the hard bound, model std), each (rows, width), fp32; the residual keeps its sign."""
        shape = (self.rows, self.width)
        s2 = torch.linalg.vector_norm(self.v.reshape(self.rows, -1).float(), dim=-1)
        coef = self.a1 * self.s1.float().clamp_min(self.s1_floor).reshape(-1, 1) + self.a2 * s2.reshape(-1, 1)
        tau = coef * self.scale.float().clamp_min(self.scale_floor).reshape(
            shape
        ) + self.beta * self.act.abs().float().reshape(shape)
        if self.extra is not None:
            tau = tau + self.extra.reshape(shape)
        res = (self.act - self.exp).float().reshape(shape)
        if self.hard is not None:
            res = res.sign() * (res.abs() - self.hard.float().reshape(shape)).clamp_min(0)
        return res, tau.clamp_min(_TINY)


_LAYOUTS: dict[tuple, tuple] = {}


def line_ratios(lines: list[Line]) -> torch.Tensor:
    """max |residual| / model std of every line (inf where non-finite), one fp32 vector computed
    with a fixed number of fused operations however many lines there are."""
    if not lines:
        return torch.zeros(0, dtype=torch.float32)
    dev = lines[0].act.device
    key = (
        tuple((ln.rows, ln.width, ln.v.numel(), ln.a1, ln.a2, ln.beta, ln.s1_floor, ln.scale_floor) for ln in lines),
        dev,
    )
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        f32 = dict(device=dev, dtype=torch.float32)
        sizes = torch.tensor([ln.rows * ln.width for ln in lines], device=dev)
        layout = _LAYOUTS[key] = (
            torch.tensor([ln.a1 for ln in lines for _ in range(ln.rows)], **f32),
            torch.tensor([ln.a2 for ln in lines for _ in range(ln.rows)], **f32),
            torch.tensor([ln.width for ln in lines for _ in range(ln.rows)], device=dev),
            torch.tensor([ln.beta for ln in lines], **f32).repeat_interleave(sizes),
            torch.arange(len(lines), device=dev).repeat_interleave(sizes),
            int(sizes.sum()),
            torch.tensor([ln.v.numel() // ln.rows for ln in lines for _ in range(ln.rows)], device=dev),
            torch.tensor([ln.s1_floor for ln in lines for _ in range(ln.rows)], **f32),
            torch.tensor([ln.scale_floor for ln in lines], **f32).repeat_interleave(sizes),
        )
    a1, a2, reps, beta, seg, total, vlen, s1_floor, scale_floor = layout
    cat = torch.cat
    v = cat([ln.v for ln in lines]).float()
    s2 = torch.segment_reduce(v * v, "sum", lengths=vlen).sqrt()
    coef = a1 * torch.maximum(cat([ln.s1 for ln in lines]).float(), s1_floor) + a2 * s2
    act = cat([ln.act for ln in lines])  # checksum dtype: act − exp must not round first
    res = (act - cat([ln.exp for ln in lines])).float()
    tau = torch.addcmul(
        beta * act.abs().float(),
        coef.repeat_interleave(reps, output_size=total),
        torch.maximum(cat([ln.scale for ln in lines]).float(), scale_floor),
    )
    if any(ln.extra is not None for ln in lines):
        tau = tau + cat([ln.extra if ln.extra is not None else torch.zeros_like(ln.scale) for ln in lines]).float()
    res = res.abs()
    if any(ln.hard is not None for ln in lines):
        hard = cat([ln.hard if ln.hard is not None else torch.zeros_like(ln.act) for ln in lines]).float()
        res = (res - hard).clamp_min(0).where(torch.isfinite(hard), res)  # inf - inf: still a mismatch
    ratio = torch.nan_to_num(res / tau.clamp_min(_TINY), nan=math.inf)
    # fp32 like ``ratio``, whatever torch's default dtype (a float64 default would refuse the scatter)
    return torch.full((len(lines),), -1.0, device=dev, dtype=torch.float32).scatter_reduce_(0, seg, ratio, "amax")


def gemm_lines(
    a: Operand,
    b: Operand,
    c: torch.Tensor,
    *,
    model: RoundingModel,
    bias: torch.Tensor | None = None,
    which: str = "both",
) -> list[Line]:
    """The row and/or column lines of C = A·B (+ bias). Flat operands: C is (…, m) with every
    leading index a row; batched ones: A (…, n, k), B (…, k, m), C (…, n, m)."""
    with no_autocast(c.device):  # hooks run inside the model's autocast region
        return _gemm_lines(a, b, c, model, bias, which)


def _gemm_lines(a, b, c, model, bias, which) -> list[Line]:
    cs, flat = a.cs, a.flat
    n, k = a.shape
    m = b.shape[1]
    rows = 1 if flat else c.numel() // (n * m)
    cc = None
    if model.narrow:  # output rounding reads the output, clamped to the Cauchy-Schwarz bound ×2
        cap = 2 * a.stat("rn").amax(-1) * b.stat("cn").amax(-1)
        if bias is not None:
            cap = cap + 2 * bias.detach().abs().amax().float()
        lim = cap if flat else cap.reshape(*c.shape[:-2], 1, 1)
        cc = c.float().clamp(-lim, lim)
    lines = []
    for side in SIDES[which]:
        col = side == "col"
        act = _reduce(c, flat, "s0" if col else "s1", cs)
        if col:  # 1ᵀC vs (1ᵀA)·B + n·bias
            v, mat, summed, out = a.stat("s0"), b.stat("xt"), n, m
            add = None if bias is None else (bias, n)
        else:  # C·1 vs A·(B·1) + Σ bias
            v, mat, summed, out = b.stat("s1"), a.stat("x"), m, n
            add = None if bias is None else (bias.sum(dtype=cs).expand(n), 1)
        exp = _matvec(mat, v, add)
        # + half a subnormal spacing per summed result: below the smallest normal the error of a
        # rounded result is absolute, not u_out-relative (fp16 gradients of 1e-6)
        ext = (
            None
            if cc is None
            else model.u_out * _reduce(cc, flat, "cn" if col else "rn", cs) + summed * subnormal_error(c.dtype)
        )
        if cc is not None and col and flat and c.dim() > 2:  # rows repeated within a sequence
            ext = ext + model.u_out * cc.sum(-2).abs().sum(tuple(range(c.dim() - 2)))
        scale_op, scale_key, s1_op = (b, "cn", a) if col else (a, "rn", b)
        scale, s1 = scale_op.stat(scale_key), s1_op.stat("fn")
        kk = k
        if bias is not None and not col:  # (a Linear's: flat)
            scale, s1, v, kk = bias_augmented(bias.detach().to(cs).reshape(1, -1), scale, s1, v.reshape(1, -1), k)
            v = v.reshape(-1)
        lines.append(
            Line(
                act if flat else act.reshape(-1),
                exp if flat else exp.reshape(-1),
                scale if flat else scale.reshape(-1),
                s1,
                v if flat else v.reshape(-1),
                *line_coefs(model, summed, kk),
                rows,
                out,
                s1_op.norm_floor("fn"),
                scale_op.norm_floor(scale_key),
                None if ext is None else ext.reshape(-1),
            )
        )
    return lines


def bias_augmented(
    bias: torch.Tensor, scale: torch.Tensor, s1: torch.Tensor, v: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A row line's terms of C = A·B + bias as the GEMM of A' = [A, 1] and B' = [B; bias]: A's
    row norms with 1, ‖B‖_F with ‖bias‖, v = B·1 with Σ bias, k + 1. CPU kernels start each dot
    product's accumulator at its bias, so it rounds with the other k terms; a row checksum sums
    outputs whose biases may cancel, so |Σ C| (``beta``'s term) does not bound that rounding:
    without this, clean fp32 rows of a Linear(2, 8) reached 80 model stds, a grouped Conv1d's
    forward 10. (A column sums one output over the rows: its bias adds up, |Σ C| covers it.)
    ``bias`` (rows, outputs) and ``v`` (rows, k): one row per row of the line (a conv's groups)."""
    return (
        (scale * scale + 1).sqrt(),
        torch.hypot(s1, torch.linalg.vector_norm(bias, dim=1).reshape(s1.shape)),
        torch.cat([v, bias.sum(1, keepdim=True).to(v)], 1),
        k + 1,
    )


class GemmCheck:
    """The lines of one check: :attr:`ratio` for the hot path, :meth:`locate` for details."""

    def __init__(self, lines: list[Line], sides: tuple[str, ...]) -> None:
        self.lines = dict(zip(sides, lines))
        self._ratio: torch.Tensor | None = None

    @property
    def ratio(self) -> torch.Tensor:
        """0-d: max over batch, rows and columns of |residual| / model std (inf when non-finite)."""
        if self._ratio is None:
            self._ratio = line_ratios(list(self.lines.values())).amax()
        return self._ratio

    @property
    def row(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual, model std), each (B, n), or None when not computed."""
        return self.lines["row"].detail() if "row" in self.lines else None

    @property
    def col(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual, model std), each (B, m), or None when not computed."""
        return self.lines["col"].detail() if "col" in self.lines else None

    def locate(self) -> dict[str, float]:
        """Worst batch entry, its worst row and column (keys :data:`SUMMARY`), read to the host:
        meant for failing checks only. An unjudged check (non-finite expected checksums, i.e.
        operands) reports ratio 0; a side not computed reports NaN."""
        inf = math.inf
        details = {}
        for name in ("row", "col"):
            if name in self.lines:
                res, tau = self.lines[name].detail()
                details[name] = (res, tau, torch.nan_to_num(res.abs() / tau, nan=inf))
        score = torch.stack([d[2].amax(-1) for d in details.values()]).amax(0)
        bi = int(score.argmax())
        judged = all(bool(torch.isfinite(ln.exp).all()) for ln in self.lines.values())
        out = {"judged": float(judged), "ratio": float(score[bi]) if judged else 0.0, "batch": float(bi)}
        for name in ("row", "col"):
            if name not in details:
                out.update(
                    {
                        name: math.nan,
                        f"{name}_ratio": math.nan,
                        f"{name}_residual": math.nan,
                        f"{name}_threshold": math.nan,
                    }
                )
                continue
            res, tau, q = details[name]
            i = int(q[bi].argmax())
            out.update(
                {
                    name: float(i),
                    f"{name}_ratio": float(q[bi, i]),
                    f"{name}_residual": float(res[bi, i]),
                    f"{name}_threshold": float(tau[bi, i]),
                }
            )
        return out


def _vec_norms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """2-norms along ``dim`` in fp32. ``vector_norm`` along a strided (not unit-stride) dim is
    ~15× slower on CPU than squaring and summing, so that case squares explicitly."""
    if x.stride(dim) == 1 or x.shape[dim] == 1:
        return torch.linalg.vector_norm(x, dim=dim, dtype=_norm_dtype(x))
    x = x.to(_norm_dtype(x))
    return (x * x).sum(dim).sqrt()


def frobenius(t: torch.Tensor) -> torch.Tensor:
    """‖t‖_F as a 1-element tensor in fp32 (fp64 for fp64 tensors)."""
    if t.dtype == _norm_dtype(t) and t.is_contiguous():  # a BLAS dot: faster on CPU
        f = t.view(-1)
        return torch.dot(f, f).sqrt().view(1)
    return torch.linalg.vector_norm(t, dtype=_norm_dtype(t)).view(1)


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms in fp32, or fp64 for fp64 tensors (fp32 would narrow them)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _matvec(mat: torch.Tensor, vec: torch.Tensor, add: tuple | None = None) -> torch.Tensor:
    """mat·vec (+ beta·y for ``add = (y, beta)``): (p, q) @ (q,) -> (p,) as one (add)mv;
    (…, p, q) @ (B, q) -> (B, p) with B the flattened batch: as vᵀ·matᵀ in one bmm (which CPU
    runs ~20× faster than mat·v) when the batch dims flatten without a copy, else as a
    broadcast product summed over q (a strided operand, e.g. attention heads: no copy)."""
    if mat.dim() == 2:
        if add is None:
            return torch.mv(mat, vec)
        y, beta = add
        return torch.addmv(y if y.dtype == vec.dtype else y.to(vec.dtype), mat, vec, beta=beta)
    p, q = mat.shape[-2:]
    batch = [(n, st) for n, st in zip(mat.shape[:-2], mat.stride()[:-2]) if n != 1]
    if all(outer[1] == inner[0] * inner[1] for outer, inner in zip(batch, batch[1:])):
        out = torch.bmm(vec.view(-1, 1, q), mat.reshape(-1, p, q).transpose(-2, -1)).view(-1, p)
    else:  # batch dims that would need a copy to flatten
        out = (mat * vec.view(*mat.shape[:-2], 1, q)).sum(-1).reshape(-1, p)
    return out if add is None else out + add[1] * add[0].to(out.dtype)


SIDES = {"both": ("col", "row"), "column": ("col",), "row": ("row",)}


def gemm_check(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    model: RoundingModel,
    checksum_dtype: torch.dtype,
    which: str = "both",
) -> GemmCheck:
    """Check C = A·B (+ bias) on its own. ``a``, ``b`` are the operands exactly as the GEMM
    consumed them (cast them to the compute dtype first); ``c`` the result as produced."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], c.shape[:-2])
    a3 = Operand(a.expand(*lead, *a.shape[-2:]), checksum_dtype)
    b3 = Operand(b.expand(*lead, *b.shape[-2:]), checksum_dtype)
    with torch.no_grad():
        lines = gemm_lines(a3, b3, c.expand(*lead, *c.shape[-2:]), model=model, bias=bias, which=which)
    return GemmCheck(lines, SIDES[which])
