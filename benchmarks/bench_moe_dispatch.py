"""The price of the MoE dispatch check: a training step of the tiny mixture-of-experts GPT with
the ``dispatch`` detector against the same step without it.

    python benchmarks/bench_moe_dispatch.py [--rounds 15] [--inner 3] [--threads 1]

Two copies of the tiny MoE GPT from one seed train on the same batches (forward, backward, AdamW
step); one has :class:`~sdcscope.detect.DispatchCheck` attached and judged every step (its
hooks on both layers' dispatches, one host sync). Baseline and checked steps alternate in one
process (``benchmarks/_timing.py``: the median of per-round ratios), timed by the wall clock
and by process CPU time. The last line holds both ratios.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _timing import interleaved_ratio  # noqa: E402
from sdcscope.detect import DispatchCheck  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402


def stepper(workload, check: bool):
    """A function running one training step of a fresh tiny MoE GPT (seed 0), checked or not."""
    torch.manual_seed(0)
    model = workload.build_model()
    opt = workload.build_optimizer(model)
    detector = DispatchCheck(model).attach() if check else None
    steps = itertools.count()

    def step() -> None:
        s = next(steps)
        if detector is not None:
            detector.begin_step(s)
        opt.zero_grad()
        workload.loss(model, workload.batch(0, s % 64)).backward()
        if detector is not None:
            assert detector.check(s) == []
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = make_workload(WorkloadConfig(workload="moe", preset="tiny"))
    ratios = {}
    for clock in ("wall", "cpu"):
        ratio, base, tool = interleaved_ratio(
            stepper(workload, False), stepper(workload, True), rounds=args.rounds, inner=args.inner, clock=clock
        )
        ratios[clock] = ratio
        print(f"{clock:4s}: plain {1e3 * base:.1f} ms, checked {1e3 * tool:.1f} ms, ratio {ratio:.3f}", flush=True)
    print(f"dispatch check on the tiny MoE step: wall {ratios['wall']:.3f}x, cpu {ratios['cpu']:.3f}x")


if __name__ == "__main__":
    main()
