"""The canary detector: records the registered ops' calls during a step and, at the check point,
recomputes their sampled rows with the references and compares (the bound:
:mod:`sdcscope.detect.canary`). Registered as ``canary`` (``detectors: {canary: {...}}``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdcscope.common.validate import check_bool, check_float, check_non_negative, check_positive
from sdcscope.detect.canary.judge import Comparison, compare, confirm, rel_error
from sdcscope.detect.canary.ops import CanaryOp, activate, deactivate, ops, select
from sdcscope.detect.canary.record import Call
from sdcscope.detect.events import Event
from sdcscope.detect.protocol import CheckView, Registration, register

log = logging.getLogger("sdcscope.detect.canary")


@dataclass(kw_only=True)
class CanaryConfig:
    """The ``canary`` section: how many rows, how often, how tight."""

    rows: int = 2
    """Rows drawn at random per call (per output; fewer when the output has fewer)."""
    last_row: bool = True
    """Also check each call's last row, where a kernel that mishandles its last partial tile errs."""
    every: int = 1
    """Check on steps divisible by ``every`` (the other steps record nothing)."""
    seed: int = 0
    """Seed of the row draws (with the step, the op's name and the call's number in the step)."""
    rtol: float = 1e-4
    """Relative tolerance beside the output dtype's rounding, for ops that set none of their own."""
    backward: bool = True
    """Check the input gradients of the ops registered with a backward reference."""
    fp32_factor: float = 32.0
    """A result the bound flags is judged again against the reference in fp64, allowed this many
    times the fp32 reference's own error (the largest over the call's sampled rows) besides the
    bound: an op about as accurate as fp32 passes (a correct chunked cross-entropy's dX on very
    confident rows was up to 23 times off where the fp32 reference's was least, 3 rows pooled)."""
    ops: list[str] | None = None
    """Shell patterns of the op names to check (None: every registered op)."""

    def __post_init__(self) -> None:
        check_positive("canary rows", self.rows)
        check_positive("canary every", self.every)
        check_non_negative("canary seed", self.seed)
        check_float("canary rtol", self.rtol, low=0.0)
        check_float("canary fp32_factor", self.fp32_factor, low=0.0)
        check_bool("canary last_row", self.last_row)
        check_bool("canary backward", self.backward)
        if self.ops is not None:
            if isinstance(self.ops, str) or not isinstance(self.ops, Sequence):
                raise TypeError(f"canary ops={self.ops!r} must be a list of op-name patterns or null")
            if not all(isinstance(p, str) and p for p in self.ops):
                raise TypeError(f"canary ops={self.ops!r} must hold non-empty strings")
            self.ops = list(self.ops)


