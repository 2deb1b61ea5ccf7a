"""Per-step overhead of invariant checking and of tracing, on the tiny GPT.

Invariants are inferred from two short traced clean runs of the tiny GPT (seeds 1 and 2).
Then three identical trainers (seed 0) train side by side in one process: one bare, one with
an ``InvariantChecker`` attached as an engine callback, one with a ``TraceRecorder`` writing
``trace.jsonl`` (what inference needs).  Each round runs one step of each, in rotating order,
so machine noise and drift hit all three alike; a round's ratio is tool step time / bare step
time, and the reported figure is the median ratio over rounds.

Step time is, by default, the CPU time of the training thread (``time.thread_time``, with
torch held to one thread so that all of a step's work is on that thread): on a machine shared
with other jobs, being descheduled then costs nothing, and what remains is the work each mode
does.  ``--clock wall`` times wall-clock steps with torch's default threads instead, which is
meaningful on an otherwise idle machine only.  The added time per step is printed too: it is
what the tool costs whatever the step time of the setting.

    python benchmarks/bench_invariants_overhead.py [--rounds 300] [--clock wall]

The last line states the figures (targets: checking <= 3%, tracing <= 20%).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.invariants import InvariantChecker, TraceRecorder, infer_invariants
from sdcscope.workloads import WorkloadConfig, make_workload

MODES = ("bare", "check", "trace")


def trainer(seed: int) -> Trainer:
    return Trainer(make_workload(WorkloadConfig(workload="gpt", preset="tiny")), TrainConfig(seed=seed))


def traced_reference(seed: int, steps: int, out: Path) -> Path:
    tr = trainer(seed)
    rec = TraceRecorder(tr.model, tr.optimizer, out=out).attach()
    tr.add_callback(rec)
    for _ in range(steps):
        tr.train_step()
    tr.evaluate()
    rec.detach()
    return out


def timed_step(tr: Trainer, clock) -> float:
    t0 = clock()
    tr.train_step()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300, help="timed steps per mode")
    ap.add_argument("--ref-steps", type=int, default=40, help="steps of each reference run")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="wall: perf_counter; cpu: thread CPU time with one torch thread",
    )
    args = ap.parse_args()
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        refs = [traced_reference(s, args.ref_steps, tmp / f"ref{s}") for s in (1, 2)]
        invariants = infer_invariants(refs)
        trainers = {m: trainer(0) for m in MODES}
        checked, traced = trainers["check"], trainers["trace"]
        checker = InvariantChecker(checked.model, checked.optimizer, invariants).attach()
        recorder = TraceRecorder(traced.model, traced.optimizer, out=tmp / "run").attach()
        trainers["check"].add_callback(checker)
        trainers["trace"].add_callback(recorder)
        for tr in trainers.values():  # warm-up
            for _ in range(5):
                tr.train_step()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:
                times[mode].append(timed_step(trainers[mode], clock))
        checker.detach()
        recorder.detach()
    ratios = {m: [t / b for t, b in zip(times[m], times["bare"])] for m in ("check", "trace")}
    median = {m: statistics.median(r) for m, r in ratios.items()}
    added = {m: statistics.median(t - b for t, b in zip(times[m], times["bare"])) * 1e3 for m in ratios}
    print(
        f"tiny GPT, {args.rounds} rounds, {args.clock} clock, {torch.get_num_threads()} torch thread(s): "
        f"bare step {statistics.median(times['bare']) * 1e3:.2f} ms; "
        f"{len(invariants)} invariants inferred from 2 x {args.ref_steps} clean steps"
    )
    for m in ("check", "trace"):
        q = statistics.quantiles(ratios[m], n=4)
        print(
            f"  {m:5s} step {statistics.median(times[m]) * 1e3:.2f} ms, median ratio {median[m]:.4f} "
            f"(quartiles {q[0]:.3f} .. {q[2]:.3f}), median added time {added[m]:.3f} ms/step"
        )
    print(f"  violations raised while checking {args.rounds + 5} clean steps: {len(checker.violations)}")
    print(
        f"checking overhead {100 * (median['check'] - 1):+.2f}% per step ({added['check']:+.2f} ms; "
        f"target <= 3%), tracing overhead {100 * (median['trace'] - 1):+.2f}% per step "
        f"({added['trace']:+.2f} ms; target <= 20%)"
    )


if __name__ == "__main__":
    main()
