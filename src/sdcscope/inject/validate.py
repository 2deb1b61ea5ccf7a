"""Refuse, before any work, every spec that cannot be applied to a model: targets, ranks, a schedule
that never fires in the run, optimizer state the optimizer never creates, and a pattern, bits or
format that do not fit a tensor the fault lands on (:func:`sdcscope.faults.check_spec`).

Parameters and the weight operand of a GEMM have known shapes and dtypes; the output or input
gradient of a module is known only once the module ran: :func:`~sdcscope.inject.probe.probe_model`
records them from one forward pass on a throwaway copy of the model (and from an evaluation pass,
whose batches may be shaped otherwise, for the faults that act there).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import nn

from sdcscope.common.modules import CHANNELS_FIRST, TRANSPOSED_TYPES, weight_in_out
from sdcscope.faults import RANDOM, FaultSpec, FaultSpecError, check_spec
from sdcscope.faults.patterns import ChannelDim
from sdcscope.inject.fp8 import fp8_site, fp8_view, refuse_operand
from sdcscope.inject.optstate import state_keys
from sdcscope.inject.probe import EVAL_SITES, ModuleCall
from sdcscope.inject.targets import (
    UNREACHED,
    Target,
    operand_channel_dims,
    resolve_targets,
)

FROM_STEP_1 = {
    "optimizer_state": "optimizer state exists only after the first update",
    "checkpoint": "a checkpoint fault corrupts the checkpoint written after a step",
}
"""Sites visited from step 1 on, and why (a checkpoint is also written after the run's last step)."""


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
    if fp8_site(spec, t):  # an FP8 layer's GEMM: the operand's format; shapes are not probed
        return [fp8_view(spec, t)]
    site, module = spec.site, t.module
    matmul = getattr(module, "is_matmul", False)
    if calls is not None and spec.schedule.kind != "permanent":
        calls = [c for c in calls if not c.evaluating]
    if (site == "gemm.forward" and spec.pattern.kind == "mac_cell") or (site == "gemm.grad_weight" and not matmul):
        if site == "gemm.grad_weight" and any(c.weight_grad is False for c in calls or ()):
            raise ValueError(
                f"{t.name!r}: the weight's gradient does not come from this call's autograd "
                "graph (a flattened or wrapped parameter?)"
            )
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


def validate_specs(
    model: nn.Module,
    specs: list[FaultSpec],
    optimizer: torch.optim.Optimizer | None = None,
    world_size: int = 1,
    *,
    steps: int | None = None,
    grad_accum: int | None = None,
    probe: dict[str, list[ModuleCall]] | None = None,
) -> dict[int, list[Target]]:
    """Check every spec against the model before training (:func:`validate_spec`); return the
    targets of each spec. Errors name the spec by its position."""
    resolved: dict[int, list[Target]] = {}
    for i, spec in enumerate(specs):
        try:
            resolved[i] = validate_spec(
                model, spec, optimizer, world_size, steps=steps, grad_accum=grad_accum, probe=probe
            )
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"fault spec #{i} ({spec.site} on {', '.join(spec.target)}): {exc}") from None
    return resolved


