"""False positives of the guard on clean runs: the events of each profile over 2,000 steps × 3
seeds of the engine's training of the tiny GPT.

    python benchmarks/bench_guard_clean.py [--steps 2000] [--seeds 0 1 2] [--profiles ...]
        [--workload gpt|moe|cnn] [--batch-size 16] [--compile]

Workload: the ``tiny`` GPT preset on the default corpus (the standard library's sources) at its
default batch (16; at batch 8 the noisier loss gives seed 2 a real gradient spike at step 460,
reproduced by the replay: the data, not the hardware, and the guard says so), ``--workload moe``
(the tiny mixture-of-experts GPT: ABFT on the router and every expert's GEMMs, and the exact
dispatch check of every token permutation), or ``--workload cnn`` (the tiny LeNet on the digits,
its default batch). Each profile is taken by name
(``GuardConfig(profile=...)``, whatever :data:`sdcscope.guard.config.PROFILES` makes of it) and
drives the engine's trainer through its callback, every step, from step 0 (``--compile``: the
trainer runs through ``torch.compile`` and ABFT checks inside the graph). Every event is
printed (step, detector, verdict, module, action, evidence): on a clean run each one is a false
positive. The last line holds the events per profile. One torch thread: the tiny model gains
nothing from more, and on shared cores extra threads spin.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.guard import GuardConfig
from sdcscope.guard.config import PROFILES
from sdcscope.jobs.assemble import guard_trainer
from sdcscope.workloads import WorkloadConfig, make_workload

SHOWN = 20  # events printed per run


def clean_run(workload, profile: str, seed: int, steps: int, compile: bool = False) -> tuple[list[dict], float]:
    """The guard's events over ``steps`` clean steps from a fresh model of ``seed``, and the
    final validation loss (``compile``: the trainer compiles; ABFT checks inside the graph)."""
    trainer = Trainer(workload, TrainConfig(seed=seed, compile=compile))
    guard = guard_trainer(trainer, GuardConfig(profile=profile))
    trainer.add_callback(guard.callback(trainer))
    for _ in range(steps):
        trainer.train_step()
        if guard.stopped:
            break
    val = trainer.evaluate()["val_loss"]
    guard.close()
    return list(guard.events), val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--workload", default="gpt", choices=["gpt", "moe", "cnn"])
    parser.add_argument("--batch-size", type=int, default=None, help="default: the workload's own")
    parser.add_argument("--compile", action="store_true", help="train through torch.compile (ABFT in the graph)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    batch = args.batch_size
    workload = make_workload(WorkloadConfig(workload=args.workload, preset="tiny", batch_size=batch))
    print(
        f"{args.workload} tiny, batch {workload.config.batch_size}, {args.steps} steps x seeds "
        f"{' '.join(map(str, args.seeds))}, profiles {' '.join(args.profiles)}{', compiled' if args.compile else ''}",
        flush=True,
    )
    t_all = time.perf_counter()
    totals = {}
    for profile in args.profiles:
        totals[profile] = 0
        for seed in args.seeds:
            t0 = time.perf_counter()
            events, val = clean_run(workload, profile, seed, args.steps, args.compile)
            dt = time.perf_counter() - t0
            print(
                f"{profile:8s} seed {seed}: {len(events)} events in {args.steps} steps "
                f"(val loss {val:.3f}, {dt:.0f} s, {1e3 * dt / args.steps:.0f} ms/step)",
                flush=True,
            )
            for e in events[:SHOWN]:
                print(
                    f"    step {e['step']} {e['detector']}:{e['verdict']} module={e.get('module')} "
                    f"action={e.get('action')} evidence={e.get('evidence')}",
                    flush=True,
                )
            if len(events) > SHOWN:
                print(f"    ... {len(events) - SHOWN} more", flush=True)
            totals[profile] += len(events)
    print(f"wall {time.perf_counter() - t_all:.0f} s")
    print(
        f"clean{' compiled' if args.compile else ''} {args.steps} steps x {len(args.seeds)} seeds: "
        + ", ".join(f"{p} {n}{' events' if i == 0 else ''}" for i, (p, n) in enumerate(totals.items()))
    )


if __name__ == "__main__":
    main()
