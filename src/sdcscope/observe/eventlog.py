"""The guard's events where people and trackers look: one log line each, and running counts.

An event is an ``events.jsonl`` record (a dict: step, rank, detector, verdict, module, gemm,
action, evidence). :func:`event_line` is the one line the guard logs at WARNING for it;
:class:`EventCounts` keeps the counts a tracker plots (detections, actions, replays, rollbacks),
so a dashboard shows *that* the guard acted without reading the event file.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def actions_in(record: dict[str, Any]) -> list[str]:
    """The actions an event record names (its ``action`` field, comma-separated; ``report`` when none)."""
    return [a.strip() for a in str(record.get("action") or "report").split(",") if a.strip()] or ["report"]


def event_line(record: dict[str, Any]) -> str:
    """One line, ``key=value`` pairs a person reads and ``grep`` finds, for an event record::

    guard event: step=5 rank=0 detector=abft verdict=transient layer=blocks.0.fc gemm=forward action=recompute
    """

    def show(value: Any) -> str:
        return "-" if value is None or value == "" else str(value).replace(" ", "_")

    fields = (
        ("step", record.get("step")),
        ("rank", record.get("rank")),
        ("detector", record.get("detector")),
        ("verdict", record.get("verdict")),
        ("layer", record.get("module")),
        ("gemm", record.get("gemm")),
        ("action", record.get("action") or "report"),
    )
    return "guard event: " + " ".join(f"{k}={show(v)}" for k, v in fields)


class EventCounts:
    """Running counts of a guard's events.

    * ``detections[(detector, verdict)]`` -- every finding (the guard's reports about itself,
      detector ``guard``, are counted in ``reports`` instead);
    * ``actions[name]`` -- each action once per step it was taken (several findings of one step
      share one merged action);
    * ``replays`` -- steps re-executed to judge a finding (events carrying ``evidence.replay``);
    * ``rollbacks`` -- steps whose action was a rollback.
    """

    def __init__(self) -> None:
        self.detections: Counter[tuple[str, str]] = Counter()
        self.reports: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.replays = 0
        self.rollbacks = 0
        self._seen: set[tuple[Any, str]] = set()  # (step, action or "replay") counted already

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        """Count ``record``; returns what it added: ``{"detection": (detector, verdict) or None,
        "report": verdict or None, "actions": [new actions], "replay": bool, "rollback": bool}``."""
        step, detector, verdict = record.get("step"), str(record.get("detector")), str(record.get("verdict"))
        added: dict[str, Any] = {"detection": None, "report": None, "actions": [], "replay": False, "rollback": False}
        if detector == "guard":
            self.reports[verdict] += 1
            added["report"] = verdict
        else:
            self.detections[(detector, verdict)] += 1
            added["detection"] = (detector, verdict)
        for action in actions_in(record):
            if (step, action) not in self._seen:
                self._seen.add((step, action))
                self.actions[action] += 1
                added["actions"].append(action)
                if action == "rollback":
                    self.rollbacks += 1
                    added["rollback"] = True
        evidence = record.get("evidence")
        if isinstance(evidence, dict) and evidence.get("replay") and (step, "replay") not in self._seen:
            self._seen.add((step, "replay"))
            self.replays += 1
            added["replay"] = True
        return added

    def as_metrics(self, prefix: str = "sdcscope/") -> dict[str, float]:
        """Flat counts for a tracker: ``<prefix>detections``, ``<prefix>detector/<detector>``,
        ``<prefix>actions/<action>``, ``<prefix>replays``, ``<prefix>rollbacks``, ``<prefix>guard_reports``
        (no name is a folder of another: MLflow's file store keeps ``a/b`` under a folder ``a``)."""
        out: dict[str, float] = {
            f"{prefix}detections": float(sum(self.detections.values())),
            f"{prefix}replays": float(self.replays),
            f"{prefix}rollbacks": float(self.rollbacks),
            f"{prefix}guard_reports": float(sum(self.reports.values())),
        }
        by_detector: Counter[str] = Counter()
        for (detector, _), n in self.detections.items():
            by_detector[_SAFE.sub("_", detector)] += n
        for detector, n in sorted(by_detector.items()):
            out[f"{prefix}detector/{detector}"] = float(n)
        for action, n in sorted(self.actions.items()):
            out[f"{prefix}actions/{_SAFE.sub('_', action)}"] = float(n)
        return out
