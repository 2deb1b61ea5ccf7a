"""ABFT on tensor-parallel ``nn.Linear`` layers (``parallelize_module``'s ``ColwiseParallel`` /
``RowwiseParallel``, alone or inside FSDP2 on a 2-D mesh): each rank checks the GEMMs it runs, on
its local shards.

Where. ``parallelize_module`` puts a forward pre-hook (the input redistributed: a sequence-parallel
input all-gathered) and a forward hook (the output redistributed: a rowwise layer's partial sums
all-reduced or reduce-scattered) on the layer. ABFT's forward hook runs just *before* that output
hook, and its pre-hook after the input one, so it sees the raw DTensors of ``F.linear``: X as the
GEMM consumed it, the output before any collective (``Shard(-1)`` colwise, ``Partial`` rowwise),
and the autograd nodes of the call, whose gradients (dY, dX, dW) are DTensors too, before the
reductions of the backward. ``.to_local()`` of each is this rank's GEMM:

    Y_l = X_l · W_lᵀ + b_l     dX_l = dY_l · W_l     dW_l = dY_lᵀ · X_l

(b_l: a colwise layer's bias shard; a rowwise layer's replicated bias divided by the TP degree,
as DTensor hands it to the partial sums). No collective is added: each rank judges its own.

Naming. A failing element is named in shard coordinates (the event's ``index``, ``shard_index``)
and in the global tensor (``global_index`` = shard index + the shard's offset, from the result's
placements on the mesh), with the result's ``placement``; a partial result (rowwise Y, colwise dX)
is indexed globally already, and ``operand_slice`` names the part of the contraction this rank
summed (rowwise Y: ``in_features`` [k0, k1) of X and W).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from sdcscope.common.world import is_dtensor
from sdcscope.detect.abft.records import Layer

_ALLOWED = ("colwise", "rowwise", "replicated", "tokens")
"""Per mesh dim, the (X, W, Y) placements whose local GEMM is the rank's whole part: colwise
(R, S(0), S(-1)), rowwise (S(-1), S(1), P), replicated (R, R, R), tokens split (S(d), R, S(d))."""


@dataclass(frozen=True)
class ShardMap:
    """Where one tensor-parallel layer's local GEMM results sit in the global ones."""

    coordinate: tuple[int, ...]
    """This rank's coordinate on the layer's mesh."""
    results: dict
    """gemm -> (offsets of the local block per dim, result placements, the contraction's slice or None)."""

    def evidence(self, gemm: str, index: tuple) -> dict:
        got = self.results.get(gemm)
        if got is None:
            return {}
        offsets, placements, sliced = got
        shard = list(index)
        glob = [None if i is None else i + o for i, o in zip(shard, offsets)] if len(shard) == len(offsets) else None
        out = {
            "shard_index": shard,
            "global_index": glob,
            "placement": list(placements),
            "shard_offset": list(offsets),
            "mesh_coordinate": list(self.coordinate),
        }
        if sliced is not None:
            out["operand_slice"] = sliced
        return out


def _pl(p) -> str:
    return str(p)


def _kind(xp, wp, yp, x_dim: int, y_dim: int) -> str | None:
    """Which of :data:`_ALLOWED` one mesh dim's placements are (None: none of them)."""
    if xp.is_replicate() and wp.is_shard(0) and yp.is_shard(y_dim - 1):
        return "colwise"
    if xp.is_shard(x_dim - 1) and wp.is_shard(1) and yp.is_partial() and getattr(yp, "reduce_op", "sum") == "sum":
        return "rowwise"
    if xp.is_replicate() and wp.is_replicate() and yp.is_replicate():
        return "replicated"
    if xp.is_shard() and wp.is_replicate() and yp.is_shard() and xp.dim == yp.dim < min(x_dim, y_dim) - 1:
        return "tokens"
    return None


def _offsets(shape, mesh, placements) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[1])


