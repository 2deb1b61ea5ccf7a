"""What the guard costs inside a compiled graph: the ``full`` profile (ABFT on every Linear's Y, dX
and dW, through graph taps) on a ``torch.compile``d training step, against the same compiled step
unguarded, in fp32 and under bf16 autocast.

    python benchmarks/bench_compiled_guard.py [--threads 1 2] [--rounds 9] [--inner 3]
        [--dtypes fp32 bf16] [--eager-guard]

Workload: the d=128, 4-layer, seq-128 GPT (``small`` preset) at batch 16, the engine's trainer
(forward, backward, clip, AdamW), inductor. Trainers of the same seed train side by side: eager
unguarded, compiled unguarded, compiled + guard ``full``, compiled + its ABFT alone (no other
detector), and with ``--eager-guard`` eager + guard ``full``; each round runs ``inner`` steps of
each, in an order that rotates, timing wall and process CPU time. Ratios are medians over rounds of
the per-round ratios. Printed per (threads, dtype): compiled+guard / compiled, compiled+ABFT alone /
compiled and compiled / eager (wall and CPU). The last line holds the compiled+guard / compiled
ratios (CPU time). On a loaded machine prefer 1 thread (idle OpenMP threads spin) and read the
CPU-time ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from sdcscope.engine import TrainConfig, Trainer  # noqa: E402
from sdcscope.guard import GuardConfig  # noqa: E402
from sdcscope.jobs.assemble import guard_trainer  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402


class AutocastTrainer(Trainer):
    """The engine's trainer with each micro-batch under bf16 autocast."""

    @contextlib.contextmanager
    def micro_step(self, micro_batch: int, accum: int):
        with super().micro_step(micro_batch, accum) as module, torch.autocast("cpu", dtype=torch.bfloat16):
            yield module


ABFT_ONLY = dict(metrics=None, nonfinite=None, loss_spike=None, grad_spike=None, state_checksum=None)


def build(kind: str, bf16: bool):
    workload = make_workload(WorkloadConfig(workload="gpt", preset="small", batch_size=16))
    cls = AutocastTrainer if bf16 else Trainer
    trainer = cls(workload, TrainConfig(seed=0, compile=kind.startswith("compiled")))
    guard = None
    if kind.endswith(("guard", "abft")):
        sections = ABFT_ONLY if kind.endswith("abft") else {}
        guard = guard_trainer(trainer, GuardConfig(profile="full", **sections))
        trainer.add_callback(guard.callback(trainer))
    return trainer, guard


def measure(bf16: bool, rounds: int, inner: int, eager_guard: bool) -> dict[str, dict[str, float]]:
    kinds = ["eager", "compiled", "compiled+guard", "compiled+abft"] + (["eager+guard"] if eager_guard else [])
    torch._dynamo.reset()  # each configuration compiles afresh (dynamo's per-function cache is bounded)
    runs = {k: build(k, bf16) for k in kinds}
    for trainer, _ in runs.values():  # compile and warm up
        for _ in range(3):
            trainer.train_step()
    times = {k: {"wall": [], "cpu": []} for k in kinds}
    for r in range(rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            trainer = runs[k][0]
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                trainer.train_step()
            times[k]["wall"].append((time.perf_counter() - w0) / inner)
            times[k]["cpu"].append((time.process_time() - c0) / inner)
    for k, (_, guard) in runs.items():
        if guard is not None:
            events = len(guard.events)
            guard.close()
            if events:
                print(f"  note: {k} raised {events} event(s) on a clean run", flush=True)

    def ratio(a: str, b: str, clock: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a][clock], times[b][clock]))

    out = {
        "guard": {c: ratio("compiled+guard", "compiled", c) for c in ("wall", "cpu")},
        "abft": {c: ratio("compiled+abft", "compiled", c) for c in ("wall", "cpu")},
        "compile": {c: ratio("compiled", "eager", c) for c in ("wall", "cpu")},
        "step_ms": {k: 1000 * statistics.median(times[k]["wall"]) for k in kinds},
    }
    if eager_guard:
        out["eager_guard"] = {c: ratio("eager+guard", "eager", c) for c in ("wall", "cpu")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--eager-guard", action="store_true", help="also time eager + guard full")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    last = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dt in args.dtypes:
            got = measure(dt == "bf16", args.rounds, args.inner, args.eager_guard)
            g, c = got["guard"], got["compile"]
            ms = ", ".join(f"{k} {v:.0f} ms" for k, v in got["step_ms"].items())
            line = (
                f"threads={threads} {dt}: compiled+guard full / compiled {g['wall']:.3f}x wall, {g['cpu']:.3f}x cpu; "
                f"ABFT alone {got['abft']['wall']:.3f}x wall, {got['abft']['cpu']:.3f}x cpu; "
                f"compiled / eager {c['wall']:.3f}x wall, {c['cpu']:.3f}x cpu"
            )
            if "eager_guard" in got:
                e = got["eager_guard"]
                line += f"; eager+guard full / eager {e['wall']:.3f}x wall, {e['cpu']:.3f}x cpu"
            print(line + f"  ({ms})", flush=True)
            last.append(f"{dt}@{threads}t {g['cpu']:.3f}x")
    print("compiled guard full / compiled (cpu): " + ", ".join(last))


if __name__ == "__main__":
    main()
