"""What the ABFT detector keeps: a checked layer, one call of it waiting for its gradients, and a
recorded check waiting for the step's judgement (:meth:`ABFTDetector.check`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sdcscope.detect.checksum import GemmCheck, Operand


@dataclass(slots=True)
class CallContext:
    """One call of one sampled module, waiting for its gradients."""

    call: tuple[int, int | None]  # (micro-batch, call index): see the package docstring
    x: torch.Tensor | None = None  # Linear: the input as the caller passed it
    a: Operand | None = None  # X (Linear) / a (MatMul), in the compute dtype
    b: Operand | None = None  # W (Linear) / b (MatMul), in the compute dtype
    a_shape: tuple[int, ...] = ()  # Linear: X's shape
    full: tuple[tuple[int, ...], ...] = ()  # MatMul: broadcast operand shapes
    dy: torch.Tensor | None = None
    need: set[str] = field(default_factory=set)
    higher_order: bool = False  # a backward with create_graph ran through this call
    dy_norm: torch.Tensor | None = None  # hot path: ‖dY‖_F, read at the GEMM node for the dW check
    conv: tuple | None = None  # a self-padding conv's dX check, waiting for the module's dX
    _dy_op: Operand | None = None

    def dy_operand(self, cs: torch.dtype) -> Operand:
        """dY (…tokens…, out) in the GEMM's dtype, shared by the dX and dW checks."""
        if self._dy_op is None:
            dy, cd = self.dy, self.b.t.dtype
            self._dy_op = Operand(dy if dy.dtype == cd else dy.to(cd), cs, flat=True, bound=True)
        return self._dy_op

    def done(self, what: str) -> None:
        self.need.discard(what)
        if not self.need:
            self.release()

    def release(self) -> None:
        self.need.clear()
        self.a = self.b = self.dy = self._dy_op = self.x = self.dy_norm = self.conv = None


@dataclass
class Layer:
    """A module (or a weight a module applies itself) whose GEMMs are checked."""

    name: str
    module: nn.Module
    kind: str  # 'linear' | 'matmul' | 'conv' | 'fp8' (an Fp8Linear: detect/abft/fp8.py)
    names: tuple[str, ...]  # forward's parameter names of the operands (keywords)
    calls: int = 0  # forward calls (outside backward) in this micro-batch
    hits: int = 0  # forward calls the hook saw since the last check (any mode)
    fwd: object = None  # handle of the forward hook (an FP8 layer: of its GEMM-site wrapper)
    pre: object = None  # handle of the forward pre-hook (slow path only)
    open_ctx: CallContext | None = None  # created by the pre-hook, completed by the forward hook
    fast: bool | None = None  # Linear: its call's GEMM node is reachable (None: not seen yet)
    probe: object = None  # handle of the weight hook (until the forward hook fires once)
    grad_seen: bool = False  # the weight got a gradient since the last check
    w_in_out: bool = False  # weight stored (in, out): transformers' Conv1D, Y = X·W + b
    functional: object = None  # F.linear on a weight a module applies itself: its hook
    graph: object = None  # graph mode: its GemmSite taps (:class:`~sdcscope.detect.abft.graph.LinearTaps`)
    shard: tuple | None = None  # tensor parallel: (layout key, ShardMap) of its last call (tensorparallel.py)


LAYOUTS = ("rows", "batched", "position", "weight", "tile")


@dataclass(slots=True)
class CheckRecord:
    """One GEMM check recorded during a step, judged by :meth:`ABFTDetector.check`.

    ``layout`` says how a failing row / column of the checksum lines is named in the event's
    ``index``, with ``dims``:

    * ``'rows'``: a Linear's result flattened to (tokens, n); ``dims`` = its leading dims:
      ``(*token, col)``;
    * ``'batched'``: a (batched) product; ``dims`` = its batch dims: ``(*batch, row, col)``;
    * ``'position'``: a convolution's Y or dX, one row per position; ``dims`` = (N, *spatial):
      ``(n, None, *p)`` -- the checksum sums the group's channels;
    * ``'tile'``: a bf16/fp16 result checked by tiles (:mod:`~sdcscope.detect.abft.tiles`): one
      column per tile; ``dims`` = (r, s, tile columns, flat, *lead): the tile's first element,
      ``(*token, row, col)`` of a flattened result (flat = 1), else ``(*batch, row, col)``;
    * ``'weight'``: a convolution's dW, one column per weight column; ``dims`` = (C_g, *taps):
      ``(None, i, *t)``.
    """

    layer: str
    gemm: str
    call: tuple[int, int | None]  # (micro-batch, call index)
    inner_dim: int
    dtype: str
    check: GemmCheck
    layout: str = "batched"
    dims: tuple[int, ...] = ()
    operand: str | None = None  # a MatMul's backward: 'a' (dA) or 'b' (dB)
    rows_at: torch.Tensor | None = None
    """A tile check judged in a graph (:mod:`~sdcscope.detect.abft.graph`): one entry per block
    column, the worst tile's; this holds each one's block row (read only for a failing check)."""

    def index(self, batch: int, row: int | None, col: int | None) -> tuple:
        """The event's index of the failing ``row`` / ``col`` (None: that side did not fail) of
        batch entry ``batch``."""
        dims = self.dims
        if self.layout == "tile":
            r, s, q, flat, *lead = dims
            if col is None:
                return (None, None)
            if self.rows_at is not None:  # the worst tile of block column ``col``
                col = int(self.rows_at[col]) * q + col
            p, j = divmod(col, q)
            if flat:
                return (*(unravel(p * r, tuple(lead)) if lead else (p * r,)), j * s)
            return (*(unravel(batch, tuple(lead)) if lead else ()), p * r, j * s)
        if self.layout == "position":
            return (row, None) if row is None else (lambda n, *p: (n, None, *p))(*unravel(row, dims))
        if self.layout == "weight":
            return (None, None) if col is None else (None, *unravel(col, dims))
        if self.layout == "rows":  # rows of a flattened (…, n) result (none: a 1-D one)
            lead = unravel(row, dims) if row is not None else (None,) * len(dims)
            return (*lead, col)
        return (*(unravel(batch, dims) if dims else ()), row, col)


def unravel(flat: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(flat % d)
        flat //= d
    return tuple(reversed(out))
