"""Cost of the cross-rank signature check on a DDP training step (2 ranks, gloo, CPU).

    python benchmarks/bench_crossrank_overhead.py [--rounds 40] [--nproc 2] [--batch-size 16]

Two DDP trainers share one world: the engine's DDP trainer (the baseline; its comm hook without
stages averages like DDP's default hook) and the same with a
:class:`~sdcscope.mitigate.quarantine.RankGuard` gathering per-parameter pre-reduction
signatures every step (fp64 norms and bit checksums, one asynchronous all-reduce issued in the
hook, the robust test, the one-step-late check of the reduced buckets). Every rank runs
the same interleaved schedule (the collectives line up); rank 0 prints the median per-round
ratio. The replica hash check (every N steps) is off here; its cost per check is printed apart.
Target: signature check ≤ 5% per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_ratio  # noqa: E402


def _rank(rank: int, world: int, rounds: int, batch_size: int) -> None:
    import torch

    from sdcscope.engine import TrainConfig
    from sdcscope.engine.ddp import DDPTrainer, DistConfig, init_distributed
    from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig
    from sdcscope.workloads import WorkloadConfig, make_workload

    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=120))
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=batch_size))
    base = DDPTrainer(workload, TrainConfig(seed=0))
    tool = DDPTrainer(workload, TrainConfig(seed=0))
    guard = RankGuard(tool.ddp, tool.optimizer, config=RankGuardConfig(hash_every=0))
    tool.add_callback(guard)
    noise, _, _ = interleaved_ratio(base.train_step, base.train_step, rounds=rounds)
    ratio, tb, tt = interleaved_ratio(base.train_step, tool.train_step, rounds=rounds)
    hash_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        guard.hashes.check(tool.step)
        hash_times.append(time.perf_counter() - t0)
    if rank == 0:
        events = sum(1 for e in guard.events if e.verdict != "quarantined")
        print(f"{world} ranks, tiny GPT, batch {batch_size}/rank: baseline {tb * 1e3:6.2f} ms/step, "
              f"with signatures {tt * 1e3:6.2f} ms/step ({events} events)")
        print(f"noise floor (baseline against itself): {100 * (noise - 1):+.2f}%")
        print(f"replica hash check: {statistics.median(hash_times) * 1e3:.2f} ms per check "
              f"({100 * statistics.median(hash_times) / tb:.1f}% of a step; run every N steps)")
        print(f"cross-rank signature check overhead per step at {world} ranks (CPU, gloo): "
              f"{100 * (ratio - 1):+.2f}% (target <= 5%)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    from sdcscope.engine.ddp import spawn

    spawn(_rank, args.nproc, (args.rounds, args.batch_size), timeout_s=1800)


if __name__ == "__main__":
    main()
