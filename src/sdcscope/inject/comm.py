"""Site ``comm``: corrupt a DDP gradient bucket on one rank, before or after the all-reduce.

A :class:`CommInjector` is a stage of the engine's DDP communication hook
(:class:`sdcscope.engine.buckets.BucketHook`; it only needs ``before_reduce(view)`` and
``after_reduce(view)``), so this module imports nothing from the engine.

- **phase** ``before`` (the default): the rank's outgoing bucket is corrupted; the all-reduce
  then copies the corruption into *every* replica, which stay equal to one another:
  only pre-reduction signatures or replay can find the rank.
- **phase** ``after``: the reduced bucket is corrupted on that rank only, so its replica leaves
  the others (a replica hash check, or a post-reduction checksum, sees it).

The phase is ``FaultSpec.phase`` when that field exists, else a suffix on the target:
``target: "blocks.0.mlp.fc.weight@after"``. Targets match, in each bucket, the qualified
parameter names (the fault lands in that parameter's slice of the bucket) and ``bucket.{i}``
(the whole flat bucket ``i``; DDP may re-order buckets after the first step, so prefer
parameter names). Whether a fault fires is :func:`sdcscope.faults.fires` of (spec, step, no
micro-batch, name, rank): the hook runs once per step, on the last micro-batch.

:func:`check_comm_specs` refuses, before any rank starts, a spec that cannot be applied: targets,
rank, a schedule that never fires in the run, and bits, format or pattern that do not fit the
gradients it lands on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.io import JsonlWriter
from sdcscope.common.validate import close_matches
from sdcscope.faults import FaultSpec, FaultSpecError, apply_spec, check_spec, fault_generator, fires
from sdcscope.inject.validate import check_schedule

PHASES = ("before", "after")
MAX_RECORDED = 64


def numbered(specs: Sequence[FaultSpec], spec_ids: Sequence[int] | None) -> list[tuple[int, FaultSpec]]:
    """``(id, spec)`` of each spec: its index in the world's spec list, as recorded (``spec_ids``;
    default 0..n-1)."""
    return list(zip(range(len(specs)) if spec_ids is None else spec_ids, specs))


def comm_phase(spec: FaultSpec) -> tuple[FaultSpec, str]:
    """``(spec with plain targets, phase)`` of a ``comm`` spec (see the module docstring)."""
    field = getattr(spec, "phase", None)
    phases, targets = set(), []
    for t in spec.target:
        base, sep, suffix = t.rpartition("@")
        if sep and suffix in PHASES:
            phases.add(suffix)
            targets.append(base)
        elif sep:
            raise ValueError(f"comm target {t!r}: unknown phase {suffix!r}; allowed: {', '.join(PHASES)}")
        else:
            targets.append(t)
    if field is not None:
        phases.add(field)
    if len(phases) > 1:
        raise ValueError(
            f"comm spec on {list(spec.target)} names several phases {sorted(phases)}; use one spec per phase"
        )
    phase = phases.pop() if phases else "before"
    if phase not in PHASES:
        raise ValueError(f"unknown comm phase {phase!r}; allowed: {', '.join(PHASES)}")
    return dataclasses.replace(spec, target=tuple(targets)), phase


def _check_targets(spec: FaultSpec, names: list[str]) -> None:
    for pattern in spec.target:
        if pattern.startswith("bucket.") or any(fnmatchcase(n, pattern) for n in names):
            continue
        close = close_matches(pattern, names, n=5, cutoff=0.5)
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise ValueError(f"comm target {pattern!r} matches no parameter and no 'bucket.<i>'{hint}")


def _check_fit(spec: FaultSpec, params: dict[str, nn.Parameter]) -> None:
    """Refuse ``spec`` when its bits, format or pattern do not fit a gradient it lands on: a
    parameter's slice of its bucket (the parameter's shape and dtype), or a whole flat bucket --
    its size is DDP's choice, known only in the run, but never more than all the gradients of
    its dtype together."""
    for name, p in params.items():
        if not spec.matches(name):
            continue
        if not p.requires_grad:
            raise ValueError(f"{name!r} is frozen (requires_grad=False): DDP reduces no gradient for it")
        try:
            check_spec(spec, p.dtype, tuple(p.shape))
        except FaultSpecError as exc:
            raise FaultSpecError(f"{name!r}: {exc}") from None
    if any(t.startswith("bucket.") for t in spec.target):
        sizes: dict[torch.dtype, int] = {}
        for p in params.values():
            if p.requires_grad:
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        for dtype, size in sizes.items():
            try:
                check_spec(spec, dtype, (size,))
            except FaultSpecError as exc:
                raise FaultSpecError(f"a gradient bucket (flat, {dtype}, at most {size} elements): {exc}") from None


def check_comm_specs(
    model: nn.Module,
    specs: Sequence[FaultSpec],
    *,
    world_size: int = 1,
    steps: int | None = None,
    grad_accum: int | None = None,
    spec_ids: Sequence[int] | None = None,
) -> list[tuple[int, FaultSpec, str]]:
    """Check ``comm`` specs against ``model`` (the module DDP wraps) before any rank starts;
    return ``(spec id, spec with plain targets, phase)`` of each. ``steps`` and ``grad_accum``,
    when given, refuse a schedule that never fires in the run (as
    :func:`sdcscope.inject.validate_specs` does). Errors name the spec by its id (``spec_ids``:
    its index in the world's spec list; default 0..n-1)."""
    params = dict(model.named_parameters())
    checked = []
    for i, spec in numbered(specs, spec_ids):
        try:
            if spec.site != "comm":
                raise ValueError(f"site {spec.site!r} is not 'comm'; use sdcscope.inject.Injector")
            if spec.rank is not None and spec.rank >= world_size:
                raise ValueError(f"rank {spec.rank} does not exist; allowed: 0..{world_size - 1}")
            plain, phase = comm_phase(spec)
            _check_targets(plain, list(params))
            check_schedule(plain, steps, grad_accum)
            _check_fit(plain, params)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"fault spec #{i} (comm on {', '.join(spec.target)}): {exc}") from None
        checked.append((i, plain, phase))
    return checked