def _slice(name: str, dim: int, t) -> dict:
    """The global range [start, stop) of dim ``dim`` of DTensor ``t`` this rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {"dim": name, "start": int(offset[dim]), "stop": int(offset[dim] + shape[dim])}


def shard_map(x, w, y, kinds: list[str]) -> ShardMap:
    """The :class:`ShardMap` of one call (DTensors X, W, Y; ``kinds``: per mesh dim, see :func:`_kind`)."""
    from torch.distributed.tensor import Partial

    mesh = w.device_mesh
    dx_pl = [Partial() if k == "colwise" else p for k, p in zip(kinds, x.placements)]
    dw_pl = [Partial() if k == "tokens" else p for k, p in zip(kinds, w.placements)]
    results = {
        "forward": (
            _offsets(y.shape, mesh, y.placements),
            tuple(map(_pl, y.placements)),
            _slice("in_features", 1, w) if "rowwise" in kinds else None,
        ),
        "grad_input": (
            _offsets(x.shape, mesh, dx_pl),
            tuple(map(_pl, dx_pl)),
            _slice("out_features", 0, w) if "colwise" in kinds else None,
        ),
        "grad_weight": (
            _offsets(w.shape, mesh, dw_pl),
            tuple(map(_pl, dw_pl)),
            _slice("tokens", x.placements[kinds.index("tokens")].dim, x) if "tokens" in kinds else None,
        ),
    }
    return ShardMap(tuple(mesh.get_coordinate() or ()), results)


class TensorParallelChecks:
    """The :class:`ABFTDetector` part that turns a tensor-parallel call into its local GEMM (uses
    its ``_tp_unchecked``)."""

    def _tp_locals(self, layer: Layer, x, module, out) -> tuple | None:
        """``(X_l, W_l, b_l, Y_l)`` of a call whose output ``out`` is a DTensor, and the layer's
        :class:`ShardMap` set; None (warned once) when the local GEMM is not the rank's part."""
        w, bias = module.weight, module.bias
        why = None
        if not is_dtensor(out):
            why = "its output reached ABFT's hook already redistributed (a hook moved after the plan's)"
        elif (
            layer.w_in_out
            or not (is_dtensor(x) and is_dtensor(w))
            or not w.device_mesh == x.device_mesh == out.device_mesh
        ):
            why = "its input or weight is not a DTensor on the output's mesh (a hook ran before the plan's)"
        else:
            kinds = [_kind(*p, x.dim(), out.dim()) for p in zip(x.placements, w.placements, out.placements)]
            if None in kinds:
                why = (
                    f"placements X {list(map(_pl, x.placements))}, W {list(map(_pl, w.placements))}, "
                    f"Y {list(map(_pl, out.placements))} are not a colwise or rowwise split"
                )
        if why is None:
            xl, wl, yl = x.to_local(), w.to_local(), out.to_local()
            if xl.shape[-1] != wl.shape[1] or yl.shape[-1] != wl.shape[0] or xl.shape[:-1] != yl.shape[:-1]:
                why = f"local shapes X {list(xl.shape)}, W {list(wl.shape)}, Y {list(yl.shape)} do not form a GEMM"
        if why is not None:
            if layer.name not in self._tp_unchecked:
                self._tp_unchecked[layer.name] = why
                warnings.warn(f"ABFT cannot check the tensor-parallel layer {layer.name}: {why}", stacklevel=2)
            return None
        bl = None
        if bias is not None:
            bl = bias.to_local() if is_dtensor(bias) else bias
            if is_dtensor(bias):  # a replicated bias enters the partial sums divided by the TP degree
                for dim, (bp, yp) in enumerate(zip(bias.placements, out.placements)):
                    if yp.is_partial() and bp.is_replicate():
                        bl = bl / out.device_mesh.size(dim)
        key = (tuple(x.shape), tuple(w.shape), x.placements, w.placements, out.placements)
        if layer.shard is None or layer.shard[0] != key:
            layer.shard = (key, shard_map(x, w, out, kinds))
        return xl, wl, bl, yl

    def _shard_evidence(self, name: str, gemm: str, index: tuple) -> dict:
        layer = self._by_name.get(name)
        return {} if layer is None or layer.shard is None else layer.shard[1].evidence(gemm, index)

    @property
    def tp_unchecked(self) -> dict[str, str]:
        """Tensor-parallel layers whose calls ABFT could not map to a local GEMM, and why."""
        return dict(self._tp_unchecked)


__all__ = ["ShardMap", "TensorParallelChecks", "shard_map"]
