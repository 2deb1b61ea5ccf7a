r"""ABFT that a compiled graph carries: the checks of a Linear's Y, dX and dW as traceable taps.

Module and autograd-node hooks cannot run inside a ``torch.compile`` graph. In graph mode
(``ABFTConfig.graph``) each checked ``nn.Linear`` runs through a
:class:`~sdcscope.common.gemmsite.GemmSite` with three taps, ``autograd.Function``\ s that dynamo
traces (no graph break) and that leave the training arithmetic untouched:

* on Y (the result): its forward checks Y against X and W; its backward, given dY, forms what
  the dX and dW checks expect (Wᵀ·(1ᵀdY), Xᵀ·(dY·1), or their tile blocks);
* on X and on W (the operands): their backward sees this GEMM's dX and dW and completes the checks.

What the Y tap's backward forms for dX reaches the X tap through a *carrier*: a second output of
the X tap, created in its forward with the size the check needs and fed to the Y tap, whose
backward returns the expected checksums as the carrier's gradient -- autograd runs the X tap's
backward only when both dX and that gradient are there. Each finished check leaves the graph as
the gradient of a *probe*: a small fixed-size leaf the tap takes as an input; a hook outside the
graph moves each backward's probe gradients aside (micro-batches are judged apart, as eager
ABFT judges them). The host builds the lines of the eager path from them and judges them in
:meth:`ABFTDetector.check`'s one sync, so events carry the same layer, GEMM and column (fp32:
column checksums, as the eager hot path; bf16/fp16: the worst r×s tile of each block column
against the fp32 accumulator, as :mod:`~sdcscope.detect.abft.tiles`). All of it is tensor ops in
the graph, which inductor fuses with the kernels around them. A layer called several times in one
forward sums its calls' column checks (checksums add exactly, norms to an upper bound) and its
tiles' terms.
"""

from __future__ import annotations

import math

import torch

from sdcscope.common.gemmsite import add_wrapper, remove_wrapper
from sdcscope.detect.abft.records import CheckRecord, Layer
from sdcscope.detect.abft.tiles import tile_bounds, tile_sums, tile_terms
from sdcscope.detect.checksum import GemmCheck, Line
from sdcscope.detect.rounding import line_coefs, norm_floor, rounding_model, subnormal_error

_F32 = torch.float32
_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LEAD = 6  # leading dims of Y recorded for the event's index
_META = 4 + _LEAD  # calls, rows n, dtype code, leading dims, their sizes
_NARROW = (torch.bfloat16, torch.float16)


def _pack_size(width: int) -> int:
    """A check's probe entries: a column line (act, exp, scale, rounding terms: width each; ‖A‖,
    ‖v‖) or a tile summary (5 per block column), whichever is larger."""
    return _META + 4 * width + 2


class Spec:
    """What the taps need, fixed when the graph is traced: checksum dtype, tile size, and the
    rounding models of the narrow dtypes on the layer's device."""

    def __init__(self, cs: torch.dtype, tile: int | None, device: torch.device) -> None:
        self.cs, self.tile = cs, tile
        self.narrow = {dt: rounding_model(dt, device, cs) for dt in _NARROW}

    def tiled(self, t: torch.Tensor) -> bool:
        return self.tile is not None and t.dtype in _NARROW


