"""The detector protocol and its registry: a new detector is its own file plus one :func:`register`.

A detector answers one call after backward, before the optimizer may step::

    check(view: CheckView) -> list[Event]

where :class:`CheckView` is what the check point offers: the step, its loss, the model and the
world values the guard computed once for every detector (the loss and global gradient norm over
the whole world, the per-parameter squared gradient norms). A :class:`Registration` says how the
guard builds one -- ``build(model, optimizer, section, rank)`` from its config section -- and which
of the guard's services it takes (the world values, a re-check on the replay, a drain on a void
step, a rollback of its state). The guard builds every registered detector whose section is set
and calls them in registration order (:meth:`StepSession.detect <sdcscope.guard.session.StepSession.detect>`).
The built-ins register themselves when :mod:`sdcscope.detect` is imported: ``abft``,
``canary`` (configured under ``GuardConfig.detectors``), ``dispatch``, ``nonfinite``,
``loss_spike``, ``grad_spike``, in that order.

Optional hooks, called when the detector has them: ``attach()`` / ``detach()`` with the guard's,
``begin_step(step)`` before every forward pass of a step (a replay's too).

The state checksums (:class:`~sdcscope.detect.state.StateChecksum`) are no registered detector:
their findings are memory faults *between* checks -- verified before the update (or at the step's
begin when a snapshot is due, so no snapshot holds unverified state) against a reference recorded
only from verified state (after an applied update, a restore, the engine's start) -- and they gate
the other detectors (a step on corrupted state is void) and the snapshots. That lifecycle is two
calls at several points, not one ``check``; the session drives it itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from sdcscope.common.validate import check_bool, did_you_mean
from sdcscope.detect.events import Event

log = logging.getLogger("sdcscope.detect.protocol")


@dataclass(frozen=True, slots=True)
class CheckView:
    """What a detector sees at the check point (after backward, before the update).

    ``loss_value`` / ``grad_norm`` are world values: in a sharded run the mean loss over the ranks
    and the norm over every shard, the same on every rank. They, ``grad_sq``, ``grad_names`` and
    ``own_overflow`` are set only for a detector registered with ``world_values=True`` (for the
    others, and on a replay's re-check, they are None / empty)."""

    step: int
    loss: Any = None
    """The step's loss as the loop gave it: a scalar tensor, a number or None."""
    model: nn.Module | None = None
    loss_value: float | None = None
    """The world's loss as a float (None: the loop gave no loss, or not computed)."""
    grad_norm: float | None = None
    """The global gradient 2-norm (None: no gradient, or not computed)."""
    grad_sq: torch.Tensor | None = None
    """This rank's per-parameter squared gradient norms (fp64), in ``grad_names`` order."""
    grad_names: tuple[str, ...] = ()
    """The parameters that have a gradient."""
    own_overflow: bool = False
    """The global norm is non-finite and this rank names the parameters whose finite gradients'
    norms overflowed (in a data-parallel run the rank guard's signatures name the rank instead)."""
    replay: bool = False
    """A re-check on the replay's re-execution (``recheck=True``): no world values; a detector
    looks at the re-executed step in full."""


@runtime_checkable
class Detector(Protocol):
    """A detector: one ``check`` per step, returning its findings (each :class:`Event`'s
    ``detector`` names it in ``events.jsonl`` and the policy table)."""

    def check(self, view: CheckView) -> list[Event]: ...


Build = Callable[[nn.Module, torch.optim.Optimizer, Any, int | None], Detector]


@dataclass(frozen=True)
class Registration:
    """How the guard builds and drives one detector.

    ``name``: its config section (a ``GuardConfig`` field for a built-in, a key of
    ``GuardConfig.detectors`` for any other) and its key in ``Guard.detectors``; ``config``: the
    section's dataclass (a mapping in YAML builds it); ``build(model, optimizer, section, rank)``:
    the detector."""

    name: str
    config: type
    build: Build
    world_values: bool = False
    """It reads the world values: the guard computes them once, before the first such detector
    (one fused pass over the gradients and one host sync; a collective in a sharded run)."""
    recheck: bool = False
    """The replay checks the re-executed step with it again (``view.replay``): its silence there
    proves the fault transient. It must not learn from a re-check (no statistics: it is no new step)."""
    drain: bool = False
    """It records during the step (hooks) and is checked on a void step too (one that ran on
    corrupted state), its findings dropped, so that none of that step's records stay pending."""
    rolls_back: bool = False
    """Its state is training history (a window of past values): snapshotted (deep-copied) with the
    model and restored on a rollback, so the steps run again are not counted twice."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"detector name {self.name!r} must be an identifier (it names a config section)")
        if not (isinstance(self.config, type) and hasattr(self.config, "__dataclass_fields__")):
            raise TypeError(f"detector {self.name!r}: config must be a dataclass type, got {self.config!r}")
        if not callable(self.build):
            raise TypeError(f"detector {self.name!r}: build must be callable, got {self.build!r}")
        for flag in ("world_values", "recheck", "drain", "rolls_back"):
            check_bool(f"detector {self.name!r} {flag}", getattr(self, flag))


_REGISTRY: dict[str, Registration] = {}


def register(registration: Registration) -> Registration:
    """Add ``registration`` after those registered before it (the order the guard runs them in);
    a name taken already is refused (:func:`unregister` it first)."""
    if not isinstance(registration, Registration):
        raise TypeError(f"register takes a Registration, got {registration!r}")
    if registration.name in _REGISTRY:
        raise ValueError(f"a detector {registration.name!r} is registered already; unregister it first")
    _REGISTRY[registration.name] = registration
    log.debug("detector %r registered", registration.name)
    return registration


def unregister(name: str) -> Registration:
    """Remove the detector ``name`` from the registry (guards built before keep theirs)."""
    return _REGISTRY.pop(registration(name).name)


def registration(name: str) -> Registration:
    """The registration of ``name``; ValueError naming the registered ones for an unknown name."""
    found = _REGISTRY.get(name)
    if found is None:
        raise ValueError(
            f"unknown detector {name!r}{did_you_mean(name, _REGISTRY)}; registered: {', '.join(_REGISTRY) or 'none'}"
        )
    return found


def registered() -> tuple[Registration, ...]:
    """Every registration, in the order the guard runs the detectors."""
    return tuple(_REGISTRY.values())
