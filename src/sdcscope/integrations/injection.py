"""What the trainer injector callbacks share (:mod:`~sdcscope.integrations.hf_inject`,
:mod:`~sdcscope.integrations.lightning_inject`): the specs they take and the injector they open.

A trainer's loop runs micro-batches and optimizer steps; the callbacks tell an
:class:`~sdcscope.inject.Injector` where the loop is (``set_position(step, micro_batch)``) and mark
what runs between steps (evaluation, logging, checkpoints) as ``evaluating``, where only permanent
faults act. Importing this module imports neither library.

Under data parallelism (DDP, one process per device) every rank runs its own injector: a spec's
``rank`` says which process it lives on (``None``: every one) and each callback compares it with
its own process's rank (the trainer's global rank unless given). Rank r logs its fired faults to
``injections.rank{r}.jsonl``; when training ends rank 0 merges them into ``injections.jsonl``
(ordered by step, micro-batch, rank), as a torchrun job of sdcscope's own does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch.distributed as dist

from sdcscope.engine.rundir import merge_injection_logs, rank_injections_file
from sdcscope.faults import FaultSpec, load_specs
from sdcscope.inject import Injector

INJECTIONS_FILE = "injections.jsonl"


def load_fault_specs(specs: str | os.PathLike | FaultSpec | Mapping | Iterable) -> list[FaultSpec]:
    """Fault specs from what a callback was given: a YAML/JSON file, one spec (a
    :class:`FaultSpec` or a mapping) or a list of them. At least one; errors name the bad item."""
    if isinstance(specs, (str, os.PathLike)):
        out = load_specs(specs)
    elif isinstance(specs, (FaultSpec, Mapping)):
        out = [specs if isinstance(specs, FaultSpec) else FaultSpec.from_dict(dict(specs))]
    elif isinstance(specs, Iterable):
        out = []
        for i, s in enumerate(specs):
            if isinstance(s, FaultSpec):
                out.append(s)
            elif isinstance(s, Mapping):
                out.append(FaultSpec.from_dict(dict(s)))
            else:
                raise TypeError(f"fault spec #{i} must be a FaultSpec or a mapping, got {type(s).__name__} {s!r}")
    else:
        raise TypeError(
            f"fault specs must be a YAML/JSON file, a FaultSpec, a mapping or a list of them, "
            f"got {type(specs).__name__} {specs!r}"
        )
    if not out:
        raise ValueError("no fault specs given: give at least one")
    return out


def callback_args(
    specs: str | os.PathLike | FaultSpec | Mapping | Iterable, run_dir: str | os.PathLike | None, rank: int | None
) -> tuple[list[FaultSpec], Path | None, int | None]:
    """An injector callback's arguments, checked: the specs loaded, ``run_dir`` a path or None,
    ``rank`` an int >= 0 or None (the trainer's own; both trainers' callbacks take the same three)."""
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a directory path or None, got {run_dir!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank={rank!r} must be an int >= 0, or None for this process's rank")
    return load_fault_specs(specs), None if run_dir is None else Path(run_dir), rank


def injections_file(run_dir: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where this rank logs its fired faults: ``injections.jsonl`` in one process, else
    ``injections.rank{r}.jsonl`` (merged by :func:`merge_injections`)."""
    return Path(run_dir) / INJECTIONS_FILE if world_size == 1 else rank_injections_file(run_dir, rank)


def open_injector(
    model,
    specs: list[FaultSpec],
    optimizer,
    run_dir: str | os.PathLike,
    *,
    grad_accum: int,
    rank: int = 0,
    world_size: int = 1,
) -> Injector:
    """An attached :class:`Injector` logging every fired fault to :func:`injections_file`; a
    spec's ``rank`` outside the world is refused."""
    path = injections_file(run_dir, rank, world_size)
    return Injector(model, specs, optimizer, rank=rank, world_size=world_size, log=path, grad_accum=grad_accum).attach()


def merge_injections(run_dir: str | os.PathLike, rank: int, world_size: int) -> None:
    """When training ends in a world of several processes (a collective: every rank calls it):
    rank 0 rebuilds ``injections.jsonl`` from every rank's log, once all are complete."""
    if world_size == 1:
        return
    dist.barrier()
    if rank == 0:
        merge_injection_logs(run_dir, world_size)


class Position:
    """The (step, micro-batch) of a trainer that numbers only its optimizer steps: a micro-batch
    at a step number not seen before is the step's first, the next ones count on."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.micro_batch = 0

    def at(self, step: int) -> tuple[int, int]:
        self.micro_batch = 0 if step != self.step else self.micro_batch + 1
        self.step = step
        return step, self.micro_batch
