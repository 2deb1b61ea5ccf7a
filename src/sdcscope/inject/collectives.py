"""Sites ``comm.all_gather`` and ``comm.reduce_scatter``: corrupt what one of FSDP2's collectives
delivered, on the rank it arrived on.

- ``comm.all_gather``: in the gathered (unsharded) parameter, the part that came from rank
  ``source``, right after FSDP2's ``forward`` all-gather or its ``backward`` re-gather
  (``phase``). ``direction: recv`` (the default) corrupts it on ``rank`` only (a receiver or the
  link into it); ``direction: send`` corrupts every rank's copy alike (what left the source).
  The fault's pattern indexes the source's part, shaped as its shard.
- ``comm.reduce_scatter``: the reduced gradient shard that arrived on ``rank``, after every
  reduce-scatter of the backward pass has landed and before the optimizer reads it.

Targets match the parameters' qualified names. Hooks run after FSDP2's own
(:mod:`sdcscope.common.fsdp`) and are removable; whether a fault fires is
:func:`~sdcscope.faults.fires` of (spec, step, no micro-batch, parameter, the rank the fault
lives on -- the source for ``send``), so every rank decides alike and a ``send`` fault draws the
same elements on every receiver. A fault fires once per step execution (the first micro-batch's
gather); a re-execution (a guard's replay) meets only permanent faults again. Every fired fault
is one record (``injections.jsonl``) with its link: ``src``, ``dst``, ``direction``, ``phase``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.fsdp import FSDPUnit, after_reduce, fsdp_units, on_gathered
from sdcscope.common.validate import close_matches
from sdcscope.common.world import local
from sdcscope.faults import FaultSpec, FaultSpecError, apply_spec, check_spec, fault_generator, fires
from sdcscope.faults.vocab import COLLECTIVE_SITES
from sdcscope.inject.comm import StepFaults, numbered, record_firing
from sdcscope.inject.reexec import reexecuting
from sdcscope.inject.validate import check_schedule


def is_collective(spec: FaultSpec) -> bool:
    """A fault on a collective: FSDP2's (:class:`CollectiveInjector`) or an MoE all-to-all's
    (:class:`~sdcscope.inject.alltoall.AllToAllInjector`)."""
    return spec.site in COLLECTIVE_SITES


def check_collective_specs(
    model: nn.Module,
    specs: Sequence[FaultSpec],
    *,
    world_size: int,
    steps: int | None = None,
    grad_accum: int | None = None,
    spec_ids: Sequence[int] | None = None,
) -> None:
    """Refuse, before any rank starts, a collective spec that cannot be applied to ``model`` (the
    unsplit module): its ranks, targets, schedule and the fit of bits and pattern to the parts
    it lands on (a parameter's shard, as FSDP2 splits it over ``world_size`` ranks along dim 0).
    Errors name the spec by its id (``spec_ids``, default 0..n-1)."""
    params = dict(model.named_parameters())
    for i, spec in numbered(specs, spec_ids):
        try:
            if not is_collective(spec):
                raise ValueError(f"site {spec.site!r} is not one of {list(COLLECTIVE_SITES)}")
            for what, r in (("rank", spec.rank), ("source", spec.source)):
                if r is not None and r >= world_size:
                    raise ValueError(f"{what} {r} does not exist; allowed: 0..{world_size - 1}")
            check_schedule(spec, steps, grad_accum)
            if spec.site == "comm.all_to_all":
                _check_all_to_all(model, spec)
                continue
            matched = [n for n in params if spec.matches(n)]
            if not matched:
                close = [c for t in spec.target for c in close_matches(t, list(params), n=5, cutoff=0.5)]
                hint = f"; close names: {', '.join(dict.fromkeys(close))}" if close else ""
                raise ValueError(f"{spec.site} target {list(spec.target)} matches no parameter{hint}")
            for name in matched:
                p = params[name]
                rows = -(-p.shape[0] // world_size) if p.dim() else 1
                shape = (rows, *p.shape[1:]) if p.dim() else (1,)
                try:
                    check_spec(spec, p.dtype, shape)
                except FaultSpecError as exc:
                    raise FaultSpecError(f"{name!r} (a shard of shape {list(shape)}): {exc}") from None
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"fault spec #{i} ({spec.site} on {', '.join(spec.target)}): {exc}") from None


def _check_all_to_all(model: nn.Module, spec: FaultSpec) -> None:
    """A ``comm.all_to_all`` spec's targets are MoE layers; its bits fit the rows they move."""
    from sdcscope.inject.alltoall import moe_layers

    layers = moe_layers(model)
    if not layers:
        raise ValueError("site 'comm.all_to_all' needs a mixture-of-experts model (--workload moe): this one has none")
    if not any(spec.matches(n) for n in layers):
        raise ValueError(f"comm.all_to_all target {list(spec.target)} matches no MoE layer; MoE layers: {layers}")
    dtype = next(model.get_submodule(layers[0]).parameters()).dtype
    check_spec(spec, dtype)


class CollectiveInjector(StepFaults):
    """The collective faults of one rank, hooked onto ``model``'s FSDP2 units."""

    def __init__(
        self,
        model: nn.Module,
        specs: Iterable[FaultSpec],
        *,
        rank: int,
        world_size: int,
        log: str | Path | Callable[[dict], None] | None = None,
        spec_ids: Sequence[int] | None = None,
    ) -> None:
        specs = list(specs)
        self.units: list[FSDPUnit] = fsdp_units(model)
        if specs and not self.units:
            raise ValueError(
                f"sites {sorted({s.site for s in specs})} corrupt FSDP2's collectives: the model has no "
                "fully_shard unit (use --parallel fsdp or hsdp)"
            )
        self.specs = numbered(specs, spec_ids)
        for _, spec in self.specs:
            for unit in self.units:
                for gp in unit.params:
                    if spec.matches(gp.name) and spec.site == "comm.all_gather" and gp.shard_dim != 0:
                        raise ValueError(f"{gp.name!r} is sharded on dim {gp.shard_dim}: comm.all_gather needs dim 0")
        self._start(rank, log)
        self.handles = on_gathered(self.units, self._gathered)
        if any(s.site == "comm.reduce_scatter" for _, s in self.specs):
            self.handles += after_reduce(self.units, self._reduced)

    def _live(self, spec: FaultSpec) -> bool:
        once = spec.schedule.kind != "permanent"
        return self.armed and spec.schedule.covers(self.step) and not (once and (self._repeat or reexecuting()))

    @torch.no_grad()
    def _gathered(self, unit: FSDPUnit, phase: str) -> None:
        for i, spec in self.specs:
            if spec.site != "comm.all_gather" or (spec.phase or "forward") != phase or not self._live(spec):
                continue
            send = spec.direction == "send"
            lives_on = spec.source if send else self.rank
            if not send and spec.rank is not None and spec.rank != self.rank:
                continue
            for gp in unit.params:
                key = (i, phase, gp.name, reexecuting())
                if not spec.matches(gp.name) or key in self._fired:
                    continue
                if not fires(spec, self.step, None, gp.name, lives_on):
                    continue
                rows = gp.gathered()
                slot = unit.shard_ranks.index(spec.source) if spec.source in unit.shard_ranks else None
                if rows is None or slot is None:
                    continue
                shape = gp.source_shape(slot)
                n = int(torch.Size(shape).numel())
                if n == 0:
                    continue
                self._fired.add(key)
                part = rows[slot, :n].view(shape)
                gen = fault_generator(spec, self.step, None, gp.name, lives_on)
                # as FSDP2 writes a re-gather: autograd saved the parameter in forward, and the
                # values changing under it is the fault, not a use error
                with torch.autograd._unsafe_preserve_version_counter(gp.fp.all_gather_outputs[0]):
                    result = apply_spec(spec, part, gen, step=self.step)
                start, stop = gp.source_range(slot)
                extra = {"phase": phase, "src": spec.source, "dst": self.rank, "direction": spec.direction or "recv"}
                self._record(i, spec, gp.name, {**extra, "elements": [start, stop], "dim": gp.shard_dim}, result)

    @torch.no_grad()
    def _reduced(self) -> None:
        for i, spec in self.specs:
            if spec.site != "comm.reduce_scatter" or not self._live(spec):
                continue
            if spec.rank is not None and spec.rank != self.rank:
                continue
            for unit in self.units:
                for gp in unit.params:
                    key = (i, gp.name, reexecuting())
                    grad = gp.fp.sharded_param.grad
                    if not spec.matches(gp.name) or grad is None or key in self._fired:
                        continue
                    if not fires(spec, self.step, None, gp.name, self.rank):
                        continue
                    self._fired.add(key)
                    part = local(grad)
                    if part.numel() == 0:
                        continue
                    gen = fault_generator(spec, self.step, None, gp.name, self.rank)
                    result = apply_spec(spec, part, gen, step=self.step)
                    start, stop = gp.source_range(unit.shard_rank)
                    extra = {"phase": None, "src": None, "dst": self.rank, "direction": "recv"}
                    self._record(i, spec, gp.name, {**extra, "elements": [start, stop], "dim": gp.shard_dim}, result)

    def _record(self, i: int, spec: FaultSpec, name: str, link: dict[str, Any], result) -> None:
        record_firing(self, i, spec, name, result, "replay" if reexecuting() else "train", **link)

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
