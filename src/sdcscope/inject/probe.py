"""Probe a model: every call of every named module in one forward pass (and evaluation pass) on a
throwaway copy, with the shapes and dtypes of the tensors a fault would land on there -- a module's
output, the gradient a GEMM call hands on to an operand -- which are known only once it ran."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from sdcscope.common.graph import operand_grad_edge, weight_grad_edge
from sdcscope.common.modules import has_weight_operand, is_gemm
from sdcscope.faults import FaultSpec
from sdcscope.inject.targets import primary_output


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _info(x: Any) -> TensorInfo | None:
    return TensorInfo(tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else None


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


def probe_model(
    model: nn.Module, forward: Callable[[nn.Module], Any], evaluate: Callable[[nn.Module], Any] | None = None
) -> dict[str, list[ModuleCall]]:
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
            calls[name].append(
                ModuleCall(_info(primary_output(output)[0]), tuple(_info(a) for a in args), grad, operands, evaluating)
            )

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


EVAL_SITES = ("activation", "gemm.forward", "dispatch")
"""Module sites that act in an evaluation pass (a forward without autograd), by a permanent fault."""


def evaluated(specs: list[FaultSpec]) -> bool:
    """Whether a fault of ``specs`` acts in evaluation on a tensor only a probe knows the shape of (a
    permanent fault on a module output): then probe the evaluation too (:func:`probe_model`'s
    ``evaluate``)."""
    return any(s.site in EVAL_SITES and s.schedule.kind == "permanent" for s in specs)
