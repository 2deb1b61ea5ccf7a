"""The ``checkpoint`` site: bytes of a saved checkpoint corrupted on disk.

The file is rewritten with the faulty values and its manifest is left as it was, like a
storage fault after the write: a loader that checks the sha256 manifest (the engine's does)
refuses it, one that does not silently trains on. Targets match tensor names of the saved
model state (``blocks.0.attn.k_proj.weight``, or a module name for its ``.weight``).

Whether a checkpoint fault fires is decided in one place, :func:`checkpoint_faults`, keyed on the
tensor's name as the spec matched it (the tensor, or its module for a ``.weight``) -- like the
:class:`~sdcscope.inject.Injector` keys a weight fault -- so a loop that asks it before writing a
checkpoint and :func:`corrupt_checkpoint_file` always agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from sdcscope.faults import FaultSpec, apply_spec, fault_generator, fires


def _key(spec: FaultSpec, name: str) -> str | None:
    """The name ``spec`` matched for tensor ``name``: the tensor's, or its module's for a
    ``.weight``; ``None`` when it does not target the tensor."""
    module = name.rsplit(".", 1)[0]
    if spec.matches(name):
        return name
    return module if name.endswith(".weight") and spec.matches(module) else None


def checkpoint_faults(
    specs: list[FaultSpec], names: Iterable[str], step: int, rank: int = 0
) -> list[tuple[int, str, str]]:
    """``(spec index, tensor name, key)`` of every ``checkpoint`` fault that fires in a checkpoint
    of the tensors ``names`` written at ``step`` on ``rank``."""
    return [
        (i, name, key)
        for i, spec in enumerate(specs)
        if spec.site == "checkpoint"
        for name in names
        if (key := _key(spec, name)) is not None and fires(spec, step, None, key, rank)
    ]


def corrupt_checkpoint_file(path: str | Path, specs: list[FaultSpec], *, rank: int = 0) -> list[dict[str, Any]]:
    """Apply the ``checkpoint`` specs that fire at the file's step; return one record per fault."""
    path = Path(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    tensors: dict[str, torch.Tensor] = state["model"]
    step = int(state.get("step", 0))
    for i, spec in enumerate(specs):
        if spec.site == "checkpoint" and not any(_key(spec, n) for n in tensors):
            raise ValueError(
                f"fault spec #{i}: target {list(spec.target)!r} matches no tensor in "
                f"{str(path)!r} (names look like: {', '.join(list(tensors)[:6])} …)"
            )
    records, hit = [], set()
    for i, name, key in checkpoint_faults(specs, tensors, step, rank):
        tensor = (i, tensors[name].untyped_storage().data_ptr())
        if tensor in hit:  # a tied tensor (embedding and output head), saved under each name: once
            continue
        hit.add(tensor)
        spec = specs[i]
        result = apply_spec(spec, tensors[name], fault_generator(spec, step, None, key, rank), step=step)
        records.append(
            {
                "step": step,
                "micro_batch": 0,
                "rank": rank,
                "site": "checkpoint",
                "when": "train",
                "call": None,
                "module": name,
                "spec": i,
                "model": spec.model,
                "bits": list(spec.bits) if spec.bits else None,
                "count": result.index.numel(),
                **result.to_dict(),
            }
        )
    if records:
        torch.save(state, path)
    return records
