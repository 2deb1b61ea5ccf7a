"""The guard of a guarded campaign: :class:`sdcscope.guard.Guard` with the spec's guard config
(:meth:`CampaignSpec.guard_config <sdcscope.study.spec.CampaignSpec.guard_config>`: its profile,
``balanced`` unless the spec names another).

The guard is added to the trainer's callbacks after the fault (the fault corrupts a value before
any observer sees it); its ``events`` (dicts with ``step``, ``detector``, ``verdict``, ``module``,
…) decide ``detected`` and the ``detector`` of a trial's row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["guard_section", "make_guard", "guard_events", "GUARD_WRITERS"]

GUARD_WRITERS = ("path", "prometheus_port", "wandb", "mlflow")
"""``guard.metrics`` sinks a campaign refuses: trials run in parallel workers without a run
directory, so one file, port or tracker run would be shared by all of them."""


def guard_section(value: Any) -> dict[str, Any] | bool:
    """``guard`` validated: ``False``, or the guard config mapping (plain JSON values) with its
    ``profile`` spelled out (``true`` is ``{profile: balanced}``); errors name ``guard`` and the
    allowed values."""
    if value is False:
        return False
    from sdcscope.guard.config import DEFAULT_PROFILE, PROFILES, GuardConfig

    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise TypeError(
            "guard must be true, false or a guard config mapping such as {profile: full} (profiles: "
            f"{', '.join(PROFILES)}; true is {DEFAULT_PROFILE}), got {value!r}"
        )
    try:
        data = json.loads(json.dumps(_plain({"profile": DEFAULT_PROFILE, **value})))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"guard: {exc}") from None
    metrics = data.get("metrics")
    for key in GUARD_WRITERS if isinstance(metrics, Mapping) else ():
        if metrics.get(key) is not None:
            raise ValueError(
                f"guard.metrics.{key}={metrics[key]!r}: a campaign's runs have no run directory and run in "
                f"parallel workers, which would share it; drop it (no sink among {list(GUARD_WRITERS)})"
            )
    invariants = data.get("invariants")
    if isinstance(invariants, str) and not os.path.isabs(invariants):
        raise ValueError(
            f"guard.invariants {invariants!r} must be an absolute path: a campaign runs from its own "
            "directory, not from where its spec was written"
        )
    try:
        GuardConfig.from_dict(data)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"guard: {exc}") from None
    return data


def _plain(value: Any) -> Any:
    """``value`` with every mapping a dict and every sequence a list (any mapping, such as an
    OmegaConf or read-only one, becomes the JSON the spec is stored and hashed as)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def make_guard(trainer, config) -> Any:
    """A guard with ``config`` (a :class:`~sdcscope.guard.GuardConfig`) attached to ``trainer``,
    without a run directory (its events stay in memory)."""
    from sdcscope.jobs import guard_trainer

    guard = guard_trainer(trainer, config, run_dir=None, loss_fn=trainer.workload.loss)
    trainer.add_callback(guard.callback(trainer))  # primed now: before the trial's fault
    return guard


def first_detection(events: list[dict[str, Any]], records: list[dict[str, Any]]) -> tuple[int | None, dict | None]:
    """``(step the fault first fired on in training, the first guard event from that step)``; an
    event before the fault fired is a false alarm, not its detection (``None`` when there is none)."""
    fired = [r["step"] for r in records if r.get("when") != "eval"]
    if not fired:
        return None, None
    first = min(fired)
    return first, next((e for e in events if e["step"] >= first), None)


def guard_events(guard: Any, since_step: int) -> list[dict[str, Any]]:
    """The guard's events at or after ``since_step`` as dicts, in step order."""
    events = [e if isinstance(e, dict) else e.to_dict() for e in guard.events]
    return sorted((e for e in events if e.get("step", -1) >= since_step), key=lambda e: e["step"])
