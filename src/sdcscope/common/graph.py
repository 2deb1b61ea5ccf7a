"""Autograd-graph helpers: where one call of a GEMM module hands on the gradient of its weight or of
an operand, so a hook on that node sees (or replaces) exactly this call's gradient, before it is
summed with other uses and accumulated. Shared by the injector (``gemm.grad_*`` faults) and the
detectors that check those gradients (ABFT, the convolution check)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from sdcscope.common.modules import weight_in_out


def in_backward() -> bool:
    """Whether this runs inside the autograd engine's backward pass. A module forward here is a
    re-run of an earlier forward call (an activation checkpoint's recompute), not a new call:
    the injector's records and ABFT's events number calls (``call``: the 0-based index of the
    module's forward call within the micro-batch) over the forward calls made outside it."""
    return torch._C._current_graph_task_id() != -1


def through_casts(node):
    """``node``, or the node behind the casts on its way (``ToCopyBackward0``: autocast's copy of
    a weight, cached and shared by every use of the weight in the region)."""
    while type(node).__name__ == "ToCopyBackward0" and node.next_functions:
        node = node.next_functions[0][0]
    return node


def weight_grad_edge(output: torch.Tensor, weight: torch.Tensor, max_depth: int = 4):
    """``(node, index)``: the autograd node of the call that produced ``output`` whose
    ``index``-th gradient is this call's dW, on its way to ``weight.grad`` — the GEMM's own
    product, before it is summed with the weight's other uses (a tied embedding, an explicit
    L2 term, another call) and accumulated. ``None`` when ``weight`` is not reached within
    ``max_depth`` nodes (it is not a leaf of this call, e.g. a flattened FSDP parameter).

    Breadth-first from ``output.grad_fn``, so the call's own use of the weight (two or three
    nodes deep: TBackward0 of ``F.linear``, ConvolutionBackward0) is found before any use
    further up the input's graph. A cast on the way (``ToCopyBackward0`` under autocast,
    cached and shared by every use of the weight in the region) is looked through: the node
    before it is the call's own.

    The nodes met are kept referenced (``seen``): a node's Python object lives only while it is
    referenced, so an ``id`` alone could be reused by another node met later, which would then be
    skipped (seen on CUDA under autocast: the weight's edge was missed now and then)."""
    frontier = [output.grad_fn] if output.grad_fn is not None else []
    seen: dict[int, object] = {}
    for _ in range(max_depth):
        nxt = []
        for node in frontier:
            for i, (child, _) in enumerate(node.next_functions):
                if child is None or id(child) in seen:
                    continue
                seen[id(child)] = child
                if getattr(through_casts(child), "variable", None) is weight:
                    return node, i
                if not hasattr(child, "variable"):
                    nxt.append(child)
        frontier = nxt
    return None


_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_CASTS = frozenset({"ToCopyBackward0"})


def _is_grad_of(edge, x: torch.Tensor) -> bool:
    """Whether the autograd edge ``(node, input_nr)`` delivers ``x``'s gradient: to the node that
    produced ``x`` (its output ``x.output_nr``), or to the accumulator of a leaf ``x``."""
    node, nr = edge
    if x.grad_fn is not None:
        return node is x.grad_fn and nr == x.output_nr
    return getattr(node, "variable", None) is x


def _follow(edge, x: torch.Tensor, kinds: frozenset[str]):
    """``(edge, crossed)``: ``edge`` followed through nodes of ``kinds`` until it delivers ``x``'s
    gradient or meets another node; ``crossed``: whether it went through one."""
    crossed = False
    while edge[0] is not None and type(edge[0]).__name__ in kinds and not _is_grad_of(edge, x):
        edge, crossed = edge[0].next_functions[0], True
    return edge, crossed


def linear_nodes(out: torch.Tensor, weight: torch.Tensor, depth: int = 1, x: torch.Tensor | None = None):
    """``(gemm node, index of X's gradient, dW node, index of dW)`` of the ``F.linear`` call that
    produced ``out``: ``addmm``/``mm`` (after the reshapes of an N-d input) whose weight operand is
    ``weight.t()`` (through an autocast copy), or ``weight`` itself (transformers' Conv1D: dW, in
    the weight's (in, out) layout, is then the GEMM node's own gradient output). ``depth`` > 1:
    also behind up to ``depth - 1``
    other nodes (a forward hook that replaced the output). A frozen ``weight`` hands on no
    gradient, so the call is known by its input instead: given ``x``, a node whose X operand
    comes from ``x`` (through reshapes and casts) with no weight edge; its dW node is ``None``.
    ``None`` for any other graph."""
    frontier = [out.grad_fn]
    for _ in range(depth):
        for node in frontier:
            if (got := _linear_node(node, weight, x)) is not None:
                return got
        frontier = [f for node in frontier if node is not None for f, _ in node.next_functions if f is not None]
    return None


def _linear_node(node, weight: torch.Tensor, x: torch.Tensor | None):
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    kind = type(node).__name__
    xi = 1 if kind == "AddmmBackward0" else 0 if kind == "MmBackward0" else None
    if xi is None or len(node.next_functions) != xi + 2:
        return None
    wt = node.next_functions[xi + 1][0]
    if wt is None:
        frozen = x is not None and not weight.requires_grad
        if frozen and _is_grad_of(_follow(node.next_functions[xi], x, _VIEW_NODES | _CASTS)[0], x):
            return node, xi, None, 0
        return None
    if type(wt).__name__ != "TBackward0":  # Y = X·W (W stored (in, out)): dW leaves the GEMM node
        return (node, xi, node, xi + 1) if _is_weight(wt, weight) else None
    if not _is_weight(wt.next_functions[0][0], weight):
        return None
    return node, xi, wt, 0


def _is_weight(node, weight: torch.Tensor) -> bool:
    """Whether ``node`` (through casts) hands its gradient to ``weight``: the weight's
    accumulator, or for a view of a parameter (one expert of a 3-D weight) the view's node."""
    node = through_casts(node)
    return getattr(node, "variable", None) is weight or (weight.grad_fn is not None and node is weight.grad_fn)


class GradEdge(NamedTuple):
    """Where one call of a GEMM hands on the gradient of one of its operands: ``node``'s
    ``index``-th gradient, viewed as ``shape`` (the operand's), in ``dtype``."""

    node: Any
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def operand_grad_edge(
    module: nn.Module, output: Any, args: tuple, position: int, max_depth: int = 32
) -> GradEdge | None:
    """Where this call of the GEMM ``module`` (``args`` and ``output`` as a forward hook sees
    them) hands on the gradient of operand ``position`` (0: X of a Linear or Conv, ``a`` of
    ``a @ b``; 1: ``b``) -- what ``gemm.grad_input`` (``gemm.grad_weight`` of ``a @ b``) corrupts,
    with a post-hook on that node, before anything downstream (an observer's hook on the
    operand, the casts back to its dtype) sees it.

    - an ``nn.Linear``: its ``addmm``/``mm`` node (:func:`linear_nodes`), dX (tokens, in)
      viewed as X, in the GEMM's compute dtype (bf16 under autocast);
    - other GEMMs: the node of the call whose edge delivers the operand's gradient, through the
      casts on the way (so in the compute dtype under autocast): the ``Convolution`` node, the
      pad of a padded convolution, the reshape, expansion (broadcast batch, summed) or product
      node of a matmul. A node sums what reaches it before it runs, so its gradient is exactly
      the operand's, of this call alone, when it is the only one handing it on.

    ``None`` when no gradient flows there: the operand needs none, or autograd did not record
    the call (``torch.no_grad()``, the first pass of a reentrant activation checkpoint; its
    recompute is recorded). Raises :class:`ValueError` when no single node hands it on (or the
    call's graph is more than ``max_depth`` nodes deep: it cannot be told).
    """
    x = args[position] if position < len(args) else None
    if not (
        isinstance(output, torch.Tensor)
        and output.grad_fn is not None
        and isinstance(x, torch.Tensor)
        and x.requires_grad
    ):
        return None
    if isinstance(module, nn.Linear) or weight_in_out(module):
        nodes = linear_nodes(output, module.weight, depth=4, x=x)  # another fault may have replaced Y
        if nodes is None:
            raise ValueError(
                "no addmm/mm node of its weight behind this call's output (a wrapped or flattened weight?)"
            )
        return GradEdge(nodes[0], nodes[1], tuple(x.shape), output.dtype)
    found = _operand_edges(output, args, x, max_depth)
    if found is None:
        raise ValueError(
            f"the autograd graph of this call is more than {max_depth} nodes deep: no single "
            f"node handing on the gradient of its operand {position} can be found"
        )
    if len(found) > 1:
        raise ValueError(
            f"no single node of this call hands on the gradient of its operand {position}: "
            f"{len(found)} do, it is the sum of several uses (e.g. the same tensor as both "
            "operands of a @ b, or a forward that uses its input twice)"
        )
    if not found:  # the call does not use the operand
        return None
    node, index, cast = found[0]
    return GradEdge(node, index, tuple(x.shape), output.dtype if cast else x.dtype)


def _operand_edges(output: torch.Tensor, args: tuple, x: torch.Tensor, max_depth: int) -> list | None:
    """``(node, index, cast)`` of every edge of the call that produced ``output`` delivering
    ``x``'s gradient (``cast``: through a cast); ``None`` when the call's graph is not exhausted
    within ``max_depth`` nodes. Breadth-first from ``output.grad_fn``; the nodes of the call's
    operands bound the search (what lies behind them is not this call's)."""
    bound_nodes = [a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
    bounds = {id(n) for n in bound_nodes}  # the nodes stay referenced: ids stay theirs (weight_grad_edge)
    found, seen, frontier = [], {}, [output.grad_fn]
    for _ in range(max_depth):
        if not frontier:
            return found
        nxt = []
        for node in frontier:
            for index, edge in enumerate(node.next_functions):
                edge, cast = _follow(edge, x, _CASTS)
                if _is_grad_of(edge, x):
                    found.append((node, index, cast))
                elif edge[0] is not None and id(edge[0]) not in bounds and id(edge[0]) not in seen:
                    seen[id(edge[0])] = edge[0]
                    nxt.append(edge[0])
        frontier = nxt
    return None if frontier else found
