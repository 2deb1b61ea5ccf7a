"""Optimizer state a fault can land on: the state tensors with a value per element of a parameter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def state_keys(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> tuple[str, ...] | None:
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
    return tuple(
        sorted(
            k
            for k, v in state.items()
            if k not in COUNTERS and isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == param.shape
        )
    )
