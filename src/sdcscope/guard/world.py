"""The guard's side of each world: what differs between one process, DDP and sharded training
in the one decision loop of :meth:`StepSession.decide <sdcscope.guard.session.StepSession.decide>`.

The loop is the same everywhere: share the findings, replay once, set verdicts, note strikes,
map verdicts to actions, let the world translate them, stop. A :class:`WorldSide` supplies only
what differs -- how findings are shared (:meth:`~WorldSide.share`), how a replay runs
(:meth:`~WorldSide.replay`), what an action means there (:meth:`~WorldSide.translate`), and how
a stop propagates (:attr:`~WorldSide.stop`) -- with the single-process behaviour as the default
(:class:`Solo`). The data-parallel side is :class:`~sdcscope.guard.ranks.GuardRanks`, the sharded
one :class:`~sdcscope.guard.sharded.ShardedRanks`; :func:`make_side` picks it from the
:class:`~sdcscope.common.world.World`. :func:`fit_config` applies :data:`~sdcscope.common.world.SUPPORT`
to guard settings, the same way for the CLI, the jobs, the Guard and the trainer adapters.
"""

from __future__ import annotations

import logging
import math
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sdcscope.common.world import World, unsupported
from sdcscope.detect import Event
from sdcscope.detect.protocol import registered
from sdcscope.guard.actions import SOLO_QUARANTINE
from sdcscope.guard.replay import replay_step
from sdcscope.guard.strikes import Strikes

if TYPE_CHECKING:
    from sdcscope.guard.config import GuardConfig
    from sdcscope.guard.guard import Guard
    from sdcscope.guard.session import StepGrads, StepSession

log = logging.getLogger("sdcscope.guard.world")

SECTIONS = ("metrics", "zclip", "qk_clip", "invariants", "collectives")
"""Guard sections :data:`~sdcscope.common.world.SUPPORT` rules on (``guard.<name>``)."""


def fit_config(config: GuardConfig, kind: str) -> GuardConfig:
    """``config`` fitted to a ``kind`` world by :data:`~sdcscope.common.world.SUPPORT`: a section
    the world cannot run is refused (ValueError, naming it and why) when the user set it (it
    differs from its default), and switched off with a log line when it is the default's."""
    if config.ranks is None and (why := unsupported("guard.ranks_null", kind)):
        raise ValueError(f"guard ranks: null cannot watch a {kind} run: {why}")
    defaults = {f.name: f for f in fields(config)}
    changes = {}
    for name in SECTIONS:
        why, value = unsupported(f"guard.{name}", kind), getattr(config, name)
        if why is None or value is None:
            continue
        f = defaults[name]
        if value != (f.default_factory() if f.default_factory is not MISSING else f.default):
            raise ValueError(f"guard {name} is not supported in a {kind} run: {why}; set {name}: null")
        changes[name] = None
        log.info("guard %s is off in a %s run: %s", name, kind, why)
    return replace(config, **changes) if changes else config


def apply_replay(events: list[Event], replay: dict[str, Any]) -> None:
    """Give each finding but a state checksum's the replay's verdict (the finding moves to the
    evidence). A world finding (no rank) takes the rank whose replay differs, when exactly one
    does; a finding whose replay ABFT caught a GEMM on exactly one rank names that rank and layer
    (a non-finite gradient reaches every rank and names the layer where it surfaced)."""
    caught = replay.get("caught") or {}
    for e in events:
        if e.detector == "state_checksum":
            continue
        finding = e.verdict
        e.verdict = replay.get("verdict", "unverified")
        e.evidence = {**e.evidence, "finding": finding, **({"replay": replay} if replay else {})}
        differing = replay.get("differing_ranks", ())
        if e.rank is None and len(differing) == 1:
            e.rank = differing[0]
            e.module = e.module or replay["first_differing_grad"].get(str(e.rank))
        if e.detector != "abft" and len(caught) == 1:
            ((rank, modules),) = caught.items()
            if modules:
                e.evidence = {**e.evidence, "reported": {"rank": e.rank, "module": e.module}}
                e.rank, e.module = int(rank), modules[0]


