"""Cost of the injector on a tiny-GPT training step (interleaved, median of repeats).

    python benchmarks/bench_inject_overhead.py [--rounds 15]

(1) armed: specs on every site of every Linear that do not fire this step (target ≤ 1%);
(2) firing: one single-element gemm.forward fault firing every step (target ≤ 5%).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_ratio  # noqa: E402
from sdcscope.engine import TrainConfig, Trainer  # noqa: E402
from sdcscope.faults import FaultSpec  # noqa: E402
from sdcscope.inject import Injector  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402

NEVER = {"kind": "transient", "step": 10**9}
ARMED = [
    {"site": "gemm.forward", "target": "blocks.*", "model": "bitflip", "bits": [30], "schedule": NEVER},
    {"site": "gemm.grad_weight", "target": "blocks.*", "model": "bitflip", "bits": [30], "schedule": NEVER},
    {"site": "param_grad", "target": "blocks.*.weight", "model": "bitflip", "bits": [30], "schedule": NEVER},
    {"site": "weight", "target": "blocks.*.weight", "model": "bitflip", "bits": [30], "schedule": NEVER},
    {"site": "optimizer_state", "target": "blocks.*.weight", "model": "bitflip", "bits": [30], "schedule": NEVER},
    {"site": "activation", "target": "blocks.*", "model": "bitflip", "bits": [30], "schedule": NEVER},
]
FIRING = [
    {
        "site": "gemm.forward",
        "target": "blocks.0.attn.q_proj",
        "model": "bitflip",
        "bits": [3],
        "pattern": {"kind": "element", "index": 5},
        "schedule": {"kind": "permanent", "start": 0},
    }
]


def trainer_with(specs):
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny"))
    trainer = Trainer(workload, TrainConfig(seed=0))
    if specs:
        inj = Injector(trainer.model, [FaultSpec.from_dict(s) for s in specs], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    base = trainer_with([])
    results = {}
    for name, specs in (("armed, not firing", ARMED), ("firing 1 element/step", FIRING)):
        tool = trainer_with(specs)
        ratio, tb, tt = interleaved_ratio(base.train_step, tool.train_step, rounds=args.rounds)
        results[name] = ratio
        print(f"{name:24s} baseline {tb * 1e3:6.2f} ms  tool {tt * 1e3:6.2f} ms  overhead {100 * (ratio - 1):+.2f}%")
    print("injector overhead per tiny-GPT step: " + ", ".join(f"{k} {100 * (v - 1):+.2f}%" for k, v in results.items()))


if __name__ == "__main__":
    main()
