"""Campaign efficiency: trial time against the compute floor of the steps the trials ran.

    python benchmarks/bench_campaign_throughput.py [--trials 30] [--horizon 50] [--workers 1 2]
        [--repeats 3] [--ray] [--slurm]

Runs fresh campaigns (golden run, 3 healthy baselines, the perturbation twins, then ``--trials``
single-bit flips in the GEMMs of every Linear of the tiny GPT, ``--horizon`` steps each) with
local worker processes, one torch thread each, the worker counts interleaved, ``--repeats``
rounds. A trial's floor is the campaign's own golden step time x the optimizer steps it ran;
efficiency = sum of floors / worker time spent on trials, in wall and CPU time (the CPU figure is
blind to other jobs on the machine), per worker and over all (``sdcscope.study.timing``). The
fixed costs (start-up, golden, baselines, twins) and the share of the trial phase the workers
were busy are printed apart, with the load average beside each run. ``--ray`` adds a run on a
private Ray cluster (skipped, saying why, when ``ray`` is not importable); ``--slurm`` adds, in
every round, a run with the largest worker count as a job array through submitit's local executor
(``sdcscope.study.slurm``: task start-up, the queue and result files, the runner's polling), and
the last line its median end-to-end time over the local pool's. The trials/hour line
is informative; the last line is the median efficiency per worker count (target >= 0.9 on 2
workers on a quiet machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
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


def campaign(trials: int, horizon: int, workers: int, ray: bool = False, slurm: bool = False) -> dict:
    """One fresh campaign; its run timing (``run_campaign``'s ``timing``) and the load averages."""
    from sdcscope.study import init_campaign, run_campaign

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "campaign.yaml")
        spec.write_text(SPEC.format(horizon=horizon, trials=trials))
        load = os.getloadavg()[0]
        init_campaign(Path(tmp, "c"), spec)
        summary = run_campaign(
            Path(tmp, "c"),
            workers=workers,
            ray_address="local" if ray else None,
            slurm={"cluster": "local", "poll_s": 0.5} if slurm else None,
        )
    return {**summary["timing"], "load": (load, os.getloadavg()[0]), "outcomes": summary["outcomes"]}


def show(label: str, t: dict, trials: int) -> None:
    ph, tr = t["phases"], t["trials"]
    each = ", ".join(
        f"{w['efficiency']:.3f}/{w['cpu_efficiency']:.3f} ({w['trials']} trials)" for w in t["workers"].values()
    )
    print(
        f"{label}: efficiency wall {tr['efficiency']:.3f} cpu {tr['cpu_efficiency']:.3f}; per worker wall/cpu {each}; "
        f"busy {t['busy_share']:.0%} of the trial phase ({ph['trials']:.1f} s, {3600 * trials / ph['trials']:.0f} "
        f"trials/h); golden step {1e3 * t['golden']['step_s']:.2f} ms ({1e3 * t['golden']['step_cpu_s']:.2f} ms cpu); "
        f"fixed: startup {ph.get('startup', 0):.1f} s, golden {ph.get('golden', 0):.1f} s (job "
        f"{t['golden']['wall_s']:.1f} s), baselines {ph.get('baseline', 0):.1f} s, twins {ph.get('twins', 0):.1f} s; "
        f"whole {t['total_s']:.1f} s; load {t['load'][0]:.1f}->{t['load'][1]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also run on a private Ray cluster (2 actors)")
    parser.add_argument("--slurm", action="store_true", help="also run through submitit's local executor")
    args = parser.parse_args()
    runs: dict[int, list[dict]] = {n: [] for n in args.workers}
    top, slurm = max(args.workers), []
    for r in range(args.repeats):
        for n in args.workers if r % 2 == 0 else args.workers[::-1]:  # interleaved against drifting load
            runs[n].append(campaign(args.trials, args.horizon, n))
            show(f"round {r} {n} worker{'s' * (n > 1)}", runs[n][-1], args.trials)
            if args.slurm and n == top:
                slurm.append(campaign(args.trials, args.horizon, n, slurm=True))
                show(f"round {r} submitit local, {n} task{'s' * (n > 1)}", slurm[-1], args.trials)
    if args.ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray: skipped (ray is not importable here; pip install 'sdcscope[ray]')")
        else:
            show("ray 2 actors", campaign(args.trials, args.horizon, 2, ray=True), args.trials)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for n, ts in runs.items():
        rate = med([3600 * args.trials / t["phases"]["trials"] for t in ts])
        print(
            f"{n} worker{'s' * (n > 1)}: trials/hour {rate:.0f} "
            f"(trial phase), {med([3600 * args.trials / t['total_s'] for t in ts]):.0f} end to end; fixed costs "
            f"{med([t['total_s'] - t['phases']['trials'] for t in ts]):.1f} s"
        )
    figures = ", ".join(
        f"{n} worker{'s' * (n > 1)} wall {med([t['trials']['efficiency'] for t in ts]):.3f} "
        f"cpu {med([t['trials']['cpu_efficiency'] for t in ts]):.3f}"
        for n, ts in runs.items()
    )
    loads = [x for ts in runs.values() for t in ts for x in t["load"]]
    if slurm:
        ratio = med([s["total_s"] / p["total_s"] for s, p in zip(slurm, runs[top])])
        figures += (
            f"; submitit local {top} tasks wall {med([t['trials']['efficiency'] for t in slurm]):.3f} cpu "
            f"{med([t['trials']['cpu_efficiency'] for t in slurm]):.3f}, end to end {ratio:.2f}x the local pool's"
        )
    print(
        f"campaign efficiency vs the compute floor (golden step x steps run, median of {args.repeats}, "
        f"horizon {args.horizon}): {figures}; load {min(loads):.1f}-{max(loads):.1f} (target >= 0.9 on 2 workers)"
    )


if __name__ == "__main__":
    main()
