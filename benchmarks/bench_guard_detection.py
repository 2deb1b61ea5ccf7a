"""ABFT detection over a grid of single bit flips in every Linear of the tiny GPT (or every
Linear and convolution of the tiny CNN: ``--workload cnn``).

    python benchmarks/bench_guard_detection.py [--bits 20-30] [--step 60] [--checksums both] [--workload cnn]

For each layer, each GEMM (forward Y, dX, dW) and each bit, one training step is run from the
same trained state with a flip of that bit in one random element of that GEMM's output. The
rounding model's threshold for the element's row and column checksums is read from the check
itself, so every flip is classed as above or below the threshold the model states; the benchmark
prints the detection rate per bit, whether every above-threshold flip was flagged in the same
step naming the right layer and GEMM, and the smallest relative error detected.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import torch

from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.engine import StepContext, TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

SITES = {"forward": "gemm.forward", "grad_input": "gemm.grad_input", "grad_weight": "gemm.grad_weight"}


def parse_bits(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def line_thresholds(abft: ABFTDetector, layer: str, gemm: str, index: int, module: torch.nn.Module, batch: int):
    """c·τ of the row and the column checksum through flat output ``index`` (None if unchecked)."""
    for rec in abft._records:
        if rec.layer == layer and rec.gemm == gemm:
            chk = rec.check
            c = abft.threshold(layer, gemm)
            if isinstance(module, torch.nn.Linear):
                width = module.out_features if gemm == "forward" else module.in_features
                (row, col), entry = divmod(index, width), 0
            else:  # a conv: one line per group (sdcscope.detect.abft.convcheck)
                groups = module.groups
                if gemm == "grad_weight":  # dW [O, C_g, *k]: the weight column
                    per = module.weight[0].numel()
                    entry, row, col = index // per // (module.out_channels // groups), None, index % per
                else:  # Y [N, O, *p] / dX [N, C, *q]: the position
                    chans = module.out_channels if gemm == "forward" else module.in_channels
                    positions = chk.row[1].shape[1] // batch
                    n, rest = divmod(index, chans * positions)
                    ch, p = divmod(rest, positions)
                    entry, row, col = ch // (chans // groups), n * positions + p, None
            taus = []
            if chk.row is not None and row is not None:
                taus.append(c * float(chk.row[1][entry, row]))
            if chk.col is not None and col is not None:
                taus.append(c * float(chk.col[1][entry, col]))
            return min(taus)
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", default="20-30")
    parser.add_argument("--step", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checksums",
        choices=("column", "both", "row"),
        default="column",
        help="ABFT sides (default: the guard's default, column)",
    )
    parser.add_argument("--workload", choices=("gpt", "cnn"), default="gpt")
    args = parser.parse_args()
    workload = make_workload(WorkloadConfig(workload=args.workload, preset="tiny"))
    trainer = Trainer(workload, TrainConfig(seed=args.seed))
    for _ in range(args.step):
        trainer.train_step()
    state = trainer.snapshot()
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    linears = [n for n, m in trainer.model.named_modules() if isinstance(m, kinds)]
    first = linears[0] if args.workload == "cnn" else None  # its input (the images) has no dX
    tied = {"head"}  # the tied LM head's dW is summed with the embedding gradient: not checkable
    stats = defaultdict(lambda: [0, 0])  # bit -> [detected, trials]
    above = above_ok = 0
    smallest = math.inf
    misses_above = []
    trial = 0
    for layer in linears:
        for gemm, site in SITES.items():
            if (gemm == "grad_weight" and layer in tied) or (gemm == "grad_input" and layer == first):
                continue
            for bit in parse_bits(args.bits):
                trial += 1
                trainer.restore(state)
                spec = FaultSpec(
                    site=site,
                    target=layer,
                    model="bitflip",
                    bits=[bit],
                    schedule={"kind": "transient", "step": args.step},
                    seed=trial,
                )
                abft = ABFTDetector(trainer.model, ABFTConfig(checksums=args.checksums))
                with Injector(trainer.model, [spec], trainer.optimizer) as inj, abft:
                    inj.set_position(args.step)
                    abft.begin_step(args.step)
                    trainer.forward_backward(StepContext(trainer, args.step, trainer.data_pos))
                    (rec,) = inj.records
                    idx, before, after = rec["index"][0], rec["before"][0], rec["after"][0]
                    tau = line_thresholds(
                        abft, layer, gemm, idx, trainer.model.get_submodule(layer), workload.config.batch_size
                    )
                    events = abft.check(args.step)
                hit = any(e.module == layer and e.gemm == gemm and e.step == args.step for e in events)
                delta = abs(float(after) - float(before))
                rel = delta / max(abs(float(before)), 1e-30)
                stats[bit][0] += hit
                stats[bit][1] += 1
                if hit:
                    smallest = min(smallest, rel)
                if tau is not None and (not math.isfinite(delta) or delta > tau):
                    above += 1
                    above_ok += hit
                    if not hit:
                        misses_above.append((layer, gemm, bit, delta, tau))
    print(f"{trial} single-bit flips at step {args.step}, layers: {len(linears)} Linear/Conv x (Y, dX, dW)")
    print("bit  detected/trials")
    for bit in sorted(stats):
        d, n = stats[bit]
        print(f"{bit:3d}  {d:3d}/{n:3d}  ({100 * d / n:5.1f}%)")
    for miss in misses_above[:10]:
        print("missed above threshold:", miss)
    print(f"smallest detected relative error: {smallest:.3g}")
    print(
        f"ABFT ({args.checksums}) flagged {above_ok}/{above} flips above the rounding-model threshold in the same step "
        f"(right layer and GEMM); overall {sum(d for d, _ in stats.values())}/{trial} detected; "
        f"smallest detected relative error {smallest:.3g}"
    )


if __name__ == "__main__":
    main()
