"""Campaign throughput: trials per hour on the tiny GPT with a 50-step horizon.

    python benchmarks/bench_campaign_throughput.py [--trials 40] [--horizon 50] [--workers 2]

Runs a fresh campaign (golden run, 3 healthy baselines, then ``--trials`` single-bit flips in the
GEMMs of every Linear) with local worker processes, one torch thread each. The trial phase is
timed from its first submission to its last committed row; the last line prints trials/hour for
it and for the whole campaign (start-up, golden run and baselines included). The issue asks
>= 1,000 trials/hour on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SPEC = """
name: throughput
workload: {{name: gpt, preset: tiny, eval_batches: 2}}
inject_steps: [20]
horizon: {horizon}
faults:
  sites: [gemm.forward, gemm.grad_input, gemm.grad_weight]
  targets: ["blocks.*.attn.*_proj", "blocks.*.mlp.*", head]
  bits: ["0-31"]
sampling: {{kind: random, n: {trials}, seed: 0}}
baseline: {{seeds: [101, 102, 103]}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    from sdcscope.study import init_campaign, run_campaign

    marks: dict[str, float] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if phase == "trials" and done == 0:
            marks["start"] = time.perf_counter()
        if phase == "trials" and done == total:
            marks["end"] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "campaign.yaml")
        spec.write_text(SPEC.format(horizon=args.horizon, trials=args.trials))
        t0 = time.perf_counter()
        init_campaign(Path(tmp, "c"), spec)
        summary = run_campaign(Path(tmp, "c"), workers=args.workers, progress=progress)
        total = time.perf_counter() - t0
    phase = marks["end"] - marks["start"]
    print(f"{summary['done']} trials, outcomes {summary['outcomes']}")
    print(
        f"trial phase {phase:.1f} s ({phase / args.trials:.2f} s/trial), whole campaign {total:.1f} s, "
        f"{args.workers} workers, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"trials/hour: {3600 * args.trials / phase:.0f} (trial phase, horizon {args.horizon}); "
        f"{3600 * args.trials / total:.0f} end to end"
    )


if __name__ == "__main__":
    main()
