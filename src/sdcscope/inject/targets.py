"""Resolve and validate a spec's targets on a live model, before any training starts.

Module sites (``activation``, ``gemm.*``) match qualified module names. Parameter sites
(``weight``, ``param_grad``, ``optimizer_state``, ``checkpoint``) match parameter names
(``blocks.0.mlp.fc.weight``) or, for a module name (``blocks.0.mlp.fc``), that module's own
``weight``. Mistakes name the pattern and list close names.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from sdcscope.faults import FaultSpec, check_bits, format_of, get_format

MODULE_SITES = ("activation", "gemm.forward", "gemm.grad_input", "gemm.grad_weight")
PARAM_SITES = ("weight", "param_grad", "optimizer_state", "checkpoint")
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
GEMM_TYPES = (nn.Linear, *CONV_TYPES)
KNOWN_STATE_KEYS = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
}


def is_gemm(module: nn.Module) -> bool:
    """A module whose forward is one GEMM: Linear/Conv, or the ``is_matmul`` contract (a @ b)."""
    return isinstance(module, GEMM_TYPES) or getattr(module, "is_matmul", False)


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
                leaf = child
                while type(leaf).__name__ == "ToCopyBackward0" and leaf.next_functions:
                    leaf = leaf.next_functions[0][0]
                if getattr(leaf, "variable", None) is weight:
                    return node, i
                if not hasattr(child, "variable"):
                    nxt.append(child)
        frontier = nxt
    return None


@dataclass(frozen=True)
class Target:
    """A resolved target. ``key`` is the name the spec's pattern matched (what ``fires`` and the
    fault generator are keyed on); ``name`` is the tensor's full name, as recorded."""

    name: str
    key: str
    module: nn.Module | None = None
    param: nn.Parameter | None = None


def _no_match(spec: FaultSpec, candidates: list[str], what: str) -> ValueError:
    close: list[str] = []
    for pattern in spec.target:
        close += difflib.get_close_matches(pattern, candidates, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(dict.fromkeys(close))}" if close else ""
    sample = ", ".join(candidates[:8]) + (" …" if len(candidates) > 8 else "")
    return ValueError(f"target {list(spec.target)!r} matches no {what} for site {spec.site!r}"
                      f"{hint} (names look like: {sample})")


def _matches(spec: FaultSpec, name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in spec.target)


def resolve_targets(model: nn.Module, spec: FaultSpec) -> list[Target]:
    """The modules or parameters ``spec`` hits in ``model`` (never empty: raises instead)."""
    if spec.site == "comm":
        raise ValueError("site 'comm' corrupts a DDP gradient bucket: attach it to a "
                         "DistributedDataParallel model with sdcscope.inject.comm")
    if spec.site in MODULE_SITES:
        gemm_only = spec.site.startswith("gemm.")
        candidates = [(n, m) for n, m in model.named_modules() if n and (not gemm_only or is_gemm(m))]
        found = [Target(n, n, module=m) for n, m in candidates if _matches(spec, n)]
        if not found:
            raise _no_match(spec, [n for n, _ in candidates], "GEMM module" if gemm_only else "module")
        return found
    params = dict(model.named_parameters())
    found, seen = [], set()
    for name, p in params.items():
        if _matches(spec, name) and id(p) not in seen:
            found.append(Target(name, name, param=p))
            seen.add(id(p))
    for mname, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if mname and _matches(spec, mname) and isinstance(weight, nn.Parameter) and id(weight) not in seen:
            found.append(Target(f"{mname}.weight", mname, module=module, param=weight))
            seen.add(id(weight))
    if not found:
        names = list(params) + [n for n, m in model.named_modules()
                                if n and isinstance(getattr(m, "weight", None), nn.Parameter)]
        raise _no_match(spec, names, "parameter")
    return found


def validate_specs(model: nn.Module, specs: list[FaultSpec],
                   optimizer: torch.optim.Optimizer | None = None, world_size: int = 1) -> dict[int, list[Target]]:
    """Check every spec against the model before training; return the targets of each spec."""
    resolved: dict[int, list[Target]] = {}
    default_dtype = next((p.dtype for p in model.parameters()), torch.float32)
    for i, spec in enumerate(specs):
        where = f"fault spec #{i} ({spec.site} on {', '.join(spec.target)})"
        try:
            targets = resolve_targets(model, spec)
            if spec.rank is not None and spec.rank >= world_size:
                raise ValueError(f"rank {spec.rank} does not exist; allowed: 0..{world_size - 1}")
            if spec.bits is not None:
                for t in targets:
                    dtype = t.param.dtype if t.param is not None else default_dtype
                    check_bits(spec.bits, get_format(spec.format) if spec.format else format_of(dtype))
            if spec.site == "optimizer_state":
                _check_optimizer_spec(spec, optimizer)
            if spec.pattern.kind == "mac_cell" and spec.site == "gemm.forward":
                for t in targets:
                    if getattr(t.module, "weight", None) is None:
                        raise ValueError(f"pattern mac_cell on gemm.forward needs a weight operand; "
                                         f"{t.name!r} has none (use Linear or Conv layers)")
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        resolved[i] = targets
    return resolved


def _check_optimizer_spec(spec: FaultSpec, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        raise ValueError("site 'optimizer_state' needs the optimizer (pass optimizer=...)")
    sched = spec.schedule
    if sched.kind == "transient" and sched.step == 0:
        raise ValueError("optimizer state exists only after the first update; "
                         "a transient optimizer_state fault needs step >= 1")
    keys = next((v for k, v in KNOWN_STATE_KEYS.items() if type(optimizer) is k), None)
    if spec.state_key is not None and keys is not None and spec.state_key not in keys:
        raise ValueError(f"unknown state_key {spec.state_key!r} for {type(optimizer).__name__}; "
                         f"allowed: {', '.join(keys)}")
