"""Cost of the cross-rank signature check on a DDP training step (2 ranks, gloo, CPU).

    python benchmarks/bench_crossrank_overhead.py [--rounds 150] [--nproc 2] [--batch-size 16]

One DDP trainer (the engine's) with a :class:`~sdcscope.mitigate.quarantine.RankGuard`,
switched on and off between turns: on, it gathers per-parameter pre-reduction signatures every
step (norms and bit checksums riding in the last bucket's all-reduce, the robust test, the
one-step-late check of the reduced buckets); off, its hook stage returns at once and the bucket
is averaged as by DDP's default hook. The same model, optimizer and buffers serve both sides, so
the ratio holds the check's cost and not a second model's memory placement (two identical
trainers differ by several percent on a small CPU). Every rank runs the same interleaved
schedule (the collectives line up; one step per turn, many rounds: the ratio of single steps is
less noisy than that of 5-step turns); rank 0 prints the median per-round ratio.

Two clocks, read in the same rounds: the process's CPU time (all its threads, gloo's included),
which counts the work the check adds and is robust to other tenants of a shared machine; and
wall-clock time, which on a busy machine swings by several percent between identical runs (the
noise floor line shows how much). The replica hash check (every N steps) is off here; its cost
per check is printed apart. Target: signature check <= 5% per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]], *, rounds: int, inner: int = 1, warmup: int = 3
) -> dict[str, dict[str, float]]:
    """Run every function ``inner`` times per round, in a rotating order; per function the median
    over rounds of its time divided by the baseline's (``fns['base']``), for CPU and wall time."""
    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                fns[name]()
            cpu[name].append((time.process_time() - c0) / inner)
            wall[name].append((time.perf_counter() - w0) / inner)
    ratio = lambda d, n: statistics.median(t / b for t, b in zip(d[n], d["base"]))  # noqa: E731
    return {
        n: {
            "cpu": ratio(cpu, n),
            "wall": ratio(wall, n),
            "cpu_s": statistics.median(cpu[n]),
            "wall_s": statistics.median(wall[n]),
        }
        for n in names
    }


def _rank(rank: int, world: int, rounds: int, batch_size: int) -> None:
    import torch

    from sdcscope.engine import TrainConfig
    from sdcscope.engine.dist import DistConfig, init_distributed
    from sdcscope.engine.distributed import DistTrainer
    from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig
    from sdcscope.workloads import WorkloadConfig, make_workload

    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=120))
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=batch_size))
    trainer = DistTrainer(workload, TrainConfig(seed=0))
    guard = RankGuard(trainer.ddp, trainer.optimizer, config=RankGuardConfig(hash_every=0))
    signatures = guard.detector.signatures

    def base() -> None:  # the check switched off: the hook's stage returns at once
        if guard in trainer.callbacks:
            trainer.callbacks.remove(guard)
        signatures.sampled = False
        trainer.train_step()

    def tool() -> None:
        if guard not in trainer.callbacks:
            trainer.add_callback(guard)
        trainer.train_step()

    noise = interleaved({"base": base, "twin": base}, rounds=rounds)["twin"]
    m = interleaved({"base": base, "tool": tool}, rounds=rounds)
    hash_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        guard.hashes.check(trainer.step)
        hash_times.append(time.perf_counter() - t0)
    if rank == 0:
        events = sum(1 for e in guard.events if e.verdict != "quarantined")
        pct = lambda r: f"{100 * (r - 1):+.2f}%"  # noqa: E731
        step = m["base"]["wall_s"]
        print(
            f"{world} ranks, tiny GPT, batch {batch_size}/rank: check off {step * 1e3:6.2f} ms/step "
            f"({m['base']['cpu_s'] * 1e3:.2f} ms CPU), on {m['tool']['wall_s'] * 1e3:6.2f} ms/step "
            f"({m['tool']['cpu_s'] * 1e3:.2f} ms CPU; {events} events)"
        )
        print(f"noise floor (check off against itself): CPU time {pct(noise['cpu'])}, wall clock {pct(noise['wall'])}")
        print(
            f"replica hash check: {statistics.median(hash_times) * 1e3:.2f} ms per check "
            f"({100 * statistics.median(hash_times) / step:.1f}% of a step; run every N steps)"
        )
        print(
            f"cross-rank signature check overhead per step at {world} ranks (CPU, gloo): "
            f"{pct(m['tool']['cpu'])} CPU time, {pct(m['tool']['wall'])} wall clock (target <= 5%)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    from sdcscope.engine.dist import spawn

    spawn(_rank, args.nproc, (args.rounds, args.batch_size), timeout_s=1800)


if __name__ == "__main__":
    main()