def record_firing(owner: Any, i: int, spec: FaultSpec, name: str, result, when: str, **extra: Any) -> None:
    """Record one firing of a once-per-step fault (a bucket's, a collective's) on ``owner`` (an
    injector with ``step``, ``rank``, ``records``, ``_file`` and ``_sink``): in its records, its
    ``injections.jsonl`` and its sink."""
    values = result.to_dict()
    record = {
        "step": owner.step,
        "micro_batch": None,
        "rank": owner.rank,
        "site": spec.site,
        "when": when,
        "call": None,
        "module": name,
        "spec": i,
        "model": spec.model,
        "bits": list(spec.bits) if spec.bits else None,
        **extra,
        "count": len(values["index"]),
        **{k: v[:MAX_RECORDED] for k, v in values.items()},
    }
    owner.records.append(record)
    if owner._file is not None:
        owner._file.write(record)
    if owner._sink is not None:
        owner._sink(record)


class StepFaults:
    """What the once-per-step injectors (a bucket's, a collective's, an all-to-all's, a pipeline
    send/recv's) share: the step they are at, whether its execution is a repeat, the faults fired
    in it, and their records (:func:`record_firing`: ``records``, ``injections.jsonl``, a sink)."""

    def _start(self, rank: int, log: str | Path | Callable[[dict], None] | None) -> None:
        self.rank = rank
        self.step = 0
        self._begun: set[int] = set()
        self._repeat = False
        self._fired: set[tuple] = set()
        self.armed = True
        self.records: list[dict[str, Any]] = []
        self._file = JsonlWriter(log) if isinstance(log, (str, Path)) else None
        self._sink = log if callable(log) else None

    def set_position(self, step: int) -> None:
        """Before each execution of a step. A step executed again (after a rollback) does not meet
        its transient or intermittent faults again -- they were one event in time -- while a
        permanent one acts on every execution (as :class:`sdcscope.inject.Injector` does)."""
        self.step, self._repeat = step, step in self._begun
        self._begun.add(step)
        self._fired = set()

    def callback(self) -> CommInjectorCallback:
        return CommInjectorCallback(self)

    def detach(self) -> None:
        """Remove the injector's hooks (it has none here)."""

    def close(self) -> None:
        self.detach()
        if self._file is not None:
            self._file.close()
            self._file = None


class CommInjectorCallback:
    """Engine callback that keeps a once-per-step injector's step current."""

    def __init__(self, injector: StepFaults) -> None:
        self.injector = injector

    def before_step(self, ctx) -> None:
        self.injector.set_position(ctx.step)


class CommInjector(StepFaults):
    """Comm-site faults of one rank, as a bucket-hook stage; logs every fired fault.

    ``spec_ids``: the index of each spec in the world's spec list, as recorded (default 0..n-1).
    """

    def __init__(
        self,
        model: nn.Module,
        specs: Iterable[FaultSpec],
        *,
        rank: int = 0,
        world_size: int = 1,
        log: str | Path | Callable[[dict], None] | None = None,
        spec_ids: Sequence[int] | None = None,
    ) -> None:
        self.specs: list[tuple[int, FaultSpec, str]] = [
            (i, plain, phase)
            for i, plain, phase in check_comm_specs(model, list(specs), world_size=world_size, spec_ids=spec_ids)
            if plain.rank is None or plain.rank == rank
        ]
        self._start(rank, log)  # after the checks: a refused spec leaves no injections.jsonl

    def before_reduce(self, view) -> None:
        self._apply(view, "before")

    def after_reduce(self, view) -> None:
        self._apply(view, "after")

    def _apply(self, view, phase: str) -> None:
        if not self.armed:
            return
        for i, spec, spec_phase in self.specs:
            once = spec.schedule.kind != "permanent"
            if spec_phase != phase or not spec.schedule.covers(self.step) or (once and self._repeat):
                continue
            for name, tensor in ((f"bucket.{view.index}", view.buffer), *zip(view.names, view.grads)):
                if fires(spec, self.step, None, name, self.rank):
                    gen = fault_generator(spec, self.step, None, name, self.rank)
                    self._record(i, spec, name, phase, apply_spec(spec, tensor, gen, step=self.step))

    def _record(self, i: int, spec: FaultSpec, name: str, phase: str, result) -> None:
        record_firing(self, i, spec, name, result, "train", phase=phase)
