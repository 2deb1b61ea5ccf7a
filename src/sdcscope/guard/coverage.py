"""What the coverage matrix measured for a profile: how many of the silent transient GEMM faults
(no non-finite value, no spike: what only ABFT can see) it detected, read from the file
``benchmarks/bench_guard_coverage.py --write`` produced (``measured_coverage.json`` beside this
module), for the closing lines of ``sdcscope train --guard``. A sampling rate alone would
overstate it: a checked GEMM still passes a change below its threshold."""

from __future__ import annotations

import json
from pathlib import Path

MEASURED = Path(__file__).with_name("measured_coverage.json")


def measured_catch(profile: str, path: Path = MEASURED) -> str | None:
    """One sentence: the profile's detected share of silent transient faults per GEMM site, with
    the workload and the command that measured it; None where nothing was measured for it."""
    try:
        data = json.loads(path.read_text())
        counts = data["silent"][profile]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    measured = [(site, int(k), int(n)) for site, (k, n) in counts.items() if n]
    if not measured:
        return None
    hit, total = sum(k for _, k, _ in measured), sum(n for *_, n in measured)
    sites = ", ".join(f"{site} {k}/{n}" for site, k, n in measured)
    return (
        f"profile {profile} detected {hit} of {total} silent transient GEMM faults ({sites}) in the coverage "
        f"matrix ({data.get('workload', '?')}; {data.get('command', '?')})"
    )
