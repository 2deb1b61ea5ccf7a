"""The policy table: which in-job actions answer which detector verdict.

Keys are ``"detector:verdict"`` with ``*`` as a wildcard on either side; the most specific
matching rule wins (``abft:transient`` before ``*:transient`` before ``abft:*``).

The rules a user gives are merged over :data:`DEFAULT_RULES`: ``{"rules": {"abft:transient":
["veto"]}}`` changes that one answer and keeps every other default (a weight corruption still
rolls back). To drop a default, give its key another action (``report``); to start from an empty
table, say so: ``{"defaults": false, "rules": {...}}`` (then whatever no rule matches is only
reported). Unknown detectors, verdicts and actions are refused, naming the allowed ones
(:data:`VERDICTS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sdcscope.common.validate import check_bool, check_choice, did_you_mean

ACTIONS = (
    "none",
    "veto",
    "recompute",
    "rollback",
    "skip_batch",
    "lr_backoff",
    "qk_clip",
    "quarantine",
    "stop",
    "report",
)
"""veto: skip the optimizer step (parameters and optimizer state untouched); recompute: use the
verified re-execution of the step; rollback: restore the last verified in-memory snapshot;
skip_batch: never train on this batch again; lr_backoff: scale the LR down, recovering linearly;
qk_clip: rescale W_q/W_k of a layer whose attention logits explode; quarantine: exclude a rank's
gradients from the all-reduce from the next step and veto this one (distributed runs; a single
process has no other rank to carry on: it vetoes the step and stops); stop: end training cleanly
(``Guard.stopped``; the CLI exits with ``GUARD_STOPPED``); report: event only."""

DEFAULT_RULES: dict[str, list[str]] = {
    # Replay showed the result was not reproducible: a transient hardware fault. The clean
    # re-execution replaces the corrupted step (Megatron's re-run idea, done in-job).
    "*:transient": ["recompute"],
    # Reproducible non-finite values: bad data or a persistent fault; never apply the update.
    "nonfinite:reproducible": ["veto", "skip_batch"],
    # A reproducible spike is a data/optimization spike: skip the batch (PaLM/OLMo practice)
    # and back the learning rate off.
    "spike:reproducible": ["veto", "skip_batch", "lr_backoff"],
    # A GEMM that fails its checksum again on re-execution: a persistent fault on this device.
    # Don't apply a corrupted update; the event tells the operator which layer and GEMM.
    "abft:reproducible": ["veto"],
    # A collective that delivers other bits again on re-execution: a link or device that stays
    # broken. Never apply an update computed from them; the ledger's strikes then stop the run.
    "collectives:reproducible": ["veto"],
    # A canary op that errs again on re-execution: a wrong kernel (or a persistent fault) -- the
    # same answer.
    "canary:reproducible": ["veto"],
    # Memory corruption of weights or optimizer state between steps: restore a verified state.
    "state_checksum:*": ["rollback"],
    "attention_logit:high": ["qk_clip"],
    # Without a replay (replay disabled or impossible) the safe answer is not to apply the step.
    "*:unverified": ["veto"],
    # The ledger saw this site fail `strikes` times (or the device is faulty): repairing again is
    # futile. Exclude the device -- in one process, stop cleanly -- with a verified state.
    "*:persistent": ["veto", "quarantine"],
    "state_checksum:persistent": ["rollback", "quarantine"],
}


VERDICTS: dict[str, tuple[str, ...]] = {
    # Findings checked after backward: the guard replays the step and the finding takes the
    # replay's verdict (``Guard.decide``; under DDP the rank replay's, ``sdcscope.guard.ranks``).
    # ``persistent``: the device ledger's verdict on a finding repeated at one site
    # (:mod:`sdcscope.guard.strikes`).
    "abft": ("transient", "reproducible", "unverified", "persistent"),
    "nonfinite": ("transient", "reproducible", "unverified", "persistent"),
    "spike": ("transient", "reproducible", "unverified", "persistent"),
    # Weights / optimizer state that changed between steps: no replay, the verdict stays.
    "state_checksum": ("corrupt", "persistent"),
    "attention_logit": ("high",),
}
"""The detectors whose findings the policy decides, and the verdicts they reach it with (the
detectors' ``name`` and the verdicts the guard gives their findings). The rank guard's own
detectors (``crossrank``, ``replica_hash``, ``rank_replay``, ``quarantine``) act by themselves
and never reach the table."""
_ALL_VERDICTS = tuple(dict.fromkeys(v for vs in VERDICTS.values() for v in vs))


def known_verdicts() -> dict[str, tuple[str, ...]]:
    """:data:`VERDICTS` and the detectors registered through :mod:`sdcscope.detect.protocol`
    (their findings reach the policy with a replay verdict, as a built-in's do)."""
    from sdcscope.detect.protocol import registered

    extra = {r.name: VERDICTS["abft"] for r in registered() if r.name not in VERDICTS}
    return {**VERDICTS, **extra}


def _check_key(key: object) -> str:
    verdicts = known_verdicts()
    if not isinstance(key, str) or key.count(":") != 1:
        raise (ValueError if isinstance(key, str) else TypeError)(
            f"policy key {key!r} must look like 'detector:verdict' ('*' allowed); "
            f"detectors: {', '.join(verdicts)}; verdicts: {', '.join(_ALL_VERDICTS)}"
        )
    detector, verdict = (part.strip() for part in key.split(":"))
    if detector != "*" and detector not in verdicts:
        raise ValueError(
            f"policy key {key!r}: unknown detector {detector!r}{did_you_mean(detector, verdicts)}; "
            f"allowed: {', '.join(verdicts)}, *"
        )
    allowed = _ALL_VERDICTS if detector == "*" else verdicts[detector]
    if verdict != "*" and verdict not in allowed:
        whose = "" if detector == "*" else f" for detector {detector!r}"
        raise ValueError(
            f"policy key {key!r}: unknown verdict {verdict!r}{whose}{did_you_mean(verdict, allowed)}; "
            f"allowed: {', '.join(allowed)}, *"
        )
    return f"{detector}:{verdict}"


@dataclass(kw_only=True)
class PolicyConfig:
    """``rules``: ``"detector:verdict"`` -> actions, merged over :data:`DEFAULT_RULES` (a given
    key replaces that default's actions); ``defaults: false``: no default rules, only ``rules``."""

    rules: dict[str, list[str]] = field(default_factory=dict)
    defaults: bool = True

    def __post_init__(self) -> None:
        check_bool("policy defaults", self.defaults)
        if not isinstance(self.rules, Mapping):
            raise TypeError(f"policy rules must be a mapping of 'detector:verdict' to actions, got {self.rules!r}")
        given: dict[str, list[str]] = {}
        for key, actions in self.rules.items():
            norm = _check_key(key)
            if isinstance(actions, str):
                actions = [actions]
            if not isinstance(actions, (list, tuple)):
                raise TypeError(
                    f"policy rule {key!r}: {actions!r} must be an action or a list of actions; "
                    f"allowed: {', '.join(ACTIONS)}"
                )
            for action in actions:
                check_choice(f"policy action in rule {key!r}:", action, ACTIONS)
            if norm in given and norm != key:
                raise ValueError(f"policy key {key!r} repeats {norm!r}")
            given[norm] = list(actions)
        base = {k: list(v) for k, v in DEFAULT_RULES.items()} if self.defaults else {}
        self.rules = {**base, **given}

    def actions_for(self, detector: str, verdict: str) -> list[str]:
        for key in (f"{detector}:{verdict}", f"*:{verdict}", f"{detector}:*", "*:*"):
            if key in self.rules:
                return list(self.rules[key])
        return ["report"]
