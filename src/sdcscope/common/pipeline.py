"""Pipeline stages as the world, the checks and the fault sites see them: which stage a rank's
model is (:class:`StageInfo`, registered on the model by the engine), and the stage boundary,
where activations arrive from the previous stage and leave for the next one, and gradients flow
back the other way (:class:`StageBoundary`).

The boundary wraps the stage module that ``torch.distributed.pipelining`` runs: its forward sees
the activation that arrived (``recv``) and the one about to leave (``send``); hooks on those two
tensors see the gradient that arrived from the next stage and the one sent to the previous stage.
Taps attached to it (the exact p2p check, the ``comm.p2p`` fault site) see each transfer with its
``phase`` (``forward``: an activation, ``backward``: a gradient) and micro-batch. Wrapping the stage
module keeps to the library's public API: its send/recv internals are not patched.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class StageInfo:
    """One rank's place in a pipeline: stage ``stage`` of ``stages``, data-parallel coordinate
    ``dp_rank`` of ``dp`` (ranks are laid out stage-major: ``rank = stage · dp + dp_rank``)."""

    stage: int
    stages: int
    dp: int = 1
    dp_rank: int = 0
    schedule: str = "1f1b"
    micro_batches: int = 1
    rows: int = 1
    """Rows (samples) of one micro-batch: what the p2p check digests one by one."""
    boundaries: tuple[str, ...] = ()
    """The name of the activation stage ``s`` sends to stage ``s + 1`` (``stages - 1`` names)."""
    tied: tuple[int, ...] = field(default=(), compare=False)
    """``id()`` of this stage's parameters another stage holds a tied copy of (the GPT's head and
    embedding): their gradients are summed over the stages that hold them."""
    ties: bool = False
    """Some stages hold tied copies (every rank knows, whether its own stage does or not)."""
    fsdp: bool = False

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int, dp_rank: int | None = None) -> int:
        return stage * self.dp + (self.dp_rank if dp_rank is None else dp_rank)

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.dp

    @property
    def degrees(self) -> dict[str, int]:
        return {"pp": self.stages, **({"dp": self.dp} if self.dp > 1 or self.fsdp else {})}


_STAGES: weakref.WeakKeyDictionary[nn.Module, StageInfo] = weakref.WeakKeyDictionary()
_BOUNDARIES: weakref.WeakKeyDictionary[nn.Module, StageBoundary] = weakref.WeakKeyDictionary()


def stage_of(model: nn.Module) -> StageInfo | None:
    """The pipeline stage ``model`` is (None: it is no stage of a pipeline)."""
    return _STAGES.get(model)


def boundary_of(model: nn.Module) -> StageBoundary | None:
    """The boundary ``model``'s transfers pass (None: no pipeline stage)."""
    return _BOUNDARIES.get(model)


class Tap(Protocol):
    def arrived(self, phase: str, micro_batch: int, t: torch.Tensor) -> torch.Tensor | None: ...

    def sent(self, phase: str, micro_batch: int, t: torch.Tensor) -> None: ...


class StageBoundary(nn.Module):
    """The stage module ``module`` as the pipeline runs it, with its transfers tapped (see the
    module docstring). Micro-batches are counted by forward calls since :meth:`begin`: every
    schedule runs them in order."""

    def __init__(self, module: nn.Module, info: StageInfo) -> None:
        super().__init__()
        self.module, self.info = module, info
        self.taps: list[Tap] = []
        self.calls = 0
        self.on_micro_batch: list[Any] = []  # f(micro_batch): the micro-batch whose work runs next
        _STAGES[module] = info
        _BOUNDARIES[module] = self

    def add_tap(self, tap: Tap, *, first: bool = False) -> None:
        self.taps.insert(0, tap) if first else self.taps.append(tap)

    def remove_tap(self, tap: Tap) -> None:
        if tap in self.taps:
            self.taps.remove(tap)

    def begin(self) -> None:
        """Before a schedule's run of one step (or its replay)."""
        self.calls = 0

    def _at(self, m: int) -> None:
        for f in self.on_micro_batch:
            f(m)

    def _arrive(self, phase: str, m: int, t: torch.Tensor) -> torch.Tensor:
        for tap in self.taps:
            out = tap.arrived(phase, m, t)
            t = t if out is None else out
        return t

    def _send(self, phase: str, m: int, t: torch.Tensor) -> None:
        for tap in self.taps:
            tap.sent(phase, m, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # the library's shape inference
            return self.module(x)
        m = self.calls
        self.calls += 1
        self._at(m)
        info = self.info
        if not info.first:
            with torch.no_grad():
                d = x.detach()
                got = self._arrive("forward", m, d)
                if got is not d:
                    d.copy_(got)  # what arrived is what the stage computes with
            if x.requires_grad:
                x.register_hook(lambda g, m=m: self._send("backward", m, g.detach()))
        out = self.module(x)
        if not info.last:
            self._send("forward", m, out.detach())

            def grad_arrived(g: torch.Tensor, m: int = m) -> torch.Tensor:
                self._at(m)
                d = g.detach()
                got = self._arrive("backward", m, d)
                return g if got is d else got

            out.register_hook(grad_arrived)
        return out


__all__ = ["StageBoundary", "StageInfo", "Tap", "boundary_of", "stage_of"]
