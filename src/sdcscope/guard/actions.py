"""The guard's mitigation actions as objects, and the loop side that carries out the discarding ones.

The policy table (:class:`~sdcscope.mitigate.PolicyConfig`) names actions; :func:`make_actions`
turns the names into these objects and :meth:`StepSession.act <sdcscope.guard.session.StepSession.act>`
applies them, most decisive first, in one place. What an action needs from the training loop --
restoring a snapshot, dropping the update, never feeding a batch again -- comes from a
:class:`Loop`: the plain loop's (the default), the engine trainer's, a library trainer's.
What the actions did (:class:`Applied`) goes into the events they answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from sdcscope.detect import Event
from sdcscope.mitigate import qk_clip_

if TYPE_CHECKING:
    from sdcscope.engine import TrainState
    from sdcscope.guard.session import StepSession

PRIORITY = ("rollback", "veto", "stop", "recompute", "skip_batch", "lr_backoff", "qk_clip", "report", "none")
"""Every policy action but ``quarantine``, most decisive first. Quarantine is taken as such only in
a data-parallel run (:mod:`sdcscope.guard.ranks`); a single process vetoes the step and stops
(:data:`SOLO_QUARANTINE`)."""
SOLO_QUARANTINE = (
    "no rank to quarantine outside a data-parallel run: the step is vetoed and training stops cleanly "
    "(the device is named in the ledger)"
)
QK_NAMES = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("q", "k"))
"""Names of an attention module's query and key projections that QK-clip rescales."""


class Loop:
    """The training loop's side of the discarding actions. The default is a plain loop's: the
    guard restores its own snapshot (model, optimizer, ``stateful`` objects) and clears the
    gradients so that nothing is applied."""

    def __init__(self, session: StepSession) -> None:
        self.session = session

    def before_discard(self) -> None:
        """Called once before a rollback or veto changes anything."""

    def rollback(self) -> TrainState:
        """Restore the latest snapshot into the loop's training state and return it; raise when it
        cannot be restored (nothing changed then)."""
        return self.session.restore_snapshot()

    def drop_update(self) -> None:
        """Make sure this step's update is not applied."""
        self.session.guard.optimizer.zero_grad(set_to_none=True)

    def skip_batch(self) -> None:
        """Never train on this step's batch again (beyond :attr:`Guard.skip_batches`)."""


@dataclass
class Applied:
    """What the actions of one step did."""

    discarded: bool = False  # the update is not applied (vetoed or rolled back)
    rolled_back: TrainState | None = None  # the snapshot restored


class Action:
    """One mitigation, applied by :meth:`StepSession.act`; ``applied`` collects what it did."""

    name: ClassVar[str]

    def apply(self, session: StepSession, loop: Loop, applied: Applied) -> None:
        """Nothing to do at this point of the step (``report``, ``none``)."""


class Rollback(Action):
    name = "rollback"

    def apply(self, session, loop, applied):
        if applied.discarded:
            return
        state = session.guard.safe(loop.rollback, "rollback", default=False)
        if state is False:  # reported as an internal error; the veto below keeps the update out
            return
        session.rolled_back(state)
        applied.discarded, applied.rolled_back = True, state


class Veto(Action):
    name = "veto"

    def apply(self, session, loop, applied):
        if applied.discarded:
            return
        loop.drop_update()
        session.restore_buffers()
        applied.discarded = True


class Stop(Action):
    """Stop training cleanly: :attr:`Guard.stopped <sdcscope.guard.Guard.stopped>` turns true with
    the reason, and every loop driving the guard ends after this step."""

    name = "stop"

    def apply(self, session, loop, applied):  # StepSession.act stops once the step's findings are written
        session.stop_reason = session.stop_reason or f"the policy stopped training at step {session.step}"


class Recompute(Action):
    """The replay already left its gradients in place: the update uses them."""

    name = "recompute"


class SkipBatch(Action):
    name = "skip_batch"

    def apply(self, session, loop, applied):
        session.guard.skip_batches.add(session.step)
        loop.skip_batch()


class LRBackoff(Action):
    name = "lr_backoff"

    def apply(self, session, loop, applied):
        session.guard.backoff.trigger(session.clock)


class Report(Action):
    name = "report"


class NoAction(Action):
    name = "none"


class QKClip(Action):
    """Taken after the update, on the attention logits it produced (:func:`qk_clip_findings`)."""

    name = "qk_clip"


def qk_clip_findings(session: StepSession, row: dict) -> list[Event]:
    """An attention-logit bound above the guard's ``qk_clip`` in the update's metrics ``row`` is a
    finding (``attention_logit:high``); the policy's actions for it apply at once: ``qk_clip``
    (rescale W_q, W_k), ``lr_backoff``; anything else reports it. Returns the events, acted on."""
    g = session.guard
    threshold = g.config.qk_clip
    chosen = g.config.policy.actions_for("attention_logit", "high")
    modules = dict(g.model.named_modules())
    events = []
    for key, value in row.items():
        if not key.startswith("attn/max_logit_bound/") or not (math.isfinite(value) and value > threshold):
            continue
        layer = key.split("/", 2)[2]
        evidence = {"max_logit_bound": value, "threshold": threshold, "scale": 1.0}
        proj = next(
            (
                (modules[f"{layer}.{q}"], modules[f"{layer}.{k}"])
                for q, k in QK_NAMES
                if isinstance(modules.get(f"{layer}.{q}"), nn.Linear)
                and isinstance(modules.get(f"{layer}.{k}"), nn.Linear)
            ),
            None,
        )
        done = [a for a in chosen if a == "lr_backoff" or (a == "qk_clip" and proj is not None)]
        if "qk_clip" in chosen and proj is None:  # a fused qkv projection: reported, not rescaled
            pairs = ", ".join("/".join(pair) for pair in QK_NAMES)
            evidence["qk_clip"] = f"no separate q/k nn.Linear under {layer!r} (looked for {pairs})"
        if "qk_clip" in done:
            evidence["scale"] = qk_clip_(*proj, value, threshold)
        if "lr_backoff" in done:
            g.backoff.trigger(session.clock)
        events.append(
            Event(
                session.step,
                "attention_logit",
                "high",
                module=layer,
                rank=g.rank,
                evidence=evidence,
                action=", ".join(done) or "report",
            )
        )
    return events


ACTION_TYPES: dict[str, type[Action]] = {
    cls.name: cls for cls in (Rollback, Veto, Stop, Recompute, SkipBatch, LRBackoff, QKClip, Report, NoAction)
}


def make_actions(names: list[str]) -> list[Action]:
    """The action objects for policy ``names``, most decisive first; a rollback always has a
    veto behind it (a rollback that fails must still keep the update out)."""
    names = sorted(dict.fromkeys(names), key=PRIORITY.index)
    if "rollback" in names and "veto" not in names:
        names.insert(1, "veto")
    return [ACTION_TYPES[n]() for n in names]
