"""False positives of the default guard on clean runs: events over 2,000 steps of the tiny GPT.

python benchmarks/bench_guard_clean.py [--steps 2000] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import time

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny"))
    total = 0
    for seed in args.seeds:
        t0 = time.perf_counter()
        trainer = Trainer(workload, TrainConfig(seed=seed))
        guard = Guard(trainer.model, trainer.optimizer, GuardConfig())
        trainer.add_callback(guard.callback())
        for _ in range(args.steps):
            trainer.train_step()
        val = trainer.evaluate()["val_loss"]
        print(
            f"seed {seed}: {len(guard.events)} events in {args.steps} steps "
            f"(val loss {val:.3f}, {time.perf_counter() - t0:.0f} s)"
        )
        for e in guard.events[:5]:
            print("   ", e)
        total += len(guard.events)
    print(f"clean runs: {total} events over {args.steps} steps x {len(args.seeds)} seeds")


if __name__ == "__main__":
    main()