def validate_spec(
    model: nn.Module,
    spec: FaultSpec,
    optimizer: torch.optim.Optimizer | None = None,
    world_size: int = 1,
    *,
    steps: int | None = None,
    grad_accum: int | None = None,
    probe: dict[str, list[ModuleCall]] | None = None,
) -> list[Target]:
    """Check one spec against the model before training; return its targets.

    ``steps`` (the run trains steps ``0..steps-1``) and ``grad_accum`` (micro-batches per step),
    when given, refuse a schedule that never fires in the run. ``probe`` (:func:`probe_model`)
    lets the pattern, bits and format be checked against the tensors of module sites too (without
    it, only against their dtype, guessed from the model's parameters); a target the probe never
    reached (a module not called, a first layer whose input needs no gradient) gets a warning:
    its fault may never fire.
    """
    targets = resolve_targets(model, spec)
    refuse_operand(spec, targets)
    if spec.rank is not None and spec.rank >= world_size:
        raise ValueError(f"rank {spec.rank} does not exist; allowed: 0..{world_size - 1}")
    check_schedule(spec, steps, grad_accum)
    if spec.site == "optimizer_state":
        _check_optimizer_spec(spec, optimizer, targets)
    if spec.site in ("param_grad", "gemm.grad_weight"):
        for t in targets:
            p = t.param if spec.site == "param_grad" else getattr(t.module, "weight", None)
            if isinstance(p, torch.Tensor) and not p.requires_grad:
                raise ValueError(
                    f"{t.name!r} is frozen (requires_grad=False): it has "
                    "no gradient to corrupt; unfreeze it before building the injector, or target a "
                    "trainable one"
                )
    if spec.pattern.kind == "mac_cell" and spec.site == "gemm.forward":
        for t in targets:
            if getattr(t.module, "weight", None) is None:
                raise ValueError(
                    f"pattern mac_cell on gemm.forward needs a weight operand; "
                    f"{t.name!r} has none (use Linear or Conv layers)"
                )
    if spec.pattern.kind == "mac_cell" and spec.site.startswith("gemm."):
        for t in targets:
            if isinstance(t.module, TRANSPOSED_TYPES) or weight_in_out(t.module):
                raise ValueError(
                    f"pattern mac_cell is modelled on Linear, Conv1d/2d/3d and a @ b; {t.name!r} is a "
                    f"{type(t.module).__name__} (weight laid out (in, out, ...)): use one of "
                    "element, burst, row, column, pe, tensor"
                )
    default_dtype = next((p.dtype for p in model.parameters()), torch.float32)
    always = _always_hit(spec)
    selected: dict[tuple[int, ...] | None, int | None] = {}  # per tensor shape: elements `always` selects
    for t in targets:
        views = _views(spec, t, None if probe is None else probe.get(t.name, []), default_dtype)
        if not views:
            warnings.warn(
                f"{spec.site} on {t.name!r}: the module {UNREACHED[spec.site]} in the probe forward "
                "pass; its fault may never fire",
                stacklevel=2,
            )
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
    """For a ``pe``, an arrayed ``mac_cell`` or a ``warp`` pattern with fixed lanes, which may select
    no element of a tensor (an idle PE, cell or lane): ``spec`` with its ``"random"`` positions put
    at 0, a PE, cell or warp every tensor reaches, so it selects nothing only where its fixed
    positions are idle whatever is drawn."""
    p = spec.pattern
    if p.kind == "pe":
        return dataclasses.replace(spec, pattern=dataclasses.replace(p, pe=(0, 0) if p.pe == RANDOM else p.pe))
    if p.kind == "mac_cell" and p.array is not None:
        fixed = {k: 0 if getattr(p, k) == RANDOM else getattr(p, k) for k in ("input_channel", "output_channel")}
        return dataclasses.replace(spec, pattern=dataclasses.replace(p, **fixed))
    if p.kind == "warp" and isinstance(p.lanes, tuple):  # lanes past a partial last warp are idle
        return dataclasses.replace(spec, pattern=dataclasses.replace(p, warp=0 if p.warp == RANDOM else p.warp))
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
        allowed = (
            f"a pe inside the tensor's [rows, columns] view: rows 0..{min(rows, p.array[0]) - 1}, "
            f"columns 0..{min(cols, p.array[1]) - 1}"
        )
    elif p.kind == "warp":
        what = f"warp lanes {list(p.lanes)} of warp {p.warp!r}"
        allowed = "lanes below the tensor's element count"
    else:
        what = (
            f"mac_cell input_channel {p.input_channel!r}, output_channel {p.output_channel!r} of array {list(p.array)}"
        )
        allowed = "channels the tensor has (below its channel counts), or 'random'"
    raise FaultSpecError(
        f"pattern {what} selects no element of the tensor(s) it lands on (shape {shapes}): the "
        f"PE or cell is idle there, so the fault would never change a value; allowed: {allowed}"
    )


def check_schedule(spec: FaultSpec, steps: int | None, grad_accum: int | None) -> None:
    """Refuse a schedule that never fires in a run of ``steps`` optimizer steps of ``grad_accum``
    micro-batches each (``None``: not known)."""
    sched = spec.schedule
    if sched.kind == "intermittent" and sched.p == 0:
        raise ValueError("schedule p 0 never fires; allowed: p in (0, 1]")
    if sched.once_per_step and grad_accum is not None and (sched.micro_batch or 0) >= grad_accum:
        raise ValueError(
            f"schedule micro_batch {sched.micro_batch} never fires: a step runs grad_accum="
            f"{grad_accum} micro-batch(es); allowed: 0..{grad_accum - 1}"
        )
    lo = 1 if spec.site in FROM_STEP_1 else 0
    hi = math.inf if steps is None else steps + (spec.site == "checkpoint")
    start = sched.step if sched.kind == "transient" else sched.start
    stop = start + 1 if sched.kind == "transient" else (sched.stop or math.inf)
    if sched.kind == "periodic" and start < lo:  # its first firing the site visits
        start -= (start - lo) // sched.every * sched.every
    if max(start, lo) >= min(stop, hi):
        visits = (
            f"steps >= {lo}"
            if steps is None
            else f"steps {lo}..{hi - 1} of this {steps}-step run"
            if hi > lo
            else f"no step of this {steps}-step run"
        )
        why = f" ({FROM_STEP_1[spec.site]})" if spec.site in FROM_STEP_1 else ""
        raise ValueError(f"schedule {sched.to_dict()} never fires: site {spec.site!r} is visited at {visits}{why}")


def _check_optimizer_spec(spec: FaultSpec, optimizer: torch.optim.Optimizer | None, targets: list[Target]) -> None:
    if optimizer is None:
        raise ValueError("site 'optimizer_state' needs the optimizer (pass optimizer=...)")
    name = type(optimizer).__name__
    for t in targets:
        keys = state_keys(optimizer, t.param)
        if keys is None or (keys and spec.state_key in (None, *keys)):
            continue
        if spec.state_key is None:
            raise ValueError(
                f"{name} keeps no state tensor for {t.name!r} with this configuration (not in a "
                "param group, or e.g. SGD without momentum): the fault would never fire"
            )
        raise ValueError(
            f"state_key {spec.state_key!r} is never created by {name} for {t.name!r} with this "
            f"configuration; allowed: {', '.join(keys) or 'none (it keeps no state tensor)'}"
        )