def _as_stored(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as the GEMM read it from memory. Inductor computes a fused chain of bf16/fp16 ops in
    fp32 without rounding in between, so a check fused with the producer of an operand would
    read it unrounded; a bitcast needs the stored bits, which forces the rounding."""
    if t is None or t.dtype not in _NARROW:
        return t
    return t.view(torch.int16).view(t.dtype)


def _meta(t: torch.Tensor, rows: int, lead: tuple[int, ...], cs) -> torch.Tensor:
    lead = tuple(lead)[-_LEAD:]
    sizes = [*lead, *([0] * (_LEAD - len(lead)))]
    return torch.tensor([1.0, rows, _CODES.index(t.dtype), len(lead), *sizes], dtype=cs, device=t.device)


def _ext(c2: torch.Tensor, c: torch.Tensor, cs) -> torch.Tensor:
    """A narrow result's output-rounding terms per column (× u_out on the host): ‖column‖₂ plus,
    for a (batch, sequence, ·) result, Σ_b |Σ_t column| (see :mod:`sdcscope.detect.rounding`)."""
    ext = torch.linalg.vector_norm(c2, dim=0, dtype=cs)
    if c.dim() > 2:
        ext = ext + c.sum(-2, dtype=cs).abs().reshape(-1, c.shape[-1]).sum(0)
    return ext


def _col_expect(a2, b2, bias, cs, a_norm=None, b_norm=None) -> torch.Tensor:
    """What the column check of C = A·B (+ bias) expects, A (n, k), B (k, m): (1ᵀA)·B + n·bias,
    B's column norms (``b_norm``: their bound ‖B‖_F, one pass fewer), ‖A‖_F (``a_norm``: known),
    ‖1ᵀA‖. A's column sums and squares share one reduction (one pass over A)."""
    ac = a2 if a2.dtype == cs else a2.to(cs)
    s0 = ac.sum(0)
    if a_norm is None:
        a_norm = (ac * ac).sum(0).sum().sqrt().reshape(1)
    bc = b2 if b2.dtype == cs else b2.to(cs)
    exp = s0 @ bc if bias is None else torch.addmv(bias.to(cs), bc.t(), s0, beta=a2.shape[0])
    norms = torch.linalg.vector_norm(bc, dim=0) if b_norm is None else b_norm.expand(bc.shape[1])
    return torch.cat([exp, norms, a_norm, torch.linalg.vector_norm(s0).reshape(1)])


def _col_finish(c2, c, expect, cs, narrow: bool) -> torch.Tensor:
    """The column line of C from what :func:`_col_expect` gave: act, exp, scale, rounding terms, ‖A‖, ‖v‖."""
    m = c2.shape[1]
    ext = _ext(c2, c, cs) if narrow else c2.new_zeros(m, dtype=cs)
    return torch.cat([c2.sum(0, dtype=cs), expect[: 2 * m], ext, expect[2 * m :]])


def _tile_expect(a2, b2, bias, r: int, s: int) -> torch.Tensor:
    """What the tile check of C = A·B (+ bias) expects (:func:`~sdcscope.detect.abft.tiles.tile_terms`),
    flattened: the tile sums (P, Q), A's row-block squared norms (P), B's column-block ones (Q),
    rows per block (P)."""
    an = torch.linalg.vector_norm(a2, dim=1, dtype=_F32)
    bn = torch.linalg.vector_norm(b2, dim=0, dtype=_F32)
    exp, counts, a_sq, b_sq = tile_terms(a2, b2, an, bn, bias, r, s)
    return torch.cat([exp.reshape(-1), a_sq, b_sq, counts])


def _tile_finish(c2, expect, k: int, r: int, s: int, model) -> torch.Tensor:
    """The worst tile of each block column of C (see :mod:`~sdcscope.detect.abft.tiles`): its
    act, exp, hard bound, model std, block row; padded to the column line's size."""
    n, m = c2.shape
    p, q = -(-n // r), -(-m // s)
    exp = expect[: p * q].reshape(p, q)
    a_sq, b_sq, counts = expect[p * q : p * q + p], expect[p * q + p : p * q + p + q], expect[p * q + p + q :]
    act, mag = tile_sums(c2, r, s)
    sigma, hard = tile_bounds(mag, counts, a_sq, b_sq, m, k, r, s, model)
    res = (act - exp).abs()
    res = (res - hard).clamp_min(0).where(torch.isfinite(hard), res)
    ratio = torch.nan_to_num(res / sigma.clamp_min(torch.finfo(_F32).tiny), nan=math.inf)
    at = ratio.argmax(0, keepdim=True)
    parts = [t.gather(0, at).reshape(-1) for t in (act, exp, hard, sigma)]
    out = torch.cat([*parts, at.reshape(-1).to(_F32)])
    return torch.cat([out, out.new_zeros(4 * m + 2 - out.numel())])


def _finish(spec: Spec, c: torch.Tensor, expect: torch.Tensor, k: int, lead) -> torch.Tensor:
    """A probe's contents: the check of result ``c`` (inner dim ``k``) given ``expect``."""
    with torch.autocast(c.device.type, enabled=False):  # recorded in the graph, whatever the state now
        return _finish_body(spec, c, expect, k, lead)


def _finish_body(spec: Spec, c: torch.Tensor, expect: torch.Tensor, k: int, lead) -> torch.Tensor:
    c = _as_stored(c)
    c2 = c.reshape(-1, c.shape[-1])
    body = (
        _tile_finish(c2, expect, k, spec.tile, spec.tile, spec.narrow[c.dtype])
        if spec.tiled(c)
        else _col_finish(c2, c, expect, spec.cs, c.dtype in _NARROW)
    )
    return torch.cat([_meta(c, c2.shape[0], lead, spec.cs), body])


def _expect(spec: Spec, c_dtype: torch.dtype, a2, b2, bias, **norms) -> torch.Tensor:
    """What the check of C = A·B (+ bias) expects (``norms``: known ones, column checks only).
    Autocast is off: a traced graph runs a tap's backward under the forward's autocast, which
    would make these fp32 products bf16."""
    a2, b2, bias = _as_stored(a2), _as_stored(b2), _as_stored(bias)
    with torch.autocast(a2.device.type, enabled=False):
        if spec.tile is not None and c_dtype in _NARROW:
            return _tile_expect(a2, b2, bias, spec.tile, spec.tile)
        return _col_expect(a2, b2, bias, spec.cs, **norms)


class _ResultTap(torch.autograd.Function):
    """Identity on Y (a copy; inductor fuses it into its consumers): Y's check now, what the dX
    and dW checks expect from dY."""

    @staticmethod
    def forward(ctx, y, x, w, bias, probe, cx, cw, spec):
        k = w.shape[1]
        x2 = x.reshape(-1, k)
        expect = _expect(spec, y.dtype, x2, w.t(), bias)
        # ‖X‖_F, kept for the dW check's bound on X's column norms (column checks)
        fx = None if spec.tiled(y) else expect[-2:-1]
        ctx.save_for_backward(x, w, _finish(spec, y, expect, k, y.shape[:-1]), fx)
        ctx.spec, ctx.dtype, ctx.carriers = spec, y.dtype, (cx is not None, cw is not None)
        return y.clone()  # a new tensor: an in-place op on it (ReLU(inplace=True)) stays legal

    @staticmethod
    def backward(ctx, dy):
        x, w, fwd, fx = ctx.saved_tensors
        spec = ctx.spec
        # as the GEMM's backward will read it: autograd casts a gradient to its input's dtype (a
        # traced graph may hand an fp32 dY to a bf16 result)
        dy = dy.to(ctx.dtype)
        dy2 = dy.reshape(-1, dy.shape[-1])
        gx = gw = None
        if ctx.carriers[0]:  # dX = dY·W
            gx = _expect(spec, ctx.dtype, dy2, w, None)
        if ctx.carriers[1]:  # dW = dYᵀ·X; X's column norms bounded by ‖X‖_F, ‖dY‖ from the dX check's
            col = {} if fx is None else {"b_norm": fx, "a_norm": None if gx is None else gx[-2:-1]}
            gw = _expect(spec, ctx.dtype, dy2.t(), x.reshape(-1, x.shape[-1]), None, **col)
        return dy, None, None, None, fwd, gx, gw, None


class _OperandTap(torch.autograd.Function):
    """Identity on an operand (X or W), with a carrier for what its gradient's check expects:
    its backward completes the check of dX (dW) as the GEMM produced it."""

    @staticmethod
    def forward(ctx, t, probe, spec, other: int, lead_of_grad: bool):
        rows, k = t.numel() // t.shape[-1], t.shape[-1]
        ctx.spec, ctx.other, ctx.lead, ctx.dtype = spec, other, lead_of_grad, t.dtype
        if spec.tiled(t):  # C (rows, k) from A (rows, other) · B (other, k)
            r = spec.tile
            p, q = -(-rows // r), -(-k // r)
            size = p * q + p + q + p
        else:
            size = 2 * k + 2
        # zeros made from this layer's own probe: identical constants (another layer's carrier)
        # would be merged by the graph's common-subexpression elimination, summing their gradients
        carrier = (probe[:1] * 0).to(_F32 if spec.tiled(t) else spec.cs).expand(size).contiguous()
        return t.view_as(t), carrier

    @staticmethod
    def backward(ctx, g, expect):
        g = g.to(ctx.dtype)
        lead = g.shape[:-1] if ctx.lead else ()
        return g, _finish(ctx.spec, g, expect, ctx.other, lead), None, None, None


class LinearTaps:
    """The :class:`~sdcscope.common.gemmsite.GemmSite` wrapper of one checked Linear: its three
    probes (Y, dX, dW), and the taps that fill them."""

    def __init__(self, layer: Layer, spec: Spec, gemms: set[str]) -> None:
        self.layer, self.spec, self.gemms = layer, spec, gemms
        w = layer.module.weight
        m, k = w.shape
        new = dict(dtype=spec.cs, device=w.device, requires_grad=True)
        self.probes = (
            torch.zeros(_pack_size(m), **new),
            torch.zeros(_pack_size(k), **new),
            torch.zeros(_pack_size(k), **new),
        )
        # each backward's checks kept apart (a hook outside the graph moves the gradient away):
        # micro-batches accumulating into one probe would judge their sum against summed bounds
        self.got: tuple[list[torch.Tensor], ...] = ([], [], [])
        self.hooks = [p.register_post_accumulate_grad_hook(self._stash(i)) for i, p in enumerate(self.probes)]

    def _stash(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self.got[i].append(p.grad)
            p.grad = None

        return hook

    def around(self, site, ops: list, inner) -> torch.Tensor:
        x, w, b = ops
        if not torch.is_grad_enabled():
            return inner(ops)
        cx = cw = None
        if x.requires_grad and "grad_input" in self.gemms:
            x, cx = _OperandTap.apply(x, self.probes[1], self.spec, w.shape[0], True)
        if w.requires_grad and "grad_weight" in self.gemms:
            w, cw = _OperandTap.apply(w, self.probes[2], self.spec, x.numel() // x.shape[-1], False)
        y = inner([x, w, b])
        if not y.requires_grad:
            return y
        x, w, b = (None if t is None else t.detach() for t in (x, w, b))
        return _ResultTap.apply(y, x, w, b, self.probes[0], cx, cw, self.spec)

    def take(self) -> tuple[list[torch.Tensor], ...]:
        """Each backward's probe gradients since the last call (Y, dX, dW), cleared."""
        got, self.got = self.got, ([], [], [])
        return got

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def graph_linear(layer: Layer) -> bool:
    """Whether graph mode checks ``layer`` through taps: an ``nn.Linear`` called as a module."""
    return layer.kind == "linear" and layer.functional is None and not layer.w_in_out


class GraphChecks:
    """The :class:`ABFTDetector` part that checks Linears through graph taps (uses its
    ``config``, ``layers``, ``_cs``, ``_records``, ``_model``)."""

    def _install_graph(self) -> None:
        gemms = set(self.config.gemms)
        for layer in self.layers:
            if graph_linear(layer) and layer.graph is None:
                spec = Spec(self._cs, self.config.tile, layer.module.weight.device)
                layer.graph = LinearTaps(layer, spec, gemms)
                add_wrapper(layer.module, "linear", layer.graph, order=1)

    def _remove_graph(self) -> None:
        for layer in self.layers:
            if layer.graph is not None:
                remove_wrapper(layer.module, layer.graph)
                layer.graph.remove()
                layer.graph = None

    def _graph_records(self) -> None:
        """Turn each backward's probe gradients into check records; their headers (calls, rows,
        dtype, leading dims) are read to the host in one transfer."""
        taken = []
        for layer in self.layers:
            if layer.graph is None:
                continue
            got = layer.graph.take()
            if not got[0]:  # no backward reached the layer: nothing to judge
                continue
            layer.hits += 1
            for gemm, probes in zip(("forward", "grad_input", "grad_weight"), got):
                if gemm in self.config.gemms:
                    taken += [(layer, gemm, j, p) for j, p in enumerate(probes)]
        if not taken:
            return
        heads = torch.stack([p[:_META] for *_, p in taken]).tolist()
        rows_of = {
            (layer.name, j): int(head[1]) for (layer, gemm, j, _), head in zip(taken, heads) if gemm == "forward"
        }
        for (layer, gemm, j, probe), head in zip(taken, heads):
            self._graph_record(layer, gemm, probe, head, rows_of.get((layer.name, j)))

    def _graph_record(self, layer: Layer, gemm: str, probe: torch.Tensor, head: list, tokens: int | None) -> None:
        calls = max(head[0], 1.0)
        rows, cd = int(head[1]), _CODES[round(head[2] / calls)]
        nlead = round(head[3] / calls)
        lead = tuple(round(d / calls) for d in head[4 : 4 + nlead])
        m, k = layer.module.weight.shape
        width = m if gemm == "forward" else k
        n = tokens if tokens is not None else rows
        # (checksum length summed, inner dim, elements of ‖A‖, of each scale norm), as the eager hot path's
        counts = {
            "forward": (rows, k, rows * k, k),
            "grad_input": (rows, m, rows * m, m),
            "grad_weight": (m, n, n * m, n),
        }[gemm]
        body = probe[_META:]
        model = self._model(cd, probe.device)
        tile = self.config.tile
        if tile is not None and model.narrow:
            q = -(-width // tile)
            act, exp, hard, sigma, at = (body[i * q : (i + 1) * q] for i in range(5))
            one = torch.ones(1, dtype=_F32, device=probe.device)
            line = Line(act, exp, sigma, one, one * 0, 1.0, 0.0, 0.0, 1, q, hard=hard)
            layout, dims = "tile", (tile, tile, q, 1, *lead)
        else:
            act, exp, scale, ext = (body[i * width : (i + 1) * width] for i in range(4))
            s1, v = body[4 * width : 4 * width + 1], body[4 * width + 1 : 4 * width + 2]
            a1, a2, beta = line_coefs(model, counts[0], counts[1])
            extra = model.u_out * ext + counts[0] * subnormal_error(cd) if model.narrow else None
            floors = norm_floor(counts[2], self._cs), norm_floor(counts[3], self._cs)
            line = Line(act, exp, scale, s1, v, a1, a2, beta, 1, width, *floors, extra)
            layout, dims, at = ("rows", lead, None) if gemm != "grad_weight" else ("batched", (), None)
        self._records.append(
            CheckRecord(
                layer.name,
                gemm,
                (None, None),
                counts[1],
                str(cd),
                GemmCheck([line], ("col",)),
                layout=layout,
                dims=dims,
                rows_at=at,
            )  # fmt: skip
        )
