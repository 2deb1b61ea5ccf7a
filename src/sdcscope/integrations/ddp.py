"""What the trainer adapters share under data parallelism (DDP): the rank guard's replay of a
suspect rank's step.

Under DDP each rank's :class:`~sdcscope.guard.Guard` is built with ``ddp=`` (the trainer's
``DistributedDataParallel`` wrapper): its rank section (:mod:`sdcscope.guard.ranks`) shares every
rank's findings, localizes them by replay and takes one decision, the same on every rank. To
localize a finding the rank guard replays the suspect rank's step twice, on the suspect itself
and on a healthy peer, without collectives (:class:`~sdcscope.localize.ranks.RankLocalizer`).
The engine's trainer can rebuild any rank's batch from the seed; a library trainer's ranks hold
only their own batches, so :class:`RankReplay` keeps the open step's micro-batches and, when a
replay asks for them, the suspect sends them to its peer (point to point: nothing travels on a
step without a finding). Importing this module imports neither library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sdcscope.guard import Guard
from sdcscope.inject import reexecution

__all__ = ["RankReplay"]


class RankReplay:
    """The rank guard's ``replay(r)`` for a library trainer: rank r's local gradient of the open
    step, into ``.grad``, on the plain module (no all-reduce), as a re-execution (transient
    faults do not fire again, permanent ones do).

    ``run(batches)``: the step's forward and backward on the plain module over ``batches`` (the
    list :meth:`add` collected, possibly another rank's), returning the step's loss. The suspect
    sends its micro-batches to the peers that replay it (the plan of :class:`~sdcscope.localize.ranks.RankLocalizer`);
    both sides of that exchange are in the replay calls the localizer makes, in the same order
    on every rank, so the point-to-point messages pair up."""

    def __init__(self, guard: Guard, run: Callable[[list[Any]], torch.Tensor]) -> None:
        assert guard.world.data_parallel, "RankReplay needs a Guard built with ddp="
        self.guard, self.run = guard, run
        self.batches: list[Any] = []

    def start(self) -> None:
        """A new step: forget the last one's micro-batches."""
        self.batches = []

    def add(self, batch: Any) -> None:
        """One micro-batch of the open step, as ``run`` takes it."""
        self.batches.append(batch)

    def __call__(self, rank: int) -> torch.Tensor:
        rank_guard = self.guard.ranks.rank_guard
        group = rank_guard.localizer.group
        own = rank_guard.rank
        if rank == own:
            for peer in rank_guard.localizer.plan.get(rank, []):  # the peers that replay this rank
                dist.send_object_list([self.batches], dst=_global(group, peer), group=group)
            batches = self.batches
        else:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=_global(group, rank), group=group)
            batches = box[0]
        self.guard.session.clear_grads()
        with reexecution():
            return self.run(batches)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    """The default group's number of ``rank`` in ``group`` (what point-to-point calls take)."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
