"""Guard cost per training step, interleaved with an unguarded twin in one process (median ratio).

    python benchmarks/bench_guard_overhead.py [--presets tiny small] [--rounds 41] [--clock cpu]

Configurations: (1) metrics + non-finite + spike detectors (target ≤ 3 %); (2) ABFT alone on every
Linear, forward/dX/dW, every step (target ≤ 15 % on CPU); (3) the same plus the attention products
(score and context MatMuls); (4) ABFT alone sampled to a 2 % budget (target ≤ 2 %); (5) the full
default guard (all of the above with ABFT every step, plus the weight/optimizer-state checksums).

``--hooks-only`` (analysis): ABFT's hooks, operand views and gradient captures run but record no
check — the floor of checking every GEMM through module hooks, whatever the checksum costs.

Each round times one step of each side, in alternating order (many short rounds: on this VM a
step timed against itself moved by +-4 % with 11 rounds of 5 steps, by +-1.5 % with 41 rounds of
one); the first line per preset is that noise floor, the baseline against itself.

``--clock cpu`` times with the process CPU clock (all threads): robust when other jobs share the
machine; the default wall clock is right on a quiet one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_ratio  # noqa: E402

from sdcscope.engine import TrainConfig, Trainer  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402

_ONLY_ABFT = dict(metrics=None, nonfinite=None, loss_spike=None, grad_spike=None, state_checksum=None)
CONFIGS = {
    "metrics+nonfinite+spike": dict(abft=None, state_checksum=None),
    "ABFT every Linear, every step": dict(_ONLY_ABFT, abft={"kinds": ["linear"]}),
    "ABFT + attention products": _ONLY_ABFT,
    "ABFT sampled to a 2% budget": dict(_ONLY_ABFT, abft={"budget": 0.02}),
    "full default guard": dict(),
}


def trainer(preset: str, guard: dict | None) -> Trainer:
    t = Trainer(make_workload(WorkloadConfig(workload="gpt", preset=preset)), TrainConfig(seed=0))
    if guard is not None:
        t.add_callback(Guard(t.model, t.optimizer, GuardConfig.from_dict(guard)).callback())
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--hooks-only", action="store_true", help="ABFT records no check (analysis)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                        help="subset of: " + "; ".join(CONFIGS).replace("%", "%%"))
    args = parser.parse_args()
    if args.hooks_only:
        from sdcscope.detect.abft import ABFTDetector

        ABFTDetector._record = lambda self, *a, **k: None
    summary = []
    for preset in args.presets:
        base = trainer(preset, None)
        noise, tb, _ = interleaved_ratio(base.train_step, base.train_step, rounds=args.rounds, inner=1,
                                         warmup=2, clock=args.clock)
        print(f"{preset:5s} {'noise floor (baseline vs itself)':30s} baseline {tb * 1e3:7.2f} ms  "
              f"{'':17s}overhead {100 * (noise - 1):+6.2f}%")
        for name in args.configs:
            cfg = CONFIGS[name]
            tool = trainer(preset, cfg)
            ratio, tb, tt = interleaved_ratio(base.train_step, tool.train_step, rounds=args.rounds,
                                              inner=1, warmup=2, clock=args.clock)
            print(f"{preset:5s} {name:30s} baseline {tb * 1e3:7.2f} ms  guarded {tt * 1e3:7.2f} ms  "
                  f"overhead {100 * (ratio - 1):+6.2f}%")
            summary.append(f"{preset}/{name} {100 * (ratio - 1):+.1f}%")
    print("guard overhead per step: " + "; ".join(summary))


if __name__ == "__main__":
    main()
