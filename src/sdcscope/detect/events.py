"""The detection record: one :class:`Event` per finding, one line of ``events.jsonl`` each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdcscope.observe import jsonable

GEMMS = ("forward", "grad_input", "grad_weight")


@dataclass
class Event:
    """What a detector found at ``step``.

    ``verdict`` is the finding (``'nonfinite'``, ``'spike'``, ``'checksum_mismatch'``, ...);
    ``module`` the qualified module (or parameter) name when known; ``gemm`` which product of a
    GEMM layer (``'forward'`` Y = XWᵀ, ``'grad_input'`` dX, ``'grad_weight'`` dW); ``index`` the
    element (multi-index into that tensor; ``None`` entries where only one checksum fired);
    ``evidence`` the numbers behind the verdict; ``action`` is filled in by a mitigation.
    """

    step: int
    detector: str
    verdict: str
    module: str | None = None
    gemm: str | None = None
    rank: int | None = None
    index: tuple[int | None, ...] | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    action: str | None = None

    def __post_init__(self) -> None:
        if self.gemm is not None and self.gemm not in GEMMS:
            raise ValueError(f"gemm={self.gemm!r}; allowed: {', '.join(GEMMS)}")

    @property
    def actions(self) -> list[str]:
        """The actions taken on this finding, most decisive first (:func:`actions_of`)."""
        return actions_of({"action": self.action})

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON dict for ``events.jsonl`` (non-finite floats as ``"nan"``/``"inf"``)."""
        return jsonable(
            {
                "step": self.step,
                "detector": self.detector,
                "verdict": self.verdict,
                "module": self.module,
                "gemm": self.gemm,
                "rank": self.rank,
                "index": None if self.index is None else list(self.index),
                "evidence": dict(self.evidence),
                "action": self.action,
            }
        )


def actions_of(record: dict[str, Any]) -> list[str]:
    """The actions an ``events.jsonl`` record says were taken: its ``action`` field names them,
    comma-separated, most decisive first (``report`` when none)."""
    return [a.strip() for a in (record.get("action") or "report").split(",") if a.strip()] or ["report"]
