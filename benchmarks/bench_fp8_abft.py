"""ABFT of FP8 GEMMs on a d=128 GPT whose Linears run in FP8 (``precision: fp8``, preset
``small``: 4 layers, d=128, 128-byte context; e4m3 X and W, e5m2 dY, dynamic per-tensor scales).

    python benchmarks/bench_fp8_abft.py [--steps 1000] [--batch-size 8] [--trials 2] [--rounds 11] [--threads 1]

1. clean: ``--steps`` engine steps of the FP8 GPT under the guard's ``full`` profile (ABFT on every
   FP8 GEMM every step): its events (target 0) and ABFT's worst ratio over c per GEMM.
2. sensitivity: from the state after the clean run, for each FP8 Linear of block 0 and each GEMM
   (Y, dX, dW), ``--trials`` random elements of the GEMM's fp32 result are multiplied by (1 + δ)
   at the GEMM (a wrapper next to ``torch._scaled_mm``, where the injector's sits) and δ is
   bisected on a log2 scale to the smallest relative error ABFT flags in that step naming that
   layer and GEMM. Printed per GEMM: median and largest of those δ (relative to the element), and
   of |Δ| / max|C| (relative to the result's largest magnitude).
3. cost: a training step with ABFT on every FP8 GEMM against the same step without, interleaved,
   median of ``--rounds`` per-round ratios, wall and CPU clocks.

Last line: ``fp8 abft: clean N steps E events; smallest detected relative error (median) Y a, dX
b, dW c; abft cost wall x, cpu y``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_ratio  # noqa: E402
from sdcscope.common.fp8 import add_fp8_wrapper, is_fp8_linear  # noqa: E402
from sdcscope.detect import ABFTConfig, ABFTDetector  # noqa: E402
from sdcscope.engine import TrainConfig, Trainer  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402

GEMMS = ("forward", "grad_input", "grad_weight")
LABEL = {"forward": "Y", "grad_input": "dX", "grad_weight": "dW"}


class Perturb:
    """Multiplies element ``index`` of one GEMM's result by (1 + delta) when armed."""

    def __init__(self) -> None:
        self.gemm, self.index, self.delta, self.seen = None, 0, 0.0, None

    def around(self, module, call, inner):
        out = inner(call)
        if call.gemm != self.gemm:
            return out
        flat = out.reshape(-1)
        self.seen = (float(flat[self.index]), float(out.abs().max()), out.numel())
        if self.delta:
            out = out.clone()
            out.view(-1)[self.index] *= 1 + self.delta
        return out


def clean_run(workload, steps: int) -> tuple[Trainer, Guard, float, float]:
    trainer = Trainer(workload, TrainConfig(seed=0))
    guard = Guard(trainer.model, trainer.optimizer, GuardConfig(profile="full"))
    trainer.add_callback(guard.callback())
    t0 = time.perf_counter()
    loss = float("nan")
    while trainer.step < steps:
        loss = trainer.train_step().get("loss", loss)
    guard.detach()  # its checks are off from here: the sensitivity runs its own detector
    return trainer, guard, time.perf_counter() - t0, loss


def sensitivity(trainer: Trainer, trials: int) -> dict[str, list[tuple[float, float]]]:
    model, wl = trainer.model, trainer.workload
    batch = wl.batch(0, 10**6)
    det = ABFTDetector(model, ABFTConfig()).attach()
    layers = [(n, m) for n, m in model.named_modules() if is_fp8_linear(m) and n.startswith("blocks.0.")]
    gen = torch.Generator().manual_seed(0)
    found: dict[str, list[tuple[float, float]]] = {g: [] for g in GEMMS}
    step = [0]

    def flagged(name, gemm) -> bool:
        model.zero_grad(set_to_none=True)
        wl.loss(model, batch).backward()
        events = det.check(step[0])
        step[0] += 1
        return any(e.module == name and e.gemm == gemm for e in events)

    for name, mod in layers:
        p = Perturb()
        handle = add_fp8_wrapper(mod, p, order=0)
        for gemm in GEMMS:
            p.gemm, p.delta, p.index = gemm, 0.0, 0
            flagged(name, gemm)  # learns the result's size
            for _ in range(trials):
                p.index = int(torch.randint(p.seen[2], (1,), generator=gen))
                p.delta = 0.0
                flagged(name, gemm)
                value, peak, _ = p.seen
                lo, hi = -40.0, 4.0
                p.delta = 2.0**hi
                if not flagged(name, gemm):
                    found[gemm].append((float("inf"), float("inf")))
                    continue
                for _ in range(12):
                    mid = (lo + hi) / 2
                    p.delta = 2.0**mid
                    lo, hi = (lo, mid) if flagged(name, gemm) else (mid, hi)
                delta = 2.0**hi
                found[gemm].append((delta, delta * abs(value) / peak))
        handle.remove()
    det.detach()
    return found


def cost(workload, rounds: int) -> tuple[float, float]:
    trainer = Trainer(workload, TrainConfig(seed=0))
    model, batch = trainer.model, workload.batch(0, 0)
    det = ABFTDetector(model, ABFTConfig())

    def plain():
        model.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()

    def checked():
        det.attach()
        model.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
        det.check(0)
        det.detach()

    wall = interleaved_ratio(plain, checked, rounds=rounds, inner=2, clock="wall")[0]
    cpu = interleaved_ratio(plain, checked, rounds=rounds, inner=2, clock="cpu")[0]
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wl = make_workload(
        WorkloadConfig(workload="gpt", preset=args.preset, batch_size=args.batch_size, precision="fp8", eval_batches=2)
    )
    m = wl.model_config
    print(f"FP8 GPT {args.preset}: {m.n_layer} layers, d={m.d_model}, seq {m.block_size}, batch {args.batch_size}")

    trainer, guard, secs, loss = clean_run(wl, args.steps)
    events = len(guard.events)
    abft = guard.abft
    print(f"clean: {args.steps} steps in {secs:.0f} s, {events} events, final train loss {loss:.3f}")
    for e in guard.events[:20]:
        print("  event", e)
    if abft is not None:
        worst = {g: max((r for (n, gg), r in abft.max_ratio.items() if gg == g), default=0.0) for g in GEMMS}
        print("  worst clean ratio / c: " + ", ".join(f"{LABEL[g]} {worst[g] / abft.config.c:.3g}" for g in GEMMS))

    found = sensitivity(trainer, args.trials)
    med = {}
    for g in GEMMS:
        rel = [d for d, _ in found[g]]
        peak = [q for _, q in found[g]]
        med[g] = statistics.median(rel)
        print(
            f"sensitivity {LABEL[g]}: {len(rel)} elements, smallest detected relative error median {med[g]:.2e}, "
            f"largest {max(rel):.2e}; as |Δ|/max|C| median {statistics.median(peak):.2e}, largest {max(peak):.2e}"
        )

    wall, cpu = cost(wl, args.rounds)
    print(f"cost: ABFT on every FP8 GEMM / plain FP8 step: wall {wall:.3f}x, cpu {cpu:.3f}x (median of {args.rounds})")
    print(
        f"fp8 abft: clean {args.steps} steps {events} events; smallest detected relative error (median) "
        f"Y {med['forward']:.1e}, dX {med['grad_input']:.1e}, dW {med['grad_weight']:.1e}; "
        f"abft cost wall {wall:.2f}x, cpu {cpu:.2f}x"
    )


if __name__ == "__main__":
    main()
