"""When a fault fires, and the random generator for its draws.

Both are pure functions of (spec, step, micro-batch, module name, rank) -- of the spec
only its seed, schedule, rank and targets matter -- and never of how often a hook has
been called, so a forward pass re-run by activation checkpointing makes the same
decision and draws the same indices and values.
"""

from __future__ import annotations

import hashlib
import json

import torch

from .spec import FaultSpec

__all__ = ["fires", "fault_generator"]


def _hash64(*parts: object) -> int:
    """A stable 64-bit hash of JSON-serialisable ``parts`` (same on every platform/run)."""
    data = json.dumps(parts, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def fires(spec: FaultSpec, step: int, micro_batch: int | None, module: str, rank: int) -> bool:
    """Whether ``spec`` fires at this event.

    An event is one visit of the spec's site at (``step``, ``micro_batch``) for the module
    (or parameter, bucket, file) called ``module`` on ``rank``. ``micro_batch`` ``None``
    (sites outside micro-batches: param_grad, optimizer_state, comm, checkpoint) counts as
    micro-batch 0. The spec fires when ``rank`` is its rank (any rank for ``None``),
    ``module`` matches a target pattern, and its schedule says so:

    - transient: ``step == schedule.step`` and micro-batch ``== schedule.micro_batch``
      (``None``: 0);
    - intermittent: ``start <= step < stop`` and a uniform number in [0, 1), hashed from
      (seed, step, micro-batch, module, rank), is below ``p`` -- independent per event;
    - permanent: ``step >= start``, every micro-batch;
    - periodic: ``start <= step < stop``, ``step - start`` a multiple of ``every``, and
      micro-batch ``== schedule.micro_batch`` (``None``: 0).
    """
    if spec.rank is not None and rank != spec.rank:
        return False
    schedule = spec.schedule
    if not schedule.covers(step):
        return False
    micro_batch = 0 if micro_batch is None else micro_batch
    if schedule.once_per_step and micro_batch != (schedule.micro_batch or 0):
        return False
    if not spec.matches(module):
        return False
    if schedule.kind == "intermittent":
        u = _hash64("fires", spec.seed, step, micro_batch, module, rank) / 2.0**64
        return u < schedule.p
    return True


def fault_generator(spec: FaultSpec, step: int, micro_batch: int | None, module: str, rank: int) -> torch.Generator:
    """A fresh CPU generator for the random draws (indices, values) of one event.

    Seeded by a stable hash of (seed, step, micro-batch, module, rank) for a transient
    fault, so every event of a recomputation draws the same indices. Intermittent,
    permanent and periodic faults model one faulty unit (:attr:`.spec.Schedule.recurs`):
    their generator ignores step and micro-batch, so a ``"random"`` location, burst of
    bits or value is drawn once per (spec, module, rank) and every firing hits the same
    one. Specs with the same seed draw the same locations, which keeps a sweep over bits
    or fault models on one element; give independent faults distinct seeds.
    """
    micro_batch = 0 if micro_batch is None else micro_batch
    if not spec.schedule.recurs:
        key = _hash64("where", spec.seed, step, micro_batch, module, rank)
    else:
        key = _hash64("where", spec.seed, module, rank)
    return torch.Generator().manual_seed(key >> 1)
