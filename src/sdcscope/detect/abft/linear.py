"""ABFT's checks of the GEMMs of ``nn.Linear`` (and transformers' ``Conv1D``) and MatMul-contract
modules: Y, dX and dW (dA, dB) as column (and row) checksum lines of :mod:`sdcscope.detect.checksum`,
with a hot path that builds a Linear's column lines directly when everything is in the checksum dtype."""

from __future__ import annotations

import torch
from torch import nn

from sdcscope.common.graph import linear_nodes, weight_grad_edge
from sdcscope.common.tensors import autocast_on, no_autocast
from sdcscope.common.world import is_dtensor, local
from sdcscope.detect.abft.records import CallContext, CheckRecord, Layer
from sdcscope.detect.abft.tiles import tile_line
from sdcscope.detect.checksum import SIDES, GemmCheck, Line, Operand, frobenius, gemm_lines
from sdcscope.detect.rounding import line_coefs, norm_floor


class LinearChecks:
    """The :class:`ABFTDetector` part that checks Linear and MatMul GEMMs (uses its ``config``,
    ``_cs``, ``_records``, ``_operands``, ``_models``, ``_consts``, ``_model``, ``_shielded`` and
    ``skipped_higher_order``)."""

    def _operand(self, t: torch.Tensor, cd: torch.dtype, *, bound: bool = True) -> Operand:
        """The step's :class:`Operand` of ``t`` as the GEMM consumed it (cast to ``cd``): a tensor
        several GEMMs read (q/k/v's input; X in forward and dW) gets its statistics once."""
        key = (id(t), cd)
        got = self._operands.get(key)
        if got is None:  # alive while a pending check holds it; it holds t, so the id stays unique
            got = self._operands[key] = Operand(
                t if t.dtype == cd else t.to(cd), self._cs, flat=True, bound=bound, src=t
            )
        return got

    def _weight(self, layer: Layer, cd: torch.dtype) -> Operand:
        """The weight as ``nn.Linear`` holds it, (out, in)."""
        w = layer.module.weight
        return self._operand(w.t() if layer.w_in_out else w, cd, bound=False)

    def _record(
        self,
        layer: Layer,
        gemm: str,
        call: tuple,
        a: Operand,
        b: Operand,
        c: torch.Tensor,
        *,
        rows: tuple | None = None,
        batch: tuple = (),
        bias=None,
        operand: str | None = None,
    ) -> None:
        """Record the check of C = A·B (+ bias); ``rows``: the leading dims of a flattened (…, n)
        result, else ``batch``: the batch dims of a batched one (see :class:`CheckRecord`)."""
        cd = a.t.dtype
        which = self.config.checksums
        model = self._model(cd, c.device)
        tile = self.config.tile
        if tile is not None and model.narrow and c.dim() >= 2:  # bf16/fp16: against the fp32 accumulator
            line, q = tile_line(a, b, c, model=model, tile=tile, bias=bias)
            flat = rows is not None or a.flat
            lead = (rows or ()) if flat else batch
            self._records.append(
                CheckRecord(
                    layer.name,
                    gemm,
                    call,
                    a.shape[1],
                    str(cd),
                    GemmCheck([line], ("col",)),
                    layout="tile",
                    dims=(tile, tile, q, int(flat), *lead),
                    operand=operand,
                )
            )
            return
        lines = gemm_lines(a, b, c, model=model, bias=bias, which=which)
        self._records.append(
            CheckRecord(
                layer.name,
                gemm,
                call,
                a.shape[1],
                str(cd),
                GemmCheck(lines, SIDES[which]),
                layout="batched" if rows is None else "rows",
                dims=batch if rows is None else rows,
                operand=operand,
            )
        )

    def _linear_forward(
        self,
        layer: Layer,
        ctx: CallContext,
        module: nn.Module,
        x: torch.Tensor,
        out: torch.Tensor,
        gemms: set[str],
        fast: bool,
    ) -> None:
        """Check Y = X·Wᵀ + b; hook the call's autograd nodes for dX (at the GEMM node on the fast
        path) and dW (at the node handing it to the weight)."""
        cd = out.dtype
        x = ctx.x if ctx.x is not None else x  # before ABFT's own view
        y, bias = out, module.bias
        if is_dtensor(out) or is_dtensor(module.weight):  # tensor parallel: the rank's local GEMM
            got = self._tp_locals(layer, x, module, out)
            if got is None:
                ctx.release()
                return
            x, w, bias, y = got
            b = self._operand(w, cd, bound=False)
        else:
            b = self._weight(layer, cd)
        a = self._operand(x, cd)
        lean = self._lean_ok(x, y, module)
        if "forward" in gemms:
            if lean:
                self._lean_forward(layer, ctx.call, a, b, y, bias)
            else:
                if bias is not None and bias.dtype != cd:
                    bias = bias.to(cd)
                self._record(layer, "forward", ctx.call, a, b.T, y, rows=tuple(y.shape[:-1]), bias=bias)
        ctx.a, ctx.b, ctx.a_shape = a, b, tuple(x.shape)
        want_dw = module.weight.requires_grad and "grad_weight" in gemms
        nodes = None
        if out.requires_grad and (want_dw or "grad_input" in gemms) and (fast or layer.fast is None):
            nodes = linear_nodes(out, module.weight)
            layer.fast = nodes is not None  # learnt here; the next step's hooks follow
        lean = lean and fast and nodes is not None  # dY's statistics come from the node
        if fast:
            if nodes is not None:  # one hook at the GEMM's node: dY and dX
                if "grad_input" in gemms and x.requires_grad:
                    ctx.need.add("op0")
                ctx.need.add("dy")
                nodes[0].register_hook(self._gemm_node_hook(layer, ctx, nodes[1], lean))
            # else: an unexpected graph (dX unchecked for this call; the pre-hook returns)
        edge = None
        if want_dw and out.requires_grad:
            edge = nodes[2:] if nodes is not None else weight_grad_edge(out, module.weight)
        if edge is not None:
            ctx.need.add("dw")
            edge[0].register_hook(self._dw_hook(layer, ctx, edge[1], lean))

    def _matmul_forward(
        self, layer: Layer, ctx: CallContext, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, gemms: set[str]
    ) -> bool:
        """Check C = a·b (batched, broadcast); False (the call released) when an operand is 1-D."""
        if a.dim() < 2 or b.dim() < 2:
            ctx.release()
            return False
        cd = out.dtype
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a_e = Operand(_expand(a.to(cd), batch), self._cs)
        b_e = Operand(_expand(b.to(cd), batch), self._cs)
        if "forward" in gemms:
            self._record(layer, "forward", ctx.call, a_e, b_e, out, batch=tuple(batch))
        ctx.a, ctx.b = a_e, b_e
        ctx.full = ((*batch, *a.shape[-2:]), (*batch, *b.shape[-2:]))
        return True

    # -- hot path: a Linear's column checks built directly (what gemm_lines builds for them) -------
    def _lean_ok(self, x: torch.Tensor, out: torch.Tensor, module: nn.Module) -> bool:
        """Column checksums of a GEMM whose operands, output and checksums share one fp32/fp64
        dtype (no cast, no output-rounding pass), outside autocast: the common CPU case, checked
        with the least Python per check (the same lines as :func:`gemm_lines`)."""
        cs, bias = self._cs, module.bias
        return (
            self.config.checksums == "column"
            and out.dtype == cs
            and x.dtype == cs
            and module.weight.dtype == cs
            and (bias is None or bias.dtype == cs)
            and out.dim() >= 2
            and not autocast_on(out.device)
        )

    def _lean_line(
        self,
        layer: Layer,
        gemm: str,
        call: tuple,
        rows: tuple | None,
        k: int,
        act,
        exp,
        v,
        scale,
        s1,
        counts: tuple[int, int, int, int],
        device,
    ) -> None:
        """Record the column line of a hot-path check; ``counts`` = (checksum length summed, inner
        dim, elements of the s1 norm, elements of each scale norm) fix its constants."""
        model = self._model(self._cs, device)
        key = (model, counts)
        consts = self._consts.get(key)
        if consts is None:
            if len(self._consts) > 4096:
                self._consts.clear()
            consts = self._consts[key] = (
                *line_coefs(model, counts[0], counts[1]),
                norm_floor(counts[2], self._cs),
                norm_floor(counts[3], self._cs),
            )
        a1, a2, beta, s1_floor, scale_floor = consts
        line = Line(act, exp, scale, s1, v, a1, a2, beta, 1, act.shape[0], s1_floor, scale_floor)
        self._records.append(
            CheckRecord(
                layer.name,
                gemm,
                call,
                k,
                self._cs_name,
                GemmCheck([line], ("col",)),
                layout="batched" if rows is None else "rows",
                dims=rows or (),
            )
        )

    def _lean_forward(
        self, layer: Layer, call: tuple, a: Operand, w: Operand, out: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """Y = X·Wᵀ + b: 1ᵀY vs W·(1ᵀX) + n·b."""
        n, k = a.shape
        s0 = a.stat("s0")
        exp = torch.mv(w.t, s0) if bias is None else torch.addmv(bias, w.t, s0, beta=n)
        act = out.sum(tuple(range(out.dim() - 1)))
        self._lean_line(
            layer,
            "forward",
            call,
            tuple(out.shape[:-1]),
            k,
            act,
            exp,
            s0,
            w.stat("rn"),
            a.stat("fn"),
            (n, k, n * k, k),
            out.device,
        )

    def _lean_backward(self, layer: Layer, ctx: CallContext, db, dx) -> None:
        """Hot path at the GEMM node: dY's statistics (1ᵀdY: autograd's bias gradient when there
        is one) for the dX and dW checks; dX = dY·W: 1ᵀdX vs Wᵀ·(1ᵀdY)."""
        dy = ctx.dy
        if dy is not None and ctx.b is not None and not ctx.higher_order:
            with torch.no_grad(), no_autocast(dy.device):
                s0 = db if db is not None and db.dtype == dy.dtype else dy.sum(0)
                fn = ctx.dy_norm = frobenius(dy)
                if "op0" in ctx.need and dx is not None:
                    n, m = dy.shape
                    w = ctx.b
                    self._lean_line(
                        layer,
                        "grad_input",
                        ctx.call,
                        ctx.a_shape[:-1],
                        m,
                        dx.sum(0),
                        torch.mv(w.t.t(), s0),
                        s0,
                        w.stat("cn"),
                        fn,
                        (n, m, n * m, m),
                        dx.device,
                    )
        ctx.done("op0")
        ctx.done("dy")

    # -- backward ------------------------------------------------------------------------------
    def _dy_hook(self, ctx: CallContext):
        def hook(grad):
            self._set_dy(ctx, grad)

        return self._shielded(hook)

    def _set_dy(self, ctx: CallContext, dy: torch.Tensor | None) -> None:
        ctx.dy = local(dy)  # tensor parallel: this rank's dY shard
        self._backward_ran = True
        if torch.is_grad_enabled() and not ctx.higher_order:
            # A backward with create_graph=True (a gradient penalty, a Hessian-vector product):
            # this call's gradient graph feeds another backward, whose contributions reach the
            # same autograd nodes (dW sums dYᵀX with the penalty's term): no product of this
            # call can be checked alone.
            ctx.higher_order = True
            self.skipped_higher_order += 1

    def _gemm_node_hook(self, layer: Layer, ctx: CallContext, xi: int, lean: bool = False):
        """Fast path of a Linear: post-hook of the call's GEMM node, which sees dY (its gradient
        output) and dX (its ``xi``-th gradient input, flattened to (tokens, in)) together."""

        def hook(grad_inputs, grad_outputs):
            self._set_dy(ctx, grad_outputs[0])
            db = local(grad_inputs[0]) if xi == 1 else None
            dx = local(grad_inputs[xi])  # tensor parallel: the local dX, before the TP reduction
            if lean:
                self._lean_backward(layer, ctx, db, dx)
                return None
            if db is not None and ctx.dy is not None and ctx.b is not None and db.dtype == self._cs:
                ctx.dy_operand(self._cs).seed("s0", db)  # autograd's bias gradient: dY's column sums
            if "op0" in ctx.need:
                if dx is not None and ctx.dy is not None and ctx.a is not None and not ctx.higher_order:
                    with torch.no_grad():
                        self._record(
                            layer, "grad_input", ctx.call, ctx.dy_operand(self._cs), ctx.b, dx, rows=ctx.a_shape[:-1]
                        )
                ctx.done("op0")
            ctx.done("dy")
            return None

        return self._shielded(hook)

    def _operand_grad(self, layer: Layer, ctx: CallContext, pos: int, grad: torch.Tensor) -> None:
        """The gradient of operand ``pos`` as the module's input view received it: a Linear's dX
        (slow path), a MatMul's dA (``pos`` 0) or dB (``pos`` 1)."""
        if ctx.dy is None or ctx.a is None or ctx.higher_order:
            ctx.done(f"op{pos}")
            return
        with torch.no_grad():
            dy = ctx.dy
            if layer.kind == "linear":  # dX = dY · W
                self._record(
                    layer, "grad_input", ctx.call, ctx.dy_operand(self._cs), ctx.b, grad, rows=ctx.a_shape[:-1]
                )
            else:
                full = ctx.full[pos]
                if tuple(grad.shape) == full:  # operand was not broadcast
                    batch = full[:-2]
                    dc = Operand(dy.to(ctx.a.t.dtype), self._cs)
                    if pos == 0:  # dA = dC · bᵀ
                        self._record(layer, "grad_input", ctx.call, dc, ctx.b.T, grad, batch=batch, operand="a")
                    else:  # dB = aᵀ · dC
                        self._record(layer, "grad_weight", ctx.call, ctx.a.T, dc, grad, batch=batch, operand="b")
        ctx.done(f"op{pos}")

    def _dw_hook(self, layer: Layer, ctx: CallContext, index: int, lean: bool = False):
        """Post-hook of the call's node handing dW to the weight: dW = dYᵀ · X of this call."""

        def hook(grad_inputs, grad_outputs):
            g = local(grad_inputs[index])
            if g is not None and layer.w_in_out:
                g = g.t()  # dW as nn.Linear's, (out, in)
            if g is not None and ctx.dy is not None and ctx.a is not None and not ctx.higher_order:
                with torch.no_grad(), no_autocast(g.device):
                    if lean:  # hot path: 1ᵀdW vs (dY·1)ᵀ·X (X's column norms bounded by ‖X‖_F)
                        dy, fn, a = ctx.dy, ctx.dy_norm, ctx.a  # dy_norm: set with ctx.dy at the node
                        n, m = dy.shape
                        r = dy.sum(1)
                        self._lean_line(
                            layer,
                            "grad_weight",
                            ctx.call,
                            None,
                            n,
                            g.sum(0),
                            torch.mv(a.stat("xt"), r),
                            r,
                            a.stat("cn"),
                            fn,
                            (m, n, n * m, n * g.shape[1]),
                            g.device,
                        )
                    else:
                        self._record(layer, "grad_weight", ctx.call, ctx.dy_operand(self._cs).T, ctx.a, g)
            ctx.done("dw")
            return None

        return self._shielded(hook)


def _expand(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    return t if tuple(t.shape[:-2]) == tuple(batch) else t.expand(*batch, *t.shape[-2:])
