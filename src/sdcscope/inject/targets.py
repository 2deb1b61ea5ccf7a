"""Resolve and validate a spec's targets on a live model, before any training starts.

Module sites (``activation``, ``gemm.*``) match qualified module names. Parameter sites
(``weight``, ``param_grad``, ``optimizer_state``, ``checkpoint``) match parameter names
(``blocks.0.mlp.fc.weight``) or, for a module name (``blocks.0.mlp.fc``), that module's own
``weight``. Mistakes name the pattern and list close names.

:func:`validate_specs` refuses, before any work, every spec that cannot be applied: targets,
ranks, a schedule that never fires in the run, optimizer state the optimizer never creates, and
a pattern, bits or format that do not fit a tensor the fault lands on
(:func:`sdcscope.faults.check_spec`). Parameters and the weight operand of a GEMM have known
shapes and dtypes; the output or input gradient of a module is known only once the module ran:
:func:`probe_model` records them from one forward pass on a throwaway copy of the model (and from
an evaluation pass, whose batches may be shaped otherwise, for the faults that act there).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

import torch
from torch import nn

from sdcscope.faults import FaultSpec, FaultSpecError, check_spec
from sdcscope.faults.spec import RANDOM
from sdcscope.faults.patterns import ChannelDim

MODULE_SITES = ("activation", "gemm.forward", "gemm.grad_input", "gemm.grad_weight")
PARAM_SITES = ("weight", "param_grad", "optimizer_state", "checkpoint")
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CHANNELS_FIRST = CONV_TYPES + TRANSPOSED_TYPES
"""GEMM modules whose outputs and input gradients hold their channels in dim 1."""
GEMM_TYPES = (nn.Linear, *CHANNELS_FIRST)
FROM_STEP_1 = {"optimizer_state": "optimizer state exists only after the first update",
               "checkpoint": "a checkpoint fault corrupts the checkpoint written after a step"}
"""Sites visited from step 1 on, and why (a checkpoint is also written after the run's last step)."""
UNREACHED = {
    "activation": "was never called (or returned no tensor)",
    "gemm.forward": "was never called",
    "gemm.grad_input": "computed no input gradient dX (its input needs none: a first layer?)",
    "gemm.grad_weight": "computed no weight gradient dW",
}


def weight_in_out(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (the GPT-2 family's projections): a Linear computing
    ``Y = X·W + b`` with W stored (in, out), the transpose of ``nn.Linear``'s -- known by its
    class name and ``nf`` (its output width), so transformers need not be imported."""
    w = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and getattr(module, "nf", None) == w.shape[1])


def has_weight_operand(module: nn.Module) -> bool:
    """A GEMM module whose second operand is its ``weight`` (Linear, Conv, ConvTranspose, Conv1D)."""
    return isinstance(module, GEMM_TYPES) or weight_in_out(module)


def is_gemm(module: nn.Module) -> bool:
    """A module whose forward is one GEMM: Linear, Conv, ConvTranspose, transformers' Conv1D, or
    the ``is_matmul`` contract (a @ b)."""
    return has_weight_operand(module) or getattr(module, "is_matmul", False)


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
    the weight's (in, out) layout, is then the GEMM node's own gradient output). ``depth`` > 1: also behind up to ``depth - 1``
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
    if type(wt).__name__ != "TBackward0":   # Y = X·W (W stored (in, out)): dW leaves the GEMM node
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


def operand_grad_edge(module: nn.Module, output: Any, args: tuple, position: int,
                      max_depth: int = 32) -> GradEdge | None:
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
    if not (isinstance(output, torch.Tensor) and output.grad_fn is not None
            and isinstance(x, torch.Tensor) and x.requires_grad):
        return None
    if isinstance(module, nn.Linear) or weight_in_out(module):
        nodes = linear_nodes(output, module.weight, depth=4, x=x)   # another fault may have replaced Y
        if nodes is None:
            raise ValueError("no addmm/mm node of its weight behind this call's output (a wrapped or "
                             "flattened weight?)")
        return GradEdge(nodes[0], nodes[1], tuple(x.shape), output.dtype)
    found = _operand_edges(output, args, x, max_depth)
    if found is None:
        raise ValueError(f"the autograd graph of this call is more than {max_depth} nodes deep: no single "
                         f"node handing on the gradient of its operand {position} can be found")
    if len(found) > 1:
        raise ValueError(f"no single node of this call hands on the gradient of its operand {position}: "
                         f"{len(found)} do, it is the sum of several uses (e.g. the same tensor as both "
                         "operands of a @ b, or a forward that uses its input twice)")
    if not found:   # the call does not use the operand
        return None
    node, index, cast = found[0]
    return GradEdge(node, index, tuple(x.shape), output.dtype if cast else x.dtype)


def _operand_edges(output: torch.Tensor, args: tuple, x: torch.Tensor, max_depth: int) -> list | None:
    """``(node, index, cast)`` of every edge of the call that produced ``output`` delivering
    ``x``'s gradient (``cast``: through a cast); ``None`` when the call's graph is not exhausted
    within ``max_depth`` nodes. Breadth-first from ``output.grad_fn``; the nodes of the call's
    operands bound the search (what lies behind them is not this call's)."""
    bound_nodes = [a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
    bounds = {id(n) for n in bound_nodes}   # the nodes stay referenced: ids stay theirs (weight_grad_edge)
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


def operand_channel_dims(module: nn.Module, position: int) -> ChannelDim:
    """``(output-channel dim, input-channel dim)`` of a GEMM operand's gradient, for a
    ``mac_cell`` pattern: dX [..., in] of a Linear and ``a`` [..., M, K] of ``a @ b`` (None, -1);
    dX [N, C_in, ...] of a Conv (None, 1); ``b`` [..., K (in), N (out)] of ``a @ b`` (-1, -2)."""
    if position == 1:
        return (-1, -2)
    return (None, 1) if isinstance(module, CHANNELS_FIRST) else (None, -1)


@dataclass(frozen=True)
class Target:
    """A resolved target. ``key`` is the name the spec's pattern matched (what ``fires`` and the
    fault generator are keyed on); ``name`` is the tensor's full name, as recorded."""

    name: str
    key: str
    module: nn.Module | None = None
    param: nn.Parameter | None = None


def _check_patterns(spec: FaultSpec, candidates: list[str], what: str) -> None:
    """Refuse a spec with a target pattern that matches none of ``candidates`` (a typo in a list
    would otherwise be ignored), naming it and close names."""
    dead = [p for p in spec.target if not any(fnmatchcase(n, p) for n in candidates)]
    if not dead:
        return
    close: list[str] = []
    for pattern in dead:
        close += difflib.get_close_matches(pattern, candidates, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(dict.fromkeys(close))}" if close else ""
    sample = ", ".join(candidates[:8]) + (" …" if len(candidates) > 8 else "")
    which = (f"target {list(spec.target)!r} matches" if len(dead) == len(spec.target) else
             f"target pattern {', '.join(map(repr, dead))} (of {list(spec.target)!r}) matches")
    raise ValueError(f"{which} no {what} for site {spec.site!r}{hint} (names look like: {sample})")


def _matches(spec: FaultSpec, name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in spec.target)


def resolve_targets(model: nn.Module, spec: FaultSpec) -> list[Target]:
    """The modules or parameters ``spec`` hits in ``model``; raises when a target pattern hits none."""
    if spec.site == "comm":
        raise ValueError("site 'comm' corrupts a DDP gradient bucket: attach it to a "
                         "DistributedDataParallel model with sdcscope.inject.comm")
    if spec.site in MODULE_SITES:
        gemm_only = spec.site.startswith("gemm.")
        candidates = [(n, m) for n, m in model.named_modules() if n and (not gemm_only or is_gemm(m))]
        if gemm_only:   # a module that is there but no GEMM: say so, rather than offer close names
            other = [(n, m) for n, m in model.named_modules() if n and not is_gemm(m) and _matches(spec, n)
                     and not any(_matches(spec, c) for c, _ in candidates)]
            if other:
                n, m = other[0]
                raise ValueError(
                    f"target {n!r} ({type(m).__name__}) is not a GEMM module (nn.Linear, ConvNd, "
                    f"ConvTransposeNd, transformers' Conv1D, a MatMul-contract module): the products "
                    f"its own forward computes (F.linear on its weights: an MoE's experts, a router) "
                    f"cannot take {spec.site!r}; use site 'activation' (its output), 'weight' or "
                    f"'param_grad' (its parameters), or target its GEMM submodules")
        _check_patterns(spec, [n for n, _ in candidates], "GEMM module" if gemm_only else "module")
        return [Target(n, n, module=m) for n, m in candidates if _matches(spec, n)]
    params = dict(model.named_parameters(remove_duplicate=False))   # a tied weight by each of its names
    weighted = [(n, m) for n, m in model.named_modules() if n and isinstance(getattr(m, "weight", None), nn.Parameter)]
    _check_patterns(spec, list(params) + [n for n, _ in weighted], "parameter")
    found, seen = [], set()
    for name, p in params.items():
        if _matches(spec, name) and id(p) not in seen:
            found.append(Target(name, name, param=p))
            seen.add(id(p))
    for mname, module in weighted:
        if _matches(spec, mname) and id(module.weight) not in seen:
            found.append(Target(f"{mname}.weight", mname, module=module, param=module.weight))
            seen.add(id(module.weight))
    return found


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _info(x: Any) -> TensorInfo | None:
    return TensorInfo(tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else None


def primary_output(output: Any) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], Any]]:
    """``(tensor, rebuild)``: the tensor a module-output fault lands on and ``rebuild(t)``, the
    output with ``t`` in its place. A tensor is itself; of a tuple or list (an LSTM's
    ``(output, (h, c))``, an attention's ``(output, weights)``, a transformer block's
    ``(hidden_states, ...)``) or a dict (a Hugging Face ``ModelOutput``: set in place, its type
    and attributes kept), the first floating-point tensor at its top level -- the value the next
    layer consumes. ``(None, ...)`` for anything else."""
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, dict):
        for key, item in output.items():
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                def put(t: torch.Tensor, key: Any = key) -> Any:
                    output[key] = t
                    return output
                return item, put
    if isinstance(output, (tuple, list)):
        for k, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                def rebuild(t: torch.Tensor, k: int = k) -> Any:
                    items = [*output[:k], t, *output[k + 1:]]
                    return output._make(items) if hasattr(output, "_make") else type(output)(items)
                return item, rebuild
    return None, lambda t: output


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module in a probe pass: its output and positional inputs (``None`` where
    not a tensor); for a Linear/Conv, whether its dW is reachable through the call's own
    autograd node (:func:`weight_grad_edge`; ``None`` when no gradient flows); for a GEMM, the
    gradient of each operand (X; ``a`` and ``b`` of ``a @ b``) as :func:`operand_grad_edge`
    hands it on -- ``None`` where none flows, a str saying why when no single node hands it on;
    ``evaluating``: a call of the evaluation pass."""

    output: TensorInfo | None
    inputs: tuple[TensorInfo | None, ...]
    weight_grad: bool | None
    operand_grads: tuple[TensorInfo | str | None, ...] = ()
    evaluating: bool = False


def _operand_grad(module: nn.Module, output: Any, args: tuple, position: int) -> TensorInfo | str | None:
    try:
        edge = operand_grad_edge(module, output, args, position)
    except ValueError as exc:
        return str(exc)
    return None if edge is None else TensorInfo(edge.shape, edge.dtype, True)


def probe_model(model: nn.Module, forward: Callable[[nn.Module], Any],
                evaluate: Callable[[nn.Module], Any] | None = None) -> dict[str, list[ModuleCall]]:
    """Every call of every named module while ``forward(copy)`` runs on a throwaway deep copy of
    ``model`` -- e.g. ``lambda m: loss_fn(m, sample_batch)``, under the autocast the training
    uses, if any -- then, given ``evaluate``, while ``evaluate(copy)`` runs in eval mode without
    autograd, as the engine evaluates (``workload.evaluate``: its batches may be shaped unlike the
    training ones; those calls are marked ``evaluating``). The model, its gradients and buffers
    and the global RNG are left as they were; hooks already on the model run on the copy too, so
    probe before attaching any."""
    twin = copy.deepcopy(model)
    calls: dict[str, list[ModuleCall]] = defaultdict(list)
    evaluating = False

    def record(name: str):
        def hook(module, args, output):
            grad, operands = None, ()
            if is_gemm(module):
                if has_weight_operand(module) and isinstance(output, torch.Tensor) and output.requires_grad:
                    grad = weight_grad_edge(output, module.weight) is not None
                n = 2 if getattr(module, "is_matmul", False) else 1
                operands = tuple(_operand_grad(module, output, args, k) for k in range(n))
            calls[name].append(ModuleCall(_info(primary_output(output)[0]), tuple(_info(a) for a in args), grad,
                                          operands, evaluating))
        return hook

    for name, module in twin.named_modules():
        if name:
            module.register_forward_hook(record(name))
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        with torch.enable_grad():
            forward(twin)
        if evaluate is not None:
            evaluating = True
            twin.eval()
            with torch.no_grad():
                evaluate(twin)
    return dict(calls)


EVAL_SITES = ("activation", "gemm.forward")
"""Module sites that act in an evaluation pass (a forward without autograd), by a permanent fault."""


def evaluated(specs: list[FaultSpec]) -> bool:
    """Whether a fault of ``specs`` acts in evaluation on a tensor only a probe knows the shape of (a
    permanent fault on a module output): then probe the evaluation too (:func:`probe_model`'s
    ``evaluate``)."""
    return any(s.site in EVAL_SITES and s.schedule.kind == "permanent" for s in specs)


View = tuple[tuple[int, ...] | None, torch.dtype, ChannelDim]
"""A tensor a fault lands on, as the injector hands it to ``apply_spec``: shape (``None``: not
known), dtype and ``channel_dim``."""


def _views(spec: FaultSpec, t: Target, calls: list[ModuleCall] | None, dtype: torch.dtype) -> list[View]:
    """The distinct tensors ``spec``'s fault lands on at ``t``; ``calls``: the module's calls in a
    probe (``None``: no probe, ``dtype`` is then the guess for a module site), those of the
    evaluation pass only for a fault that acts there (a permanent one). Empty when the probe
    never reached the site."""
    if t.param is not None:
        return [(tuple(t.param.shape), t.param.dtype, None)]
    site, module = spec.site, t.module
    matmul = getattr(module, "is_matmul", False)
    if calls is not None and spec.schedule.kind != "permanent":
        calls = [c for c in calls if not c.evaluating]
    if (site == "gemm.forward" and spec.pattern.kind == "mac_cell") or (site == "gemm.grad_weight" and not matmul):
        if site == "gemm.grad_weight" and any(c.weight_grad is False for c in calls or ()):
            raise ValueError(f"{t.name!r}: the weight's gradient does not come from this call's autograd "
                             "graph (a flattened or wrapped parameter?)")
        shape = tuple(module.weight.shape)
        if site == "gemm.forward" or calls is None:
            return [(shape, module.weight.dtype, None)]
        # dW as the GEMM computed it: in its compute dtype (bf16 under autocast), the output's
        return list(dict.fromkeys((shape, c.output.dtype, None) for c in calls if c.weight_grad and c.output))
    if calls is None:
        return [(None, dtype, None)]
    if site in EVAL_SITES:
        infos, channel_dim = [c.output for c in calls], (1 if isinstance(module, CHANNELS_FIRST) else -1)
    else:  # gemm.grad_input: dX; gemm.grad_weight of a @ b: d b -- as the call's node hands it on
        k = 1 if site == "gemm.grad_weight" else 0
        infos = [c.operand_grads[k] for c in calls if k < len(c.operand_grads)]
        if problem := next((i for i in infos if isinstance(i, str)), None):
            raise ValueError(f"{t.name!r}: {problem}")
        channel_dim = operand_channel_dims(module, k)
    return list(dict.fromkeys((i.shape, i.dtype, channel_dim) for i in infos if i is not None))


def validate_specs(model: nn.Module, specs: list[FaultSpec], optimizer: torch.optim.Optimizer | None = None,
                   world_size: int = 1, *, steps: int | None = None, grad_accum: int | None = None,
                   probe: dict[str, list[ModuleCall]] | None = None) -> dict[int, list[Target]]:
    """Check every spec against the model before training (:func:`validate_spec`); return the
    targets of each spec. Errors name the spec by its position."""
    resolved: dict[int, list[Target]] = {}
    for i, spec in enumerate(specs):
        try:
            resolved[i] = validate_spec(model, spec, optimizer, world_size, steps=steps, grad_accum=grad_accum,
                                        probe=probe)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"fault spec #{i} ({spec.site} on {', '.join(spec.target)}): {exc}") from None
    return resolved


def validate_spec(model: nn.Module, spec: FaultSpec, optimizer: torch.optim.Optimizer | None = None,
                  world_size: int = 1, *, steps: int | None = None, grad_accum: int | None = None,
                  probe: dict[str, list[ModuleCall]] | None = None) -> list[Target]:
    """Check one spec against the model before training; return its targets.

    ``steps`` (the run trains steps ``0..steps-1``) and ``grad_accum`` (micro-batches per step),
    when given, refuse a schedule that never fires in the run. ``probe`` (:func:`probe_model`)
    lets the pattern, bits and format be checked against the tensors of module sites too (without
    it, only against their dtype, guessed from the model's parameters); a target the probe never
    reached (a module not called, a first layer whose input needs no gradient) gets a warning:
    its fault may never fire.
    """
    targets = resolve_targets(model, spec)
    if spec.rank is not None and spec.rank >= world_size:
        raise ValueError(f"rank {spec.rank} does not exist; allowed: 0..{world_size - 1}")
    check_schedule(spec, steps, grad_accum)
    if spec.site == "optimizer_state":
        _check_optimizer_spec(spec, optimizer, targets)
    if spec.site in ("param_grad", "gemm.grad_weight"):
        for t in targets:
            p = t.param if spec.site == "param_grad" else getattr(t.module, "weight", None)
            if isinstance(p, torch.Tensor) and not p.requires_grad:
                raise ValueError(f"{t.name!r} is frozen (requires_grad=False): it has "
                                 "no gradient to corrupt; unfreeze it before building the injector, or target a "
                                 "trainable one")
    if spec.pattern.kind == "mac_cell" and spec.site == "gemm.forward":
        for t in targets:
            if getattr(t.module, "weight", None) is None:
                raise ValueError(f"pattern mac_cell on gemm.forward needs a weight operand; "
                                 f"{t.name!r} has none (use Linear or Conv layers)")
    if spec.pattern.kind == "mac_cell" and spec.site.startswith("gemm."):
        for t in targets:
            if isinstance(t.module, TRANSPOSED_TYPES) or weight_in_out(t.module):
                raise ValueError(f"pattern mac_cell is modelled on Linear, Conv1d/2d/3d and a @ b; {t.name!r} is a "
                                 f"{type(t.module).__name__} (weight laid out (in, out, ...)): use one of "
                                 "element, burst, row, column, pe, tensor")
    default_dtype = next((p.dtype for p in model.parameters()), torch.float32)
    always = _always_hit(spec)
    selected: dict[tuple[int, ...] | None, int | None] = {}  # per tensor shape: elements `always` selects
    for t in targets:
        views = _views(spec, t, None if probe is None else probe.get(t.name, []), default_dtype)
        if not views:
            warnings.warn(f"{spec.site} on {t.name!r}: the module {UNREACHED[spec.site]} in the probe forward "
                          "pass; its fault may never fire", stacklevel=2)
        for shape, dtype, channel_dim in views:
            try:
                check_spec(spec, dtype, shape, channel_dim=channel_dim)
            except FaultSpecError as exc:
                raise FaultSpecError(f"{t.name!r}: {exc}") from None
            if always is not None:
                selected[shape] = check_spec(always, dtype, shape, channel_dim=channel_dim)
    _check_idle(spec, selected)
    return targets


def _always_hit(spec: FaultSpec) -> FaultSpec | None:
    """For a ``pe`` or an arrayed ``mac_cell`` pattern, which may select no element of a tensor (an
    idle PE or cell): ``spec`` with its ``"random"`` positions put at 0, a PE or cell every tensor
    reaches, so it selects nothing only where its fixed positions are idle whatever is drawn."""
    p = spec.pattern
    if p.kind == "pe":
        return dataclasses.replace(spec, pattern=dataclasses.replace(p, pe=(0, 0) if p.pe == RANDOM else p.pe))
    if p.kind == "mac_cell" and p.array is not None:
        fixed = {k: 0 if getattr(p, k) == RANDOM else getattr(p, k) for k in ("input_channel", "output_channel")}
        return dataclasses.replace(spec, pattern=dataclasses.replace(p, **fixed))
    return None


def _check_idle(spec: FaultSpec, selected: dict[tuple[int, ...] | None, int | None]) -> None:
    """Refuse a PE or MAC cell whose fixed position is idle on every tensor the fault lands on
    (``selected``: elements it selects per shape, :func:`_always_hit`): it would fire without
    changing a value, and a run "masked" by it would count as evidence of masking."""
    if not selected or any(n is None or n > 0 for n in selected.values()):
        return
    p, shapes = spec.pattern, ", ".join(str(list(s)) for s in selected)
    if p.kind == "pe":
        rows = max(math.prod(s[:-1]) for s in selected)
        cols = max(s[-1] if s else 1 for s in selected)
        what = f"pe {list(p.pe) if p.pe != RANDOM else p.pe} of array {list(p.array)}"
        allowed = (f"a pe inside the tensor's [rows, columns] view: rows 0..{min(rows, p.array[0]) - 1}, "
                   f"columns 0..{min(cols, p.array[1]) - 1}")
    else:
        what = f"mac_cell input_channel {p.input_channel!r}, output_channel {p.output_channel!r} of array {list(p.array)}"
        allowed = "channels the tensor has (below its channel counts), or 'random'"
    raise FaultSpecError(f"pattern {what} selects no element of the tensor(s) it lands on (shape {shapes}): the "
                         f"PE or cell is idle there, so the fault would never change a value; allowed: {allowed}")


def check_schedule(spec: FaultSpec, steps: int | None, grad_accum: int | None) -> None:
    """Refuse a schedule that never fires in a run of ``steps`` optimizer steps of ``grad_accum``
    micro-batches each (``None``: not known)."""
    sched = spec.schedule
    if sched.kind == "intermittent" and sched.p == 0:
        raise ValueError("schedule p 0 never fires; allowed: p in (0, 1]")
    if sched.kind == "transient" and grad_accum is not None and (sched.micro_batch or 0) >= grad_accum:
        raise ValueError(f"schedule micro_batch {sched.micro_batch} never fires: a step runs grad_accum="
                         f"{grad_accum} micro-batch(es); allowed: 0..{grad_accum - 1}")
    lo = 1 if spec.site in FROM_STEP_1 else 0
    hi = math.inf if steps is None else steps + (spec.site == "checkpoint")
    start = sched.step if sched.kind == "transient" else sched.start
    stop = start + 1 if sched.kind == "transient" else (sched.stop or math.inf)
    if max(start, lo) >= min(stop, hi):
        visits = (f"steps >= {lo}" if steps is None else f"steps {lo}..{hi - 1} of this {steps}-step run"
                  if hi > lo else f"no step of this {steps}-step run")
        why = f" ({FROM_STEP_1[spec.site]})" if spec.site in FROM_STEP_1 else ""
        raise ValueError(f"schedule {sched.to_dict()} never fires: site {spec.site!r} is visited at {visits}{why}")


def _state_keys(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> tuple[str, ...] | None:
    """The state tensors an ``optimizer_state`` fault on ``param`` can corrupt
    (:func:`element_state`): seen after one dry step of a twin optimizer, with the
    same hyperparameters, on a zero copy of the parameter. ``None`` when the optimizer cannot be
    re-created like this (another constructor signature, a step that needs a closure)."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        return ()
    twin = torch.zeros_like(param, requires_grad=True)
    twin.grad = torch.zeros_like(param)
    try:
        dry = type(optimizer)([{**group, "params": [twin]}])
        dry.step()
    except (TypeError, ValueError, RuntimeError):
        return None
    return element_state(dry.state[twin], param)


COUNTERS = frozenset({"step", "mu_product", "eta", "mu"})
"""Optimizer state entries that hold one number per parameter, not per element: the update counter
(``step``), NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``."""


def element_state(state: dict[str, Any], param: torch.Tensor) -> tuple[str, ...]:
    """The keys of ``state`` (an optimizer's state for ``param``) an ``optimizer_state`` fault
    lands on, sorted: floating tensors with a value per element of ``param`` (``exp_avg``,
    ``momentum_buffer``, ...). Never a counter (:data:`COUNTERS`), though a 0-d parameter's is
    shaped like it: corrupting Adam's ``step`` is no fault in the moments."""
    return tuple(sorted(k for k, v in state.items() if k not in COUNTERS and isinstance(v, torch.Tensor)
                        and v.is_floating_point() and v.shape == param.shape))


def _check_optimizer_spec(spec: FaultSpec, optimizer: torch.optim.Optimizer | None, targets: list[Target]) -> None:
    if optimizer is None:
        raise ValueError("site 'optimizer_state' needs the optimizer (pass optimizer=...)")
    name = type(optimizer).__name__
    for t in targets:
        keys = _state_keys(optimizer, t.param)
        if keys is None or (keys and spec.state_key in (None, *keys)):
            continue
        if spec.state_key is None:
            raise ValueError(f"{name} keeps no state tensor for {t.name!r} with this configuration (not in a "
                             "param group, or e.g. SGD without momentum): the fault would never fire")
        raise ValueError(f"state_key {spec.state_key!r} is never created by {name} for {t.name!r} with this "
                         f"configuration; allowed: {', '.join(keys) or 'none (it keeps no state tensor)'}")
