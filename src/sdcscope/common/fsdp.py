"""FSDP2's collectives as the checks and the fault sites see them: which modules ``fully_shard``
split, which ranks each unit's parameters are gathered from, and the moments the gathered
(unsharded) parameters become visible -- after FSDP2's own forward pre-hook (the forward
all-gather) and after its pre-backward hook (the backward re-gather of a unit that resharded
after forward) -- and the moment every reduce-scatter has landed (FSDP2's root post-backward
callback).

A unit's all-gather writes, for every parameter, one flat buffer of ``S`` equal rows, row ``s``
holding what arrived from shard rank ``s`` (its zero-padded local shard). A reducing
collective's inputs are each rank's unsharded gradient, split into the same ``S`` chunks.

Hooks registered here run after FSDP2's (its forward pre-hook is prepended, its pre-backward
hooks are registered on the outputs before ours), so they see the parameters unsharded. Only
the duck-typed FSDP2 state is read (``_get_fsdp_state``), as :mod:`sdcscope.guard.sharded` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sdcscope.common.alltoall import EXPERT

PASSES = ("forward", "backward")
"""The all-gathers of a step: the forward one, and the backward re-gather of a resharded unit."""


@dataclass
class GatheredParam:
    """One parameter of an FSDP2 unit: its qualified name and FSDP2's record of it."""

    name: str
    fp: Any
    """FSDP2's ``FSDPParam``."""

    @property
    def shard_dim(self) -> int:
        return self.fp.fsdp_placement.dim

    def padded_numel(self) -> int:
        return self.fp.padded_sharded_param_size.numel()

    def sent(self) -> torch.Tensor:
        """What this rank sends in the all-gather: its zero-padded flat shard, in the gather dtype."""
        data = self.fp._sharded_param_data
        dtype = self.fp.param_dtype
        return data if dtype is None or data.dtype == dtype else data.to(dtype)

    def gathered(self) -> torch.Tensor | None:
        """What arrived, ``[S, padded numel]``: row ``s`` from shard rank ``s`` (None before the
        first all-gather or after a reshard freed it)."""
        outs = self.fp.all_gather_outputs
        if not self.plain or len(outs) != 1 or outs[0].untyped_storage().size() == 0:
            return None
        return outs[0].view(self.size, -1)

    @property
    def plain(self) -> bool:
        """FSDP2 gathers the shard as it is stored: no all-gather extension of the tensor
        (``fsdp_pre_all_gather``, which sends something else) and no CPU offload."""
        return not hasattr(self.fp._sharded_local_tensor, "fsdp_pre_all_gather") and not self.fp.offload_to_cpu

    @property
    def size(self) -> int:
        return self.fp.mesh_info.shard_mesh_size

    def source_shape(self, s: int) -> tuple[int, ...]:
        """The shape of shard rank ``s``'s part of the parameter (FSDP2's chunking: the last ranks
        may hold fewer rows, or none, along dim 0)."""
        full = list(self.fp._orig_size)
        d, size = self.shard_dim, self.size
        per = -(-full[d] // size)
        full[d] = max(0, min(per, full[d] - s * per))
        return tuple(full)

    def source_range(self, s: int) -> tuple[int, int]:
        """Shard rank ``s``'s part as ``[start, stop)`` along the shard dim of the parameter."""
        n = self.fp._orig_size[self.shard_dim]
        per = -(-n // self.size)
        return min(n, s * per), min(n, (s + 1) * per)

    def unsharded(self) -> torch.Tensor | None:
        return getattr(self.fp, "_unsharded_param", None)


@dataclass
class FSDPUnit:
    """One ``fully_shard`` module: its name, its parameters and the ranks they are gathered from."""

    name: str
    module: nn.Module
    group: Any
    """FSDP2's ``FSDPParamGroup``."""
    params: list[GatheredParam] = field(default_factory=list)

    @property
    def shard_ranks(self) -> list[int]:
        """The global ranks of the shard group, in shard-rank order (row ``s`` came from ``[s]``)."""
        import torch.distributed as dist

        return list(dist.get_process_group_ranks(self.group.mesh_info.shard_process_group))

    @property
    def dp_ranks(self) -> list[int]:
        """Every rank whose gradients a reduced shard sums (the shard group, and HSDP's replicas)."""
        mesh = self.group.mesh_info.mesh
        return sorted(int(r) for r in mesh.mesh.flatten().tolist())

    @property
    def shard_rank(self) -> int:
        return self.group.mesh_info.shard_mesh_rank

    def regathers(self) -> bool:
        """Whether backward gathers the parameters again (the unit resharded after forward, over
        its own shard group; FSDP2 decides the root's at the first forward)."""
        post = self.group.post_forward_mesh_info
        return post is not None and post is self.group.mesh_info

    def divide_factor(self) -> float:
        """What a reduced gradient is divided by: FSDP2's factor (the data-parallel size unless
        set), times an expert's expert-parallel degree (an expert-parallel trainer divides its
        experts' reduced gradients by it: they sum the tokens of every expert-parallel rank)."""
        factor = self.group.gradient_divide_factor
        factor = float(len(self.dp_ranks) if factor is None else factor)
        experts = {getattr(gp.fp.sharded_param, EXPERT, None) for gp in self.params} - {None}
        return factor * (max(experts) if experts else 1)


def fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """The FSDP2 units of ``model`` in module order (empty when nothing is sharded by FSDP2)."""
    names = {id(m): n for n, m in model.named_modules()}
    units = []
    for name, m in model.named_modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
        if group is None or state()._modules[0] is not m:
            continue
        unit = FSDPUnit(name, m, group)
        for fp in group.fsdp_params:
            info = fp._module_info
            owner = names.get(id(info.module), "")
            unit.params.append(GatheredParam(f"{owner}.{info.param_name}".lstrip("."), fp))
        units.append(unit)
    return units


def on_gathered(units: list[FSDPUnit], fn: Callable[[FSDPUnit, str], None]) -> list[RemovableHandle]:
    """Call ``fn(unit, pass)`` each time a unit's parameters were gathered for a training step:
    ``"forward"`` right after FSDP2's forward all-gather, ``"backward"`` right after its backward
    re-gather (a unit that does not reshard after forward is not gathered again). Nothing is
    called while gradients are off (evaluation). Returns the handles."""
    handles = []
    for unit in units:

        def pre(module, args, unit=unit):
            if torch.is_grad_enabled():
                fn(unit, "forward")

        def post(module, args, output, unit=unit):
            if not torch.is_grad_enabled():
                return
            t = _first_grad_tensor(output)
            if t is None:
                return
            done = []

            def pre_backward(grad, unit=unit):
                if not done and unit.regathers():
                    done.append(True)
                    fn(unit, "backward")

            t.register_hook(pre_backward)

        handles.append(unit.module.register_forward_pre_hook(pre))
        handles.append(unit.module.register_forward_hook(post))
    return handles


def after_reduce(units: list[FSDPUnit], fn: Callable[[], None]) -> list[RemovableHandle]:
    """Call ``fn()`` once per backward, after FSDP2's root post-backward callback (every
    reduce-scatter waited for, every sharded gradient in place). The root unit's output carries
    FSDP2's root pre-backward hook, which queues that callback; ours, registered after it on the
    same tensor, queues ``fn`` behind it."""
    if not units:
        return []
    root = next((u for u in units if u.name == ""), units[-1])  # the model itself, else the last unit

    def post(module, args, output):
        if not torch.is_grad_enabled():
            return
        t = _first_grad_tensor(output)
        if t is None:
            return
        queued = []

        def hook(grad):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(fn)

        t.register_hook(hook)

    return [root.module.register_forward_hook(post)]


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (list, tuple)):
        for x in output:
            t = _first_grad_tensor(x)
            if t is not None:
                return t
    if isinstance(output, dict):
        return _first_grad_tensor(list(output.values()))
    return None
