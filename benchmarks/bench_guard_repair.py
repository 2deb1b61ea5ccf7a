"""Repair in the job: golden / unguarded / guarded final validation loss for a set of faults.

    python benchmarks/bench_guard_repair.py [--steps 200] [--fault-step 120]

Each fault runs three times from the same seed and data (tiny GPT): golden, faulty without the
guard, faulty with the default guard. The last line counts the faults whose guarded run ends
within 0.5 % of golden (the target: every one that derails the unguarded run).
"""

from __future__ import annotations

import argparse
import math

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload


def faults(step: int) -> dict[str, dict]:
    flip = {"model": "bitflip", "bits": [30], "schedule": {"kind": "transient", "step": step}}
    return {
        "Y q_proj bit 30": {"site": "gemm.forward", "target": "blocks.0.attn.q_proj", "seed": 1, **flip},
        "Y mlp.fc bit 30": {"site": "gemm.forward", "target": "blocks.1.mlp.fc", "seed": 2, **flip},
        "dX mlp.proj bit 30": {"site": "gemm.grad_input", "target": "blocks.0.mlp.proj", "seed": 3, **flip},
        "dW v_proj bit 30": {"site": "gemm.grad_weight", "target": "blocks.1.attn.v_proj", "seed": 4, **flip},
        "scores bit 30": {"site": "gemm.forward", "target": "blocks.0.attn.score", "seed": 5, **flip},
        "weight fc bit 30": {"site": "weight", "target": "blocks.0.mlp.fc.weight", "seed": 6, **flip},
        "Adam v bit 30": {
            "site": "optimizer_state",
            "target": "blocks.1.mlp.proj.weight",
            "state_key": "exp_avg_sq",
            "seed": 7,
            **flip,
        },
        "Adam m bit 30": {
            "site": "optimizer_state",
            "target": "blocks.0.attn.k_proj.weight",
            "state_key": "exp_avg",
            "seed": 8,
            **flip,
        },
    }


def train(workload, steps: int, spec: dict | None, guard: bool) -> tuple[float, int]:
    trainer = Trainer(workload, TrainConfig(seed=0))
    if spec is not None:
        inj = Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    g = Guard(trainer.model, trainer.optimizer, GuardConfig()) if guard else None
    if g is not None:
        trainer.add_callback(g.callback())
    while trainer.step < steps:
        if not math.isfinite(trainer.train_step()["loss"]) and g is None:
            break
    return trainer.evaluate()["val_loss"], (len(g.events) if g else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault-step", type=int, default=120)
    args = parser.parse_args()
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny"))
    golden, _ = train(workload, args.steps, None, guard=False)
    print(f"golden val loss {golden:.4f}")
    print(f"{'fault':20s} {'unguarded':>10s} {'guarded':>10s} {'events':>6s}  guarded within 0.5%")
    derailed = repaired = within = 0
    rows = faults(args.fault_step)
    for name, spec in rows.items():
        bad, _ = train(workload, args.steps, spec, guard=False)
        good, n_events = train(workload, args.steps, spec, guard=True)
        ok = abs(good - golden) <= 0.005 * golden
        hurt = not math.isfinite(bad) or abs(bad - golden) > 0.005 * golden
        derailed += hurt
        repaired += hurt and ok
        within += ok
        print(
            f"{name:20s} {bad:10.4f} {good:10.4f} {n_events:6d}  {'yes' if ok else 'NO'}"
            f"{'  (unguarded derailed)' if hurt else ''}"
        )
    print(
        f"golden {golden:.4f}: {within}/{len(rows)} guarded runs within 0.5% of golden; "
        f"{repaired}/{derailed} faults that derailed the unguarded run repaired"
    )


if __name__ == "__main__":
    main()
