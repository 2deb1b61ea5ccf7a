"""Optimizer steps per second of the reference workloads on this machine.

    python benchmarks/bench_workloads.py [--seconds 5]

Each preset trains for a warm-up, then as many steps as fit in ``--seconds``; the last line
prints all figures (the issue asks ≥ 20 steps/s for the tiny GPT on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.workloads import WorkloadConfig, make_workload


def steps_per_second(workload: str, preset: str, seconds: float) -> float:
    trainer = Trainer(make_workload(WorkloadConfig(workload=workload, preset=preset)), TrainConfig())
    for _ in range(3):
        trainer.train_step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        trainer.train_step()
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    figures = []
    for workload, preset in [("gpt", "tiny"), ("gpt", "small"), ("cnn", "tiny")]:
        sps = steps_per_second(workload, preset, args.seconds)
        print(f"{workload:4s} {preset:6s} {sps:8.1f} steps/s")
        figures.append(f"{workload}-{preset} {sps:.1f}")
    print("steps/s: " + ", ".join(figures))


if __name__ == "__main__":
    main()
