"""Non-preemptive, in-job mitigations: veto, recompute, rollback + skip, LR backoff, ZClip, QK-clip,
quarantine of a data-parallel rank."""

from sdcscope.mitigate.clipping import LRBackoff, LRBackoffConfig, ZClip, ZClipConfig, qk_clip_
from sdcscope.mitigate.policy import ACTIONS, DEFAULT_RULES, PolicyConfig
from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig
from sdcscope.mitigate.snapshots import SnapshotConfig, SnapshotRing

__all__ = [
    "ACTIONS",
    "DEFAULT_RULES",
    "PolicyConfig",
    "LRBackoff",
    "LRBackoffConfig",
    "ZClip",
    "ZClipConfig",
    "qk_clip_",
    "SnapshotConfig",
    "SnapshotRing",
    "RankGuard",
    "RankGuardConfig",
]