class CanaryDetector:
    """Sampled-row recomputation of the registered canary ops (:mod:`sdcscope.detect.canary`)."""

    name = "canary"

    def __init__(self, config: CanaryConfig | None = None, *, rank: int | None = None) -> None:
        self.config = c = config or CanaryConfig()
        self.rank = rank
        known = [o.name for o in ops()]
        for pattern in c.ops or ():
            if not any(select([pattern], n) for n in known):
                raise ValueError(
                    f"canary ops: {pattern!r} matches no registered canary op; registered: {', '.join(known) or 'none'}"
                    " (register them with canary_function / canary_module before building the guard)"
                )
        self.step: int | None = None
        self._due = False
        self._numbers: dict[str, int] = {}
        self._pending: list[Call] = []
        self._chosen: dict[str, bool] = {}
        self._failed: set[str] = set()
        self.calls: dict[str, int] = {}
        """Calls recorded per op since attach."""
        self.checks_run = 0
        self.cleared = 0
        """Results the bound flagged that the fp64 reference cleared (as accurate as fp32)."""

    # -- the guard's hooks ------------------------------------------------------------------
    def attach(self) -> CanaryDetector:
        activate(self)
        if not ops():
            log.warning("canary: no op is registered (canary_function / canary_module): nothing to check")
        return self

    def detach(self) -> None:
        deactivate(self)
        self._pending.clear()
        self._due = False

    def begin_step(self, step: int) -> None:
        """Before a forward pass of ``step`` (a replay's too: the same rows are drawn again)."""
        self.step, self._due = step, step % self.config.every == 0
        self._numbers.clear()
        self._pending.clear()
        for o in ops():
            o.opened.clear()

    # -- recording (called by the ops' wrappers and hooks) ----------------------------------
    def wants(self, op: CanaryOp) -> bool:
        if not self._due:
            return False
        chosen = self._chosen.get(op.name)
        if chosen is None:
            chosen = self._chosen[op.name] = select(self.config.ops, op.name)
        return chosen

    def open(self, op: CanaryOp, args: tuple) -> Call | None:
        number = self._numbers.get(op.name, 0)
        self._numbers[op.name] = number + 1
        try:
            return Call(op, self.step, number, args, self.config.backward and op.backward is not False)
        except Exception as exc:  # a monitor must not break the op's call
            self._warn(op, exc)
            return None

    def close(self, call: Call, args: tuple, kwargs: dict, out: Any) -> Any:
        c = self.config
        try:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"it returned {type(out).__name__}, not a tensor")
            out = call.close(args, kwargs, out, c.rows, c.last_row, c.seed)
        except Exception as exc:
            self._warn(call.op, exc)
            return out
        self._pending.append(call)
        self.calls[call.op.name] = self.calls.get(call.op.name, 0) + 1
        return out

    def _warn(self, op: CanaryOp, exc: Exception) -> None:
        if op.name not in self._failed:
            self._failed.add(op.name)
            log.warning("canary op %r is not checked: %s", op.name, exc)

    # -- the check ----------------------------------------------------------------------------
    def check(self, view: CheckView) -> list[Event]:
        """Judge the calls recorded since the step began (one host sync) -> events."""
        pending, self._pending = self._pending, []
        self._due = False  # nothing more is recorded until the next step begins
        events = [self._shape_event(view.step, call) for call in pending if call.shape is not None]
        compared: list[Comparison] = []
        for call in pending:
            if call.shape is None and call.out_rows is not None:
                compared += compare(call, self.config.rtol)
        if not compared:
            return events
        self.checks_run += len(compared)
        worst = torch.stack([c.ratio.amax() for c in compared]).tolist()  # the sync
        flagged: dict[int, list[Comparison]] = {}
        for c, w in zip(compared, worst):
            if w > 1.0:
                flagged.setdefault(id(c.call), []).append(c)
        for group in flagged.values():  # rare: a fault, or a row with cancellation
            confirm(group, self.config.fp32_factor)
            for c in group:
                if c.confirmed and float(c.ratio.amax()) <= 1.0:
                    self.cleared += 1
                else:
                    events.append(self._event(view.step, c))
        return events

    def _event(self, step: int, c: Comparison) -> Event:
        at = torch.unravel_index(c.ratio.argmax(), c.ratio.shape)
        call, op = c.call, c.call.op
        where = [call.rows[int(at[0])], *(int(i) for i in at[1:])]
        evidence: dict[str, Any] = {
            "op": op.name,
            "pass": "forward" if c.slot is None else "backward",
            "row": where[0],
            "rows": list(call.rows),
            "rel_error": rel_error(c.got, c.ref, int(at[0])),
            "ratio": float(c.ratio.amax()),
            "rtol": c.rtol,
            "atol": c.atol,
            "reference": "fp64" if c.confirmed else "fp32",
            "call": call.number,
        }
        if c.ref_error is not None:
            evidence["fp32_reference_error"] = c.ref_error
        if c.slot is not None:
            evidence["input"] = c.slot
        return Event(step, self.name, "mismatch", module=op.name, rank=self.rank, index=tuple(where), evidence=evidence)

    def _shape_event(self, step: int, call: Call) -> Event:
        evidence = {"op": call.op.name, "pass": "forward", "call": call.number, **call.shape}
        return Event(step, self.name, "shape", module=call.op.name, rank=self.rank, evidence=evidence)


register(
    Registration(
        "canary",
        CanaryConfig,
        lambda model, optimizer, config, rank: CanaryDetector(config, rank=rank),
        recheck=True,
        drain=True,
    )
)
