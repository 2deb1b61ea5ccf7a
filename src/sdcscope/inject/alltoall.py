"""Site ``comm.all_to_all``: corrupt what an expert-parallel MoE layer's all-to-all delivered.

An expert-parallel layer (:func:`~sdcscope.workloads.moe.shard_experts`) runs four all-to-alls a
step (:data:`~sdcscope.common.alltoall.CALLS`): the token rows out to the experts' ranks
(``dispatch``), the expert outputs back (``combine``), and their gradients the other way in
backward (``combine_grad``, ``dispatch_grad``); the spec's ``phase`` picks one (default
``dispatch``). ``direction: recv`` (the default) corrupts the chunk that arrived on ``rank`` from
rank ``source`` (a receiver or the link into it); ``send`` corrupts what left ``source`` for every
other rank, after the sender's digest (a sender's buffer or its NIC). The fault's pattern indexes
the chunk ``[rows, d]``.

Targets match the MoE layers' qualified names (``blocks.0.moe``). Whether a fault fires is
:func:`~sdcscope.faults.fires` of (spec, step, no micro-batch, layer, the rank the fault lives on
-- the source for ``send``); it fires once per step execution (the first micro-batch's call),
and a re-execution (a guard's replay) meets only permanent faults again. Every fired fault is
one record (``injections.jsonl``) with its link: ``src``, ``dst``, ``direction``, ``phase`` and
the rows of the chunk in the receiver's buffer (``elements``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from sdcscope.common.alltoall import Exchange, chunk_starts, exchanges
from sdcscope.faults import FaultSpec, apply_spec, fault_generator, fires
from sdcscope.inject.comm import StepFaults, numbered, record_firing
from sdcscope.inject.reexec import reexecuting


def moe_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s MoE layers (modules with an ``exchange`` slot: sharded or not)."""
    return [n for n, m in model.named_modules() if hasattr(m, "exchange") and hasattr(m, "experts")]


class AllToAllInjector(StepFaults):
    """The ``comm.all_to_all`` faults of one rank, as taps of the model's exchanges."""

    def __init__(
        self,
        model: nn.Module,
        specs: Iterable[FaultSpec],
        *,
        rank: int,
        log: str | Path | Callable[[dict], None] | None = None,
        spec_ids: Sequence[int] | None = None,
    ) -> None:
        specs = list(specs)
        self.exchanges = exchanges(model)
        if specs and not self.exchanges:
            raise ValueError(
                "site 'comm.all_to_all' corrupts an expert-parallel MoE all-to-all: the model exchanges no "
                "tokens (use --parallel ep or fsdp+ep with the moe workload)"
            )
        self.specs = numbered(specs, spec_ids)
        self._start(rank, log)
        self._removers = [ex.add("corrupt_send", self._send) for ex in self.exchanges]
        self._removers += [ex.add("corrupt_recv", self._recv) for ex in self.exchanges]

    def _live(self, spec: FaultSpec, ex: Exchange, call: str) -> bool:
        once = spec.schedule.kind != "permanent"
        return (
            self.armed
            and ex.training  # not an evaluation
            and (spec.phase or "dispatch") == call
            and spec.matches(ex.name)
            and spec.schedule.covers(self.step)
            and not (once and (self._repeat or reexecuting()))
        )

    def _send(self, ex: Exchange, call: str, buf: torch.Tensor, splits: list[int]) -> None:
        for i, spec in self.specs:
            if spec.direction != "send" or spec.source != self.rank or not self._live(spec, ex, call):
                continue
            starts = chunk_starts(splits)
            for j, dst in enumerate(ex.ranks):
                if dst != self.rank:
                    self._hit(i, spec, ex, call, buf, starts[j], splits[j], self.rank, dst)

    def _recv(self, ex: Exchange, call: str, buf: torch.Tensor, splits: list[int]) -> None:
        for i, spec in self.specs:
            if spec.direction == "send" or not self._live(spec, ex, call):
                continue
            if (spec.rank is not None and spec.rank != self.rank) or spec.source not in ex.ranks:
                continue
            j = ex.ranks.index(spec.source)
            self._hit(i, spec, ex, call, buf, chunk_starts(splits)[j], splits[j], spec.source, self.rank)

    def _hit(self, i, spec, ex, call, buf, start, n, src, dst) -> None:
        lives_on = src if spec.direction == "send" else self.rank
        key = (i, ex.name, call, dst, reexecuting())
        if n == 0 or key in self._fired or not fires(spec, self.step, None, ex.name, lives_on):
            return
        self._fired.add(key)
        gen = fault_generator(spec, self.step, None, ex.name, lives_on)
        with torch.no_grad():
            result = apply_spec(spec, buf[start : start + n], gen, step=self.step)
        link = {"phase": call, "src": src, "dst": dst, "direction": spec.direction or "recv"}
        when = "replay" if reexecuting() else "train"
        record_firing(self, i, spec, ex.name, result, when, **link, elements=[start, start + n], dim=0)

    def detach(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []
