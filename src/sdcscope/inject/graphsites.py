"""The graph-mode half of :class:`~sdcscope.inject.Injector` (``graph=True``): when the GEMM
faults carried by the wrappers of :mod:`sdcscope.inject.graph` are armed, and their records.

The host arms a descriptor in :meth:`Injector.set_position` for the micro-batch where its fault
fires (the injector's own ``_fires``: schedule, rank, micro-batch, evaluation) and writes the
record then; otherwise the descriptor is the identity. A transient or intermittent fault is one
event in time: it is disarmed once its micro-batch's backward is done
(:meth:`micro_batch_done`, which the engine callback calls), when a re-execution begins
(:func:`~sdcscope.inject.reexecution` disarms it in every graph-mode injector of the process,
before the replay's forward) and never armed during one; a permanent fault acts on every
execution. The shape and dtype of Y / dX / dW are learnt from the site's calls; a fault due
before its site ran (the first forward) is refused, unless a ``probe`` gave them or it is the dW
of a Linear (the weight's shape; its compute dtype is not known yet, so the descriptor of every
compute dtype the GEMM may run in is armed, and a dtype the spec does not fit raises as soon as
the GEMM is seen to have run in it).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from sdcscope.faults import FaultSpecError
from sdcscope.inject.graph import (
    GRAPH_SITES,
    Entry,
    GraphResult,
    channel_dim,
    descriptor,
    install,
    refusal,
    uninstall,
    write,
)
from sdcscope.inject.validate import _views

log = logging.getLogger("sdcscope.inject.graph")

_GRAPH_INJECTORS: weakref.WeakSet = weakref.WeakSet()
"""Attached graph-mode injectors, which a re-execution disarms before its forward."""


def disarm_for_reexecution() -> None:
    """A re-execution begins: no transient or intermittent graph fault may act in it."""
    for inj in list(_GRAPH_INJECTORS):
        inj._graph_disarm(once_only=True)


class GraphSites:
    """Graph-mode state and arming of an :class:`~sdcscope.inject.Injector`, which provides
    ``specs``, ``targets``, the position and ``_fires``, ``_apply``, ``_record``, ``_reached``."""

    def _graph_setup(self, graph: bool, probe: dict[str, list[Any]] | None) -> None:
        """Refuse, before any work, what graph mode cannot carry (naming spec, site, module)."""
        self.graph = graph
        self._graph_probe = probe
        self._graph_entries: list[Entry] = []
        self._graph_specs: set[int] = set()
        self._graph_rows_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graph_warned: set[tuple] = set()
        if not graph:
            return
        for i, spec in enumerate(self.specs):
            for t in self.targets[i]:
                why = refusal(spec, t) if t.module is not None else None
                if why:
                    raise ValueError(f"fault spec #{i} ({spec.site} on {', '.join(spec.target)}): graph mode: {why}")
            if spec.site in GRAPH_SITES:
                self._graph_specs.add(i)

    def _graph_attach(self) -> None:
        """Install the wrappers of every graph spec now (installing one later changes the graph)."""
        if not self._graph_specs:
            return
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self._graph_entries = install(
            [(i, self.specs[i], t) for i in sorted(self._graph_specs) for t in self.targets[i]], device
        )
        _GRAPH_INJECTORS.add(self)
        self._graph_arm()

    def _graph_detach(self) -> None:
        uninstall(self._graph_entries)
        self._graph_entries = []
        _GRAPH_INJECTORS.discard(self)

    def micro_batch_done(self) -> None:
        """Call after each micro-batch's backward (the engine callback does): the transient and
        intermittent graph faults that acted in it are disarmed, so a re-execution of the step
        (a guard's replay) does not meet them again. Nothing to do without graph mode."""
        self._graph_disarm(once_only=True)

    def _graph_disarm(self, once_only: bool) -> None:
        for e in self._graph_entries:
            if e.armed and not (once_only and e.spec.schedule.kind == "permanent"):
                self._graph_check(e)
                self._graph_disarm_entry(e)

    @staticmethod
    def _graph_disarm_entry(e: Entry) -> None:
        for dt in list(e.armed):
            write(e, dt, None)
        e.armed.clear()
        e.failed.clear()

    def _graph_check(self, e: Entry) -> None:
        """After an armed execution: a guessed dtype the spec did not fit, which the GEMM turned out
        to run in, raises (the fault did not act where it was due); a shape that changed since the
        descriptor was resolved is warned about (the fault landed modulo the new size)."""
        seen = e.shapes(e.training)
        for dt, exc in e.failed.items():
            if dt in seen:
                raise exc
        for dt, shape in e.armed.items():
            key = (e.i, e.target.name, dt, seen.get(dt))
            if dt in seen and seen[dt] != shape and key not in self._graph_warned:
                self._graph_warned.add(key)
                log.warning(
                    "graph mode: fault spec #%d (%s on %r) was resolved for shape %s, but the site's last "
                    "call had shape %s: its flat indices landed modulo the new size",
                    e.i,
                    e.spec.site,
                    e.target.name,
                    list(shape),
                    list(seen[dt]),
                )

    def _graph_arm(self) -> None:
        """Arm the descriptors of the graph faults that fire at the current position (and record
        them); make the others the identity."""
        here = (self.step, self.micro_batch, self.evaluating)
        for e in self._graph_entries:
            if e.armed and e.position == here:  # armed (and recorded) for this event already
                continue
            if e.armed:
                self._graph_check(e)
            if not self._fires(e.spec, e.target):
                self._graph_disarm_entry(e)
                continue
            index = None
            e.failed.clear()
            for dt, (shape, strict) in self._graph_shapes(e).items():
                try:
                    got, rows = self._graph_rows(e, shape, dt)
                except FaultSpecError as exc:
                    if strict:
                        raise
                    e.failed[dt] = exc
                    write(e, dt, None)
                    e.armed.pop(dt, None)
                    continue
                write(e, dt, rows)
                e.armed[dt] = shape
                index = got if index is None else index
            e.position = here
            self._reached.add(e.i)
            self._record(e.i, e.spec, e.target.name, GraphResult(index), graph=True)

    def _graph_shapes(self, e: Entry) -> dict[torch.dtype, tuple[tuple[int, ...], bool]]:
        """``dtype -> (shape, strict)`` to arm ``e`` for: the site's calls seen, else the probe's,
        else (a Linear's dW) the weight's shape in every compute dtype it may run in (strict: the
        weight's own); a ``strict`` dtype the spec does not fit raises at once."""
        e.training = not self.evaluating  # an evaluation pass runs the model in eval mode (its batches
        # may be shaped otherwise); before its first one, the training calls' shapes stand in
        seen = e.shapes(e.training) or e.shapes(not e.training)
        if seen:
            return {dt: (shape, True) for dt, shape in seen.items()}
        spec, t = e.spec, e.target
        if self._graph_probe is not None and t.name in self._graph_probe:
            dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
            views = _views(spec, t, self._graph_probe[t.name], dtype)
            known = {dt: (shape, True) for shape, dt, _ in views if shape is not None}
            if known:
                return known
        if spec.site == "gemm.grad_weight" and isinstance(t.module, nn.Linear):
            w = t.module.weight
            shape = tuple(w.shape)
            return {
                w.dtype: (shape, True),
                **{dt: (shape, False) for dt in (torch.bfloat16, torch.float16) if dt != w.dtype},
            }
        what = {"gemm.forward": "Y", "gemm.grad_input": "dX", "gemm.grad_weight": "d b"}[spec.site]
        raise FaultSpecError(
            f"fault spec #{e.i} ({spec.site} on {t.name!r}) is due at step {self.step} (micro-batch "
            f"{self.micro_batch}), before graph mode has seen the shape of the module's {what}: it is learnt "
            "from the module's first call. Schedule the fault from a later step, or pass "
            "Injector(..., probe=sdcscope.inject.probe_model(model, forward))"
        )

    def _graph_rows(self, e: Entry, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The event's descriptor rows, resolved with the injector's ``_apply`` (cached for a
        fault whose draws do not change with the step: one that recurs, unless it swizzles)."""
        spec, t = e.spec, e.target
        key = (e.i, t.name, shape, dtype)
        cache = spec.schedule.recurs and not spec.pattern.swizzled
        if cache and key in self._graph_rows_cache:
            return self._graph_rows_cache[key]
        cd = channel_dim(spec.site, t.module)
        got = descriptor(lambda x: self._apply(spec, t, x, channel_dim=cd), spec, shape, dtype)
        if cache:
            self._graph_rows_cache[key] = got
        return got
