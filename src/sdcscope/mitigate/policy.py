"""The policy table: which in-job actions answer which detector verdict.

Keys are ``"detector:verdict"`` with ``*`` as a wildcard on either side; the most specific
matching rule wins (``abft:transient`` before ``*:transient`` before ``abft:*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sdcscope._validate import check_choice

ACTIONS = ("none", "veto", "recompute", "rollback", "skip_batch", "lr_backoff", "qk_clip", "quarantine",
           "report")
"""veto: skip the optimizer step (parameters and optimizer state untouched); recompute: use the
verified re-execution of the step; rollback: restore the last verified in-memory snapshot;
skip_batch: never train on this batch again; lr_backoff: scale the LR down, recovering linearly;
qk_clip: rescale W_q/W_k of a layer whose attention logits explode; quarantine: exclude a rank's
gradients from the all-reduce (distributed runs); report: event only."""

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
    # Memory corruption of weights or optimizer state between steps: restore a verified state.
    "state_checksum:*": ["rollback"],
    "attention_logit:high": ["qk_clip"],
    # Without a replay (replay disabled or impossible) the safe answer is not to apply the step.
    "*:unverified": ["veto"],
}


@dataclass(kw_only=True)
class PolicyConfig:
    rules: dict[str, list[str]] = field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()})

    def __post_init__(self) -> None:
        if not isinstance(self.rules, dict):
            raise TypeError(f"policy rules must be a mapping of 'detector:verdict' to actions, got {self.rules!r}")
        for key, actions in self.rules.items():
            if not isinstance(key, str) or key.count(":") != 1:
                raise ValueError(f"policy key {key!r} must look like 'detector:verdict' ('*' allowed)")
            if isinstance(actions, str):
                actions = [actions]
            if not isinstance(actions, (list, tuple)):
                raise TypeError(f"policy rule {key!r}: {actions!r} must be an action or a list of actions; "
                                f"allowed: {', '.join(ACTIONS)}")
            actions = self.rules[key] = list(actions)
            for action in actions:
                check_choice("policy action", action, ACTIONS)

    def actions_for(self, detector: str, verdict: str) -> list[str]:
        for key in (f"{detector}:{verdict}", f"*:{verdict}", f"{detector}:*", "*:*"):
            if key in self.rules:
                return list(self.rules[key])
        return ["report"]
