"""The all-to-all of an expert-parallel MoE layer as the checks and the fault sites see it.

An expert-parallel layer moves its token rows to the ranks that own their experts and the
experts' outputs back (``dispatch`` and ``combine``), and autograd moves their gradients the
other way (``combine_grad``, ``dispatch_grad``): four calls of ``all_to_all_single`` a step,
each moving bits unchanged. :class:`Exchange` runs them (:meth:`Exchange.move`, autograd
through both directions) and calls its taps around every transfer:

- ``before_send(exchange, call, buf, send_splits)`` on the sender's buffer (row chunk ``r`` goes
  to rank ``r``), then ``corrupt_send`` (a fault on what leaves, after the sender's digest);
- ``corrupt_recv(exchange, call, buf, recv_splits)`` on what arrived (chunk ``s`` from rank
  ``s``), then ``after_recv`` (the receiver's digest, after a fault on what arrived).

So a check (``before_send`` / ``after_recv``) always sees the sender's bits and the receiver's,
and a fault always lands between them, whatever order the check and the injector attached in.
A parameter owned by one expert-parallel rank carries :data:`EXPERT` (its expert-parallel
degree): the world's placement arithmetic counts it once (:meth:`World.replicas
<sdcscope.common.world.World.replicas>`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CALLS = ("dispatch", "combine", "combine_grad", "dispatch_grad")
"""The all-to-alls of an expert-parallel layer in one step, in the order they run."""
TAPS = ("before_send", "corrupt_send", "corrupt_recv", "after_recv")
EXPERT = "_sdcscope_expert_parallel"
"""Attribute of an expert's parameter: the expert-parallel degree it is sharded over."""

Tap = Callable[["Exchange", str, torch.Tensor, list[int]], None]


class Exchange:
    """The all-to-all of one MoE layer (``name``) over ``group``: its ranks in group order
    (``ranks[i]`` the global rank of group rank ``i``) and its taps (see the module docstring)."""

    def __init__(self, name: str, group: Any, ranks: list[int], rank: int) -> None:
        self.name, self.group, self.ranks = name, group, list(ranks)
        self.rank = rank
        """This process's global rank."""
        self.taps: dict[str, list[Tap]] = {t: [] for t in TAPS}
        self.training = False
        """Whether the current call is part of a training step (autograd records it; its backward
        too), not an evaluation under ``torch.no_grad()``."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def add(self, tap: str, fn: Tap) -> Callable[[], None]:
        """Call ``fn`` at ``tap``; returns the function that removes it."""
        self.taps[tap].append(fn)
        return lambda: self.taps[tap].remove(fn) if fn in self.taps[tap] else None

    def move(self, x: torch.Tensor, send: list[int], recv: list[int], call: str) -> torch.Tensor:
        """Rows ``x`` [sum(send), d] out, chunk ``i`` to group rank ``i``; returns what arrived,
        [sum(recv), d], chunk ``i`` from group rank ``i``. Backward moves the gradient back
        (the ``*_grad`` call of ``call``)."""
        assert call in ("dispatch", "combine"), call
        self.training = torch.is_grad_enabled()  # (a Function's forward runs with grad off)
        return _AllToAll.apply(x, self, send, recv, call)

    def run(self, x: torch.Tensor, send: list[int], recv: list[int], call: str) -> torch.Tensor:
        """One transfer with its taps (no autograd)."""
        import torch.distributed as dist

        x = x.contiguous()
        for fn in self.taps["before_send"]:
            fn(self, call, x, send)
        if self.taps["corrupt_send"]:
            x = x.clone()  # the fault is on what leaves, not on the sender's own tensor
            for fn in self.taps["corrupt_send"]:
                fn(self, call, x, send)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x, recv, send, group=self.group)
        for tap in ("corrupt_recv", "after_recv"):
            for fn in self.taps[tap]:
                fn(self, call, out, recv)
        return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange, send, recv, call):
        ctx.exchange, ctx.send, ctx.recv, ctx.call = exchange, send, recv, call
        return exchange.run(x, send, recv, call)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.run(grad, ctx.recv, ctx.send, f"{ctx.call}_grad"), None, None, None, None


def exchanges(model: nn.Module) -> list[Exchange]:
    """The expert-parallel exchanges of ``model``'s MoE layers, in module order (empty: none)."""
    return [m.exchange for m in model.modules() if isinstance(getattr(m, "exchange", None), Exchange)]


def chunk_starts(splits: list[int]) -> list[int]:
    """The first row of each chunk of a buffer split into ``splits``."""
    out, at = [], 0
    for n in splits:
        out.append(at)
        at += n
    return out


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert's parameter owned by one expert-parallel rank."""
    return getattr(p, EXPERT, None) is not None


__all__ = ["CALLS", "EXPERT", "Exchange", "chunk_starts", "exchanges", "is_expert"]
