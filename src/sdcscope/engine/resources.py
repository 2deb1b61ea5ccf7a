"""A memory estimate for a training run, checked before any work.

The estimate is measured, not modelled: one forward pass of the workload's model on two rows of
a real batch records the bytes of every tensor autograd saves for the backward pass; scaled to
the micro-batch, doubled for the backward pass's own working set, plus the parameters, their
gradients and two optimizer moments. A run whose estimate exceeds the memory this machine has
available (``MemAvailable``, bounded by a cgroup limit) is refused with the estimate, instead of
being killed by the kernel later without a word.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("sdcscope.engine.resources")

__all__ = ["MemoryEstimate", "estimate_memory", "available_memory", "check_memory"]

PROBE_ROWS = 2


@dataclass(frozen=True)
class MemoryEstimate:
    total: int
    """Bytes the run is expected to need at its peak."""
    per_row: int
    """Activation bytes autograd saves per batch row (sequence, image)."""
    state: int
    """Parameters, gradients and optimizer moments, in bytes."""


def _rows(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.dim() else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rows(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _rows(v, n) for k, v in batch.items()}
    return batch


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((b for b in map(_batch_size, items) if b), None)


def estimate_memory(workload: Any, model: torch.nn.Module | None = None, seed: int = 0) -> MemoryEstimate:
    """Measure what one micro-batch of ``workload`` needs (see the module docstring). The model is
    run in eval mode under a forked RNG, so the run it is measured for is left bitwise as it was."""
    with torch.random.fork_rng():
        model = model if model is not None else workload.build_model()
        batch = workload.batch(seed, 0, 0)
        size = _batch_size(batch) or 1
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        was_training = model.training
        model.eval()
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                workload.loss(model, _rows(batch, PROBE_ROWS))
        finally:
            model.train(was_training)
    rows = min(size, PROBE_ROWS)
    per_row = saved // max(rows, 1)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 4 * params  # weights, gradients, two optimizer moments
    return MemoryEstimate(total=state + 2 * per_row * size, per_row=per_row, state=state)


def available_memory() -> int | None:
    """Bytes of memory this process may still use: ``MemAvailable``, bounded by the cgroup's
    limit; None where neither is known."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    return min(found) if found else None


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_memory(
    workload: Any, processes: int = 1, model: torch.nn.Module | None = None, available: int | None = None
) -> None:
    """Refuse (ValueError, with the estimate) a run that would need more memory than is available.
    ``processes``: ranks on this machine, each holding its own copy. Gradient accumulation does
    not multiply activations (micro-batches run one after another). ``available``: bytes to
    compare with (default: :func:`available_memory`)."""
    available = available_memory() if available is None else available
    if available is None:
        return
    est = estimate_memory(workload, model)
    need = est.total * processes
    log.debug("memory estimate %d bytes (available %d)", need, available)
    if need > available:
        size = workload.config.batch_size
        each = f" on each of {processes} ranks" if processes > 1 else ""
        fit = max(0, (available // processes - est.state) // max(2 * est.per_row, 1))
        raise ValueError(
            f"--batch-size {size} needs about {_gb(need)} of memory{each} "
            f"({_gb(est.per_row)} of activations per row × {size}, doubled for the backward pass, "
            f"+ {_gb(est.state)} of parameters, gradients and optimizer state); this machine has "
            f"{_gb(available)} available: use --batch-size {fit} or less"
            + (" (with --grad-accum for the same effective batch)" if fit else "")
        )
