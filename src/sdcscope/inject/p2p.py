"""Site ``comm.p2p``: corrupt what a pipeline's send/recv delivered, on the rank it arrived on.

``rank`` is the destination, ``source`` the neighbouring stage's rank it came from; ``phase``
``forward`` (the default: the activation ``source`` sent on) or ``backward`` (the gradient
``source`` sent back). The fault lands at the stage boundary
(:class:`~sdcscope.common.pipeline.StageBoundary`) before the stage computes with it, so the
receiver's digest sees what arrived and the sender's what left. Targets match the boundary
activation's name (the output of the sending side's last block, e.g. ``blocks.0``). Whether it
fires is :func:`~sdcscope.faults.fires` of (spec, step, micro-batch, tensor, destination rank);
a re-execution (a guard's replay) meets only permanent faults again. Each firing is one record
with its link: ``src``, ``dst``, ``phase``, ``micro_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sdcscope.common.pipeline import StageBoundary
from sdcscope.faults import FaultSpec, apply_spec, fault_generator, fires
from sdcscope.inject.comm import StepFaults, numbered, record_firing
from sdcscope.inject.reexec import reexecuting

SITE = "comm.p2p"


def link_of(boundary: StageBoundary, phase: str) -> tuple[int | None, str | None]:
    """``(source rank, tensor name)`` of what arrives at ``boundary``'s stage in ``phase`` (None:
    nothing arrives there: the first stage's forward, the last stage's backward)."""
    info = boundary.info
    if phase == "forward":
        return (None, None) if info.first else (info.rank_of(info.stage - 1), info.boundaries[info.stage - 1])
    return (None, None) if info.last else (info.rank_of(info.stage + 1), info.boundaries[info.stage])


def check_p2p_spec(spec: FaultSpec, boundary_names: Sequence[str], stages: int, dp: int) -> None:
    """Refuse (ValueError) a ``comm.p2p`` spec whose link is no link of the pipeline
    (:func:`check_p2p_link`) or whose target is no boundary activation."""
    check_p2p_link(spec, stages, dp)
    if not any(map(spec.matches, boundary_names)):
        raise ValueError(
            f"comm.p2p target {list(spec.target)} matches no boundary activation; allowed: {list(boundary_names)}"
        )


def check_p2p_link(spec: FaultSpec, stages: int, dp: int) -> None:
    """Refuse (ValueError) a ``comm.p2p`` spec whose ``source`` is not the destination's
    neighbouring stage (the previous one for ``forward``, the next for ``backward``) in a pipeline
    of ``stages`` stages of ``dp`` ranks each (the spec itself checked rank and direction)."""
    phase = spec.phase or "forward"
    stage, d = divmod(spec.rank, dp)
    neighbour = stage - 1 if phase == "forward" else stage + 1
    if not 0 <= neighbour < stages:
        raise ValueError(
            f"rank {spec.rank} is pipeline stage {stage} of {stages}: nothing arrives there in the {phase} phase "
            f"(activations flow from stage s to s + 1, gradients back)"
        )
    if spec.source != neighbour * dp + d:
        raise ValueError(
            f"source {spec.source} does not send to rank {spec.rank} in the {phase} phase; its neighbour is rank "
            f"{neighbour * dp + d} (pipeline stage {neighbour})"
        )


class P2PInjector(StepFaults):
    """The ``comm.p2p`` faults of one rank, a tap on its stage boundary (first: before the checks)."""

    def __init__(
        self,
        boundary: StageBoundary,
        specs: Sequence[FaultSpec],
        *,
        rank: int,
        log: Callable[[dict], None] | None = None,
        spec_ids: Sequence[int] | None = None,
    ) -> None:
        self.boundary = boundary
        self.specs = [(i, s) for i, s in numbered(specs, spec_ids) if s.rank == rank]
        self._start(rank, log)
        boundary.add_tap(self, first=True)

    @torch.no_grad()
    def arrived(self, phase: str, m: int, t: torch.Tensor) -> torch.Tensor | None:
        src, name = link_of(self.boundary, phase)
        for i, spec in self.specs:
            once = spec.schedule.kind != "permanent"
            if (spec.phase or "forward") != phase or spec.source != src:
                continue
            if once and (self._repeat or reexecuting()):
                continue
            if not fires(spec, self.step, m, name, self.rank):
                continue
            gen = fault_generator(spec, self.step, m, name, self.rank)
            result = apply_spec(spec, t, gen, step=self.step)
            when = "replay" if reexecuting() else "train"
            record_firing(self, i, spec, name, result, when, phase=phase, src=src, dst=self.rank, micro_batch=m)
        return None

    def sent(self, phase: str, m: int, t: torch.Tensor) -> None:
        return None

    def detach(self) -> None:
        self.boundary.remove_tap(self)
