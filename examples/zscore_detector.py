"""An external-style detector for ``sdcscope score``: a loss-spike z-score over the training loss.

    sdcscope score runs/camp-balanced --detector examples/zscore_detector.py:detect

The scoreboard calls ``detect(rows)`` once per trial with its per-step metrics rows (``[{"step": 0,
"loss": 5.5}, ...]``) and scores the verdicts it returns: dicts with ``step`` and optionally
``verdict``, ``rank``, ``layer``, ``element``. This one knows nothing of sdcscope: it flags a step
whose loss is not finite, or lies more than ``Z`` standard deviations above the mean of the
``WINDOW`` losses before it (after ``WARMUP`` steps of history). It cannot localize: it names no
rank, layer or element.
"""

from __future__ import annotations

import math
import statistics

WINDOW = 16
WARMUP = 8
Z = 4.0


def detect(rows: list[dict]) -> list[dict]:
    found, history = [], []
    for row in rows:
        x = row.get("loss")
        if x is None or not math.isfinite(x):
            found.append({"step": row["step"], "verdict": "nonfinite_loss"})
            continue
        recent = history[-WINDOW:]
        if len(recent) >= WARMUP:
            mean, sd = statistics.fmean(recent), statistics.pstdev(recent)
            if sd > 0 and (x - mean) / sd > Z:
                found.append({"step": row["step"], "verdict": "loss_zscore"})
                continue  # a spike is not history the next steps are judged against
        history.append(x)
    return found
