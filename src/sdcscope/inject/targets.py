"""Resolve a spec's targets on a live model: the modules or parameters its patterns name.

Module sites (``activation``, ``gemm.*``, ``dispatch``) match qualified module names (``dispatch``:
those of MoE token dispatches, :func:`~sdcscope.common.modules.is_dispatch`). Parameter sites
(``weight``, ``param_grad``, ``optimizer_state``, ``checkpoint``) match parameter names
(``blocks.0.mlp.fc.weight``) or, for a module name (``blocks.0.mlp.fc``), that module's own
``weight``. Mistakes name the pattern and list close names. Whether a spec fits what it targets
is :mod:`sdcscope.inject.validate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from sdcscope.common.modules import CHANNELS_FIRST, is_dispatch, is_gemm
from sdcscope.common.validate import close_matches
from sdcscope.common.world import unsupported
from sdcscope.faults import FaultSpec
from sdcscope.faults.patterns import ChannelDim

MODULE_SITES = ("activation", "gemm.forward", "gemm.grad_input", "gemm.grad_weight", "dispatch")
PARAM_SITES = ("weight", "param_grad", "optimizer_state", "checkpoint")
UNREACHED = {
    "activation": "was never called (or returned no tensor)",
    "gemm.forward": "was never called",
    "gemm.grad_input": "computed no input gradient dX (its input needs none: a first layer?)",
    "gemm.grad_weight": "computed no weight gradient dW",
    "dispatch": "was never called",
}
"""Why a module site's fault never fired, by site (its module never reached the site)."""


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
        close += close_matches(pattern, candidates, n=5, cutoff=0.5)
    hint = f"; close names: {', '.join(dict.fromkeys(close))}" if close else ""
    sample = ", ".join(candidates[:8]) + (" …" if len(candidates) > 8 else "")
    which = (
        f"target {list(spec.target)!r} matches"
        if len(dead) == len(spec.target)
        else f"target pattern {', '.join(map(repr, dead))} (of {list(spec.target)!r}) matches"
    )
    raise ValueError(f"{which} no {what} for site {spec.site!r}{hint} (names look like: {sample})")


def _matches(spec: FaultSpec, name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in spec.target)


def resolve_targets(model: nn.Module, spec: FaultSpec) -> list[Target]:
    """The modules or parameters ``spec`` hits in ``model``; raises when a target pattern hits none."""
    if spec.site == "comm":
        raise ValueError(
            "site 'comm' corrupts a DDP gradient bucket: attach it to a "
            "DistributedDataParallel model with sdcscope.inject.comm"
        )
    if spec.site == "comm.all_to_all":
        raise ValueError(unsupported("fault.all_to_all", "single"))
    if spec.site.startswith("comm."):
        raise ValueError(
            f"site {spec.site!r} corrupts one of FSDP2's collectives: it needs --nproc 2 or more with "
            "--parallel fsdp, hsdp or fsdp+tp (sdcscope.inject.collectives)"
        )
    if spec.site in MODULE_SITES:
        gemm_only = spec.site.startswith("gemm.")
        kind = is_gemm if gemm_only else is_dispatch if spec.site == "dispatch" else lambda m: True
        candidates = [(n, m) for n, m in model.named_modules() if n and kind(m)]
        if gemm_only:  # a module that is there but no GEMM: say so, rather than offer close names
            other = [
                (n, m)
                for n, m in model.named_modules()
                if n and not is_gemm(m) and _matches(spec, n) and not any(_matches(spec, c) for c, _ in candidates)
            ]
            if other:
                n, m = other[0]
                raise ValueError(
                    f"target {n!r} ({type(m).__name__}) is not a GEMM module (nn.Linear, ConvNd, "
                    f"ConvTransposeNd, transformers' Conv1D, a MatMul-contract module): the products "
                    f"its own forward computes (F.linear on its weights: an MoE's experts, a router) "
                    f"cannot take {spec.site!r}; use site 'activation' (its output), 'weight' or "
                    f"'param_grad' (its parameters), or target its GEMM submodules"
                )
        what = (
            "GEMM module" if gemm_only else "MoE token dispatch (is_dispatch)" if spec.site == "dispatch" else "module"
        )
        _check_patterns(spec, [n for n, _ in candidates], what)
        return [Target(n, n, module=m) for n, m in candidates if _matches(spec, n)]
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight by each of its names
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
                    items = [*output[:k], t, *output[k + 1 :]]
                    return output._make(items) if hasattr(output, "_make") else type(output)(items)

                return item, rebuild
    return None, lambda t: output
