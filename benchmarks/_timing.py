"""Interleaved ratio timing shared by the benchmarks: baseline and tool alternate in one
process, and the median of per-round ratios is reported (robust to a noisy machine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}


def interleaved_ratio(
    baseline: Callable[[], None],
    tool: Callable[[], None],
    *,
    rounds: int = 15,
    inner: int = 5,
    warmup: int = 3,
    clock: str = "wall",
) -> tuple[float, float, float]:
    """Median over rounds of time(tool)/time(baseline); also the median seconds of each.
    ``clock``: ``wall``, ``cpu`` (process CPU time, all threads: robust when other jobs share
    the machine) or ``thread`` (CPU time of the calling thread)."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        baseline()
        tool()
    ratios, tb, tt = [], [], []
    for r in range(rounds):
        pair = [(baseline, tb), (tool, tt)] if r % 2 == 0 else [(tool, tt), (baseline, tb)]
        times = {}
        for fn, sink in pair:
            t0 = now()
            for _ in range(inner):
                fn()
            dt = (now() - t0) / inner
            sink.append(dt)
            times[id(sink)] = dt
        ratios.append(times[id(tt)] / times[id(tb)])
    return statistics.median(ratios), statistics.median(tb), statistics.median(tt)
