"""Cost of the state checksum: the position-sensitive block sums against the plain int64 word sum
they replaced (which cancels), on the weights and Adam state of a GPT preset.

    python benchmarks/bench_state_checksum.py [--preset small] [--repeats 15]

Baseline and tool are interleaved in one process; the median ratio (new / old) is the last line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sdcscope.detect.state import StateChecksum
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.workloads import WorkloadConfig, make_workload


def plain_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The former checksum: each tensor's stored words summed in int64."""
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.stack([t.detach().reshape(-1).view(view[t.element_size()]).sum(dtype=torch.int64) for t in tensors])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    trainer = Trainer(make_workload(WorkloadConfig(workload="gpt", preset=args.preset)), TrainConfig(seed=0))
    trainer.train_step()  # Adam state exists
    check = StateChecksum(trainer.model, trainer.optimizer)
    _, tensors = check._tensors()
    words = sum(t.numel() * t.element_size() // 4 for t in tensors)
    check.record()
    old, new = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plain_sums(tensors).tolist()
        t1 = time.perf_counter()
        assert check.verify(1) == []
        t2 = time.perf_counter()
        old.append(t1 - t0)
        new.append(t2 - t1)
    o, n = statistics.median(old), statistics.median(new)
    print(f"gpt {args.preset}: {len(tensors)} tensors, {words / 1e6:.2f} M words, {args.threads} threads")
    print(f"plain int64 sum (old, cancels): {o * 1e3:.2f} ms; block sums (new): {n * 1e3:.2f} ms")
    print(f"state checksum verify cost ratio new/old (median of {args.repeats}): {n / o:.2f}")


if __name__ == "__main__":
    main()
