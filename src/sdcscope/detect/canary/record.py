"""One recorded call of a canary op: which rows it samples, the operands and results it keeps
(those rows only, plus the non-row arguments by reference), and the gradient hooks that keep the
sampled rows of dY and of the op's own dX (a hook on a view of each row argument: its gradient is
this op's share, not the sum over the argument's other uses)."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from sdcscope.detect.canary.ops import CanaryOp

OUT = -1
"""The tap slot of the op's output (the inputs' slots are their argument positions)."""


def sample_rows(seed: int, step: int, name: str, number: int, total: int, rows: int, last: bool) -> list[int]:
    """``rows`` of ``total`` row numbers drawn from (seed, step, op name, call number) -- a replay of
    the step draws the same -- plus the last row when ``last``; sorted."""
    rng = random.Random(f"{seed}/{step}/{name}/{number}")  # str seeds hash with sha512: the same in every process
    picked = set(rng.sample(range(total), min(rows, total)))
    if last:
        picked.add(total - 1)
    return sorted(picked)


def row_index(rows: list[int], lead: torch.Size, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Advanced-indexing tensors for the flat row numbers ``rows`` over the leading dims ``lead``."""
    cols: list[list[int]] = [[] for _ in lead]
    for flat in rows:
        for d in range(len(lead) - 1, -1, -1):
            flat, r = divmod(flat, lead[d])
            cols[d].append(r)
    return tuple(torch.tensor(c, device=device) for c in cols)


def _tap(x: torch.Tensor, call: Call, slot: int) -> torch.Tensor:
    """``x`` (an input: a view of it, whose gradient is this op's share alone) with a hook that
    hands the sampled rows of its gradient to ``call``."""
    tapped = x.view_as(x) if slot != OUT else x
    tapped.register_hook(lambda grad: call.took_grad(slot, grad))
    return tapped


def _fp32(value: Any) -> Any:
    """A low-precision floating tensor in fp32 (fp32 and fp64 stay as they are), detached."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.float() if value.is_floating_point() and value.element_size() < 4 else value


class Call:
    """One call: opened before the op runs (its inputs tapped for a backward check), closed after
    with its output (the rows sampled and kept)."""

    def __init__(self, op: CanaryOp, step: int, number: int, args: tuple, backward: bool) -> None:
        self.op, self.step, self.number = op, step, number
        self.rows: list[int] = []
        self.index: tuple[torch.Tensor, ...] | None = None
        self.args: list[Any] = []
        """The reference's arguments: the row arguments' sampled rows, the others whole (fp32)."""
        self.kwargs: dict[str, Any] = {}
        self.out_rows: torch.Tensor | None = None
        self.grad_out: torch.Tensor | None = None
        self.grad_in: dict[int, torch.Tensor] = {}
        self.grad_dtype: dict[int, torch.dtype] = {}
        self.shape: dict[str, Any] | None = None
        """A shape finding: the output's rows differ from a row argument's."""
        self.tapped: tuple[int, ...] = ()
        self.args_in = args
        if backward and torch.is_grad_enabled():
            tapped = [
                i
                for i in op.row_args
                if i < len(args)
                and isinstance(args[i], torch.Tensor)
                and args[i].is_floating_point()
                and args[i].requires_grad
            ]
            if tapped:
                self.tapped = tuple(tapped)
                self.args_in = tuple(_tap(a, self, i) if i in tapped else a for i, a in enumerate(args))

    def close(self, args: tuple, kwargs: dict, out: torch.Tensor, rows: int, last: bool, seed: int) -> torch.Tensor:
        """Sample and keep the rows of ``out`` and of the row arguments; returns ``out`` (tapped
        for a backward check)."""
        op, self.args_in = self.op, ()  # the whole inputs are not kept
        rd = op.row_dims or max(out.dim() - 1, 1)
        if out.dim() < rd:
            raise ValueError(f"its output has shape {tuple(out.shape)}: no {rd} leading row dims (give row_dims)")
        lead = out.shape[:rd]
        for i in op.row_args:
            if i >= len(args) or not isinstance(args[i], torch.Tensor):
                raise ValueError(f"row_args names argument {i}, which is no tensor of this call")
            if tuple(args[i].shape[:rd]) != tuple(lead):
                self.shape = {"output_rows": list(lead), "input": i, "input_rows": list(args[i].shape[:rd])}
                return out
        total = math.prod(lead)
        if total == 0:
            return out
        self.rows = sample_rows(seed, self.step, op.name, self.number, total, rows, last)
        self.index = ix = row_index(self.rows, lead, out.device)
        self.out_rows = out.detach()[ix]
        self.args = [_fp32(a.detach()[ix]) if i in op.row_args else _fp32(a) for i, a in enumerate(args)]
        self.kwargs = {k: _fp32(v) for k, v in kwargs.items()}
        if self.tapped and out.requires_grad:
            return _tap(out, self, OUT)
        self.tapped = ()
        return out

    def took_grad(self, slot: int, grad: torch.Tensor) -> None:
        """A tap's backward: keep the sampled rows of the gradient at ``slot``."""
        if self.index is None or grad is None:
            return
        rows = grad.detach()[self.index]
        if slot == OUT:
            self.grad_out = rows
        else:
            self.grad_in[slot], self.grad_dtype[slot] = rows, grad.dtype
