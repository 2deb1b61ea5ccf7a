"""The guard of a ``guard: true`` campaign: :class:`sdcscope.guard.Guard` with its default config.

Imported lazily, so campaigns without a guard never need it. The guard is added to the trainer's
callbacks after the fault (the fault corrupts a value before any observer sees it); its
``events`` (dicts with ``step``, ``detector``, ``verdict``, ``module``, …) decide ``detected``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_guard", "guard_events"]


def make_guard(trainer) -> Any:
    """A default-config guard attached to ``trainer`` (raises a clear error without one)."""
    try:
        from sdcscope.guard import GuardConfig
        from sdcscope.jobs import guard_trainer
    except ImportError as exc:
        raise ValueError(
            f"this campaign has guard: true, but sdcscope.guard is not available ({exc}); set guard: false"
        ) from None
    guard = guard_trainer(trainer, GuardConfig(), run_dir=None, loss_fn=trainer.workload.loss)
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
