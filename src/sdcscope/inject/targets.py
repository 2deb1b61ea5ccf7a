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
:func:`probe_model` records them from one forward pass on a throwaway copy of the model.
"""

from __future__ import annotations

import copy
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
from sdcscope.faults.patterns import ChannelDim

MODULE_SITES = ("activation", "gemm.forward", "gemm.grad_input", "gemm.grad_weight")
PARAM_SITES = ("weight", "param_grad", "optimizer_state", "checkpoint")
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
GEMM_TYPES = (nn.Linear, *CONV_TYPES)
FROM_STEP_1 = {"optimizer_state": "optimizer state exists only after the first update",
               "checkpoint": "a checkpoint fault corrupts the checkpoint written after a step"}
"""Sites visited from step 1 on, and why (a checkpoint is also written after the run's last step)."""
UNREACHED = {
    "activation": "was never called (or returned no tensor)",
    "gemm.forward": "was never called",
    "gemm.grad_input": "computed no input gradient dX (its input needs none: a first layer?)",
    "gemm.grad_weight": "computed no weight gradient dW",
}


def is_gemm(module: nn.Module) -> bool:
    """A module whose forward is one GEMM: Linear/Conv, or the ``is_matmul`` contract (a @ b)."""
    return isinstance(module, GEMM_TYPES) or getattr(module, "is_matmul", False)


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
    before it is the call's own."""
    frontier = [output.grad_fn] if output.grad_fn is not None else []
    seen: set[int] = set()
    for _ in range(max_depth):
        nxt = []
        for node in frontier:
            for i, (child, _) in enumerate(node.next_functions):
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                if getattr(through_casts(child), "variable", None) is weight:
                    return node, i
                if not hasattr(child, "variable"):
                    nxt.append(child)
        frontier = nxt
    return None


_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def linear_nodes(out: torch.Tensor, weight: torch.Tensor, depth: int = 1):
    """``(gemm node, index of X's gradient, dW node, index of dW)`` of the ``F.linear`` call that
    produced ``out``: ``addmm``/``mm`` (after the reshapes of an N-d input) whose weight operand is
    ``weight.t()`` (through an autocast copy). ``depth`` > 1: also behind up to ``depth - 1``
    other nodes (a forward hook that replaced the output). ``None`` for any other graph."""
    frontier = [out.grad_fn]
    for _ in range(depth):
        for node in frontier:
            if (got := _linear_node(node, weight)) is not None:
                return got
        frontier = [f for node in frontier if node is not None for f, _ in node.next_functions if f is not None]
    return None


def _linear_node(node, weight: torch.Tensor):
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    kind = type(node).__name__
    xi = 1 if kind == "AddmmBackward0" else 0 if kind == "MmBackward0" else None
    if xi is None or len(node.next_functions) != xi + 2:
        return None
    wt = node.next_functions[xi + 1][0]
    if wt is None or type(wt).__name__ != "TBackward0":
        return None
    if getattr(through_casts(wt.next_functions[0][0]), "variable", None) is not weight:
        return None
    return node, xi, wt, 0


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
        _check_patterns(spec, [n for n, _ in candidates], "GEMM module" if gemm_only else "module")
        return [Target(n, n, module=m) for n, m in candidates if _matches(spec, n)]
    params = dict(model.named_parameters())
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


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module in a probe forward pass: its output and positional inputs (``None``
    where not a tensor) and, for a Linear/Conv, whether its dW is reachable through the call's
    own autograd node (:func:`weight_grad_edge`; ``None`` when no gradient flows)."""

    output: TensorInfo | None
    inputs: tuple[TensorInfo | None, ...]
    weight_grad: bool | None


def probe_model(model: nn.Module, forward: Callable[[nn.Module], Any]) -> dict[str, list[ModuleCall]]:
    """Every call of every named module while ``forward(copy)`` runs on a throwaway deep copy of
    ``model`` -- e.g. ``lambda m: loss_fn(m, sample_batch)``, under the autocast the training
    uses, if any. The model, its gradients and buffers and the global RNG are left as they were;
    hooks already on the model run on the copy too, so probe before attaching any."""
    twin = copy.deepcopy(model)
    calls: dict[str, list[ModuleCall]] = defaultdict(list)

    def record(name: str):
        def hook(module, args, output):
            grad = None
            if isinstance(module, GEMM_TYPES) and isinstance(output, torch.Tensor) and output.requires_grad:
                grad = weight_grad_edge(output, module.weight) is not None
            calls[name].append(ModuleCall(_info(output), tuple(_info(a) for a in args), grad))
        return hook

    for name, module in twin.named_modules():
        if name:
            module.register_forward_hook(record(name))
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        forward(twin)
    return dict(calls)


View = tuple[tuple[int, ...] | None, torch.dtype, ChannelDim]
"""A tensor a fault lands on, as the injector hands it to ``apply_spec``: shape (``None``: not
known), dtype and ``channel_dim``."""


def _views(spec: FaultSpec, t: Target, calls: list[ModuleCall] | None, dtype: torch.dtype) -> list[View]:
    """The distinct tensors ``spec``'s fault lands on at ``t``; ``calls``: the module's calls in a
    probe (``None``: no probe, ``dtype`` is then the guess for a module site). Empty when the
    probe never reached the site."""
    if t.param is not None:
        return [(tuple(t.param.shape), t.param.dtype, None)]
    site, module = spec.site, t.module
    conv, matmul = isinstance(module, CONV_TYPES), getattr(module, "is_matmul", False)
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
    if site in ("activation", "gemm.forward"):
        infos, channel_dim = [c.output for c in calls], (1 if conv else -1)
    else:  # gemm.grad_input: dX; gemm.grad_weight of a @ b: d b
        k = 1 if site == "gemm.grad_weight" else 0
        infos = [c.inputs[k] for c in calls
                 if k < len(c.inputs) and c.inputs[k] is not None and c.inputs[k].requires_grad]
        channel_dim = None if k else ((None, 1) if conv else (None, -1))
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
    _check_schedule(spec, steps, grad_accum)
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
    default_dtype = next((p.dtype for p in model.parameters()), torch.float32)
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
    return targets


def _check_schedule(spec: FaultSpec, steps: int | None, grad_accum: int | None) -> None:
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
    """The state tensors shaped like ``param`` that ``optimizer`` keeps for it (what an
    ``optimizer_state`` fault can corrupt): seen after one dry step of a twin optimizer, with the
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
    return tuple(k for k, v in dry.state[twin].items() if isinstance(v, torch.Tensor) and v.shape == param.shape)


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
