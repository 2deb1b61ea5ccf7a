"""The ``checkpoint`` site: bytes of a saved checkpoint corrupted on disk.

The file is rewritten with the faulty values and its manifest is left as it was, like a
storage fault after the write: a loader that checks the sha256 manifest (the engine's does)
refuses it, one that does not silently trains on. Targets match tensor names of the saved
model state (``blocks.0.attn.k_proj.weight``, or a module name for its ``.weight``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from sdcscope.faults import FaultSpec, apply_spec, fault_generator, fires


def corrupt_checkpoint_file(path: str | Path, specs: list[FaultSpec], *, rank: int = 0) -> list[dict[str, Any]]:
    """Apply the ``checkpoint`` specs that fire at the file's step; return one record per fault."""
    path = Path(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    tensors: dict[str, torch.Tensor] = state["model"]
    step = int(state.get("step", 0))
    records = []
    for i, spec in enumerate(specs):
        if spec.site != "checkpoint":
            continue
        hit = [n for n in tensors
               if any(fnmatchcase(n, p) or fnmatchcase(n.rsplit(".", 1)[0], p) and n.endswith(".weight")
                      for p in spec.target)]
        if not hit:
            raise ValueError(f"fault spec #{i}: target {list(spec.target)!r} matches no tensor in "
                             f"{str(path)!r} (names look like: {', '.join(list(tensors)[:6])} …)")
        for name in hit:
            key = next(p for p in [name, name.rsplit(".", 1)[0]] if spec.matches(p))
            if not fires(spec, step, None, key, rank):
                continue
            result = apply_spec(spec, tensors[name], fault_generator(spec, step, None, key, rank), step=step)
            records.append({"step": step, "micro_batch": 0, "rank": rank, "site": "checkpoint",
                            "module": name, "spec": i, "model": spec.model,
                            "bits": list(spec.bits) if spec.bits else None,
                            "count": result.index.numel(), **result.to_dict()})
    if records:
        torch.save(state, path)
    return records