class WorldSide:
    """One world's part of the decision; the defaults are one process's."""

    decided: tuple[str, ...] = ()
    """Detectors whose findings the world decided already (they get no policy action here)."""
    detect_on_corrupt_state = False
    """Whether the detectors run although the step ran on corrupted state (they are collectives)."""

    def __init__(self, guard: Guard, world: World) -> None:
        self.guard, self.world = guard, world
        self._stopped: str | None = None

    @property
    def stop(self) -> str | None:
        """Why the world stopped the run (None: it did not); the same on every rank."""
        return self._stopped

    def halt(self, why: str) -> None:
        """Stop the run (once) with ``why``: the step is vetoed, the guard stops training."""
        if self._stopped is None:
            self._stopped = why
            log.error("guard: stopping the run: %s", why)

    @property
    def quarantined(self) -> list[int]:
        return []

    def begin(self, step: int) -> None:
        """Before the forward pass of ``step`` (a collective's preparation: never skipped)."""

    def world_values(self, loss: torch.Tensor, grads: StepGrads | None) -> tuple[float, float | None]:
        """``(loss, squared gradient norm)`` the cheap detectors judge: this process's."""
        sq = None if grads is None or grads.sq is None else grads.sq
        parts = [loss.double()] if sq is None else [loss.to(sq.device, torch.float64), sq.sum()]
        values = torch.stack(parts).tolist()  # the sync
        return values[0], (values[1] if len(values) > 1 else None)

    def own_overflow(self, sq: torch.Tensor | None) -> bool:
        """Whether this rank names the parameters whose finite gradients' norms overflowed."""
        return True

    def share(self, session: StepSession, events: list[Event], rank_replay: Any) -> list[Event]:
        """The findings the world decides on, the same list on every rank."""
        return events

    def replay(self, session: StepSession, events: list[Event], loss: Any, rerun: Any) -> Any:
        """Replay the step once when a finding other than a state checksum's calls for it, set
        the verdicts; return the loss to report (a kept re-execution's)."""
        replay: dict[str, Any] = {}
        if self.should_replay(events, rerun):
            replay, loss = replay_step(session, loss, rerun, recheckable(events))
        apply_replay(events, replay)
        return loss

    def should_replay(self, events: list[Event], rerun: Any) -> bool:
        return any(e.detector != "state_checksum" for e in events) and self.guard.config.replay and rerun is not None

    def judge(self, session: StepSession, events: list[Event]) -> None:
        """Note the findings in the device ledger; a repeat at one site makes one ``persistent``."""

    def translate(self, session: StepSession, e: Event, chosen: list[str]) -> list[str]:
        """The policy's actions for ``e`` as this world can take them."""
        return chosen

    def stop_reason(self, e: Event) -> str:
        return f"policy: {e.detector}: {e.verdict}"

    def conclude(self, session: StepSession, actions: list[str], events: list[Event]) -> list[Event]:
        """After the actions are chosen: events of the world's own doings (a quarantine)."""
        return []

    def stop_evidence(self) -> dict[str, Any]:
        return {}

    def end(self, step: int, *, verify: bool = False) -> None:
        """After the update of ``step``; ``verify``: the guard rolled back."""

    def close(self) -> None:
        pass


class Solo(WorldSide):
    """One process: the device ledger's strikes, and a quarantine that stops training."""

    def __init__(self, guard: Guard, world: World, *, run_dir: str | Path | None, ledger: str | Path | None) -> None:
        super().__init__(guard, world)
        self.strikes = Strikes(guard, guard.config.ledger, run_dir=run_dir, ledger=ledger)

    def judge(self, session: StepSession, events: list[Event]) -> None:
        self.guard.safe(lambda: self.strikes.judge(events, session.clock), "ledger")

    def translate(self, session: StepSession, e: Event, chosen: list[str]) -> list[str]:
        if "quarantine" not in chosen:  # no other rank to carry on: the step is void, training stops
            return chosen
        e.evidence = {**e.evidence, "quarantine": SOLO_QUARANTINE}
        return list(dict.fromkeys(x for a in chosen for x in (("veto", "stop") if a == "quarantine" else (a,))))

    def stop_reason(self, e: Event) -> str:
        return self.strikes.stop_reason(e)

    def stop_evidence(self) -> dict[str, Any]:
        return {"device": self.strikes.device, "ledger": str(self.strikes.ledger.path or "")}


def recheckable(events: list[Event]) -> bool:
    """A finding the replay checks again fired (a detector registered with ``recheck``: ABFT,
    non-finite, ...): if it does not fire again, the fault was transient."""
    again = {r.name for r in registered() if r.recheck}
    return any(e.detector in again for e in events)


def make_side(guard: Guard, world: World, *, run_dir: str | Path | None, ledger: str | Path | None) -> WorldSide:
    """The guard's side of ``world``."""
    if world.data_parallel:
        from sdcscope.guard.ranks import GuardRanks

        return GuardRanks(guard, world, guard.config.ranks, run_dir=run_dir, ledger=ledger)
    if world.split:  # shards or pipeline stages: every rank owns what no other holds
        from sdcscope.guard.sharded import ShardedRanks

        return ShardedRanks(guard, world, guard.config.ranks, run_dir=run_dir, ledger=ledger)
    return Solo(guard, world, run_dir=run_dir, ledger=ledger)


def finite_mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if all(map(math.isfinite, values)) else math.nan
