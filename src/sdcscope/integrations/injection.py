"""What the trainer injector callbacks share (:mod:`~sdcscope.integrations.hf_inject`,
:mod:`~sdcscope.integrations.lightning_inject`): the specs they take and the injector they open.

A trainer's loop runs micro-batches and optimizer steps; the callbacks tell an
:class:`~sdcscope.inject.Injector` where the loop is (``set_position(step, micro_batch)``) and mark
what runs between steps (evaluation, logging, checkpoints) as ``evaluating``, where only permanent
faults act. Importing this module imports neither library.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

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
    specs: str | os.PathLike | FaultSpec | Mapping | Iterable, run_dir: str | os.PathLike | None, rank: int
) -> tuple[list[FaultSpec], Path | None, int]:
    """An injector callback's arguments, checked: the specs loaded, ``run_dir`` a path or None,
    ``rank`` an int >= 0 (both trainers' callbacks take the same three)."""
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a directory path or None, got {run_dir!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r} must be an int >= 0")
    return load_fault_specs(specs), None if run_dir is None else Path(run_dir), rank


def open_injector(
    model, specs: list[FaultSpec], optimizer, run_dir: str | os.PathLike, *, grad_accum: int, rank: int = 0
) -> Injector:
    """An attached :class:`Injector` logging every fired fault to ``run_dir/injections.jsonl``."""
    path = Path(run_dir) / INJECTIONS_FILE
    return Injector(model, specs, optimizer, rank=rank, log=path, grad_accum=grad_accum).attach()


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
