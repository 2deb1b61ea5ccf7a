"""The guard's coverage matrix: for each profile, what share of each fault class is detected, how
fast, and repaired -- and how many events clean runs raise.

    python benchmarks/bench_guard_coverage.py [--quick] [--profiles minimal balanced full]

Fault classes: site (a Linear's forward Y, dX, dW; the weights) × bit field (high exponent, low
exponent, high mantissa of the dtype) × dtype (fp32, bf16 and fp16 autocast) × schedule (transient
at one step; intermittent with p = 0.3 from that step; permanent from it) × moment in the step
(first or second of two micro-batches). Each cell trains the tiny GPT in a plain loop with
gradient accumulation (``step_fn``) for a few steps after the fault from the same seed as a
golden run, with a random element of a random Linear hit by ``sdcscope.inject`` (seeded per
cell), and reports: detected (any guard event from the fault's first step on), latency (steps
from the fault's first step to the first event), repaired (final validation loss within 0.5 % of
the golden run's), and the false events of clean guarded runs of each profile. Per profile the
matrix is summed by each axis; the last line holds each profile's detected / repaired shares and
clean events. ``--quick``: fewer cells (no intermittent, one moment), fewer steps.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import warnings
from collections import defaultdict

import torch

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

FIELDS = {  # bit field -> bits per dtype width
    "exp-high": {32: 30, 16: 14},
    "exp-low": {32: 24, 16: 8},
    "mantissa-high": {32: 22, 16: 6},
}
SITES = {"Y": "gemm.forward", "dX": "gemm.grad_input", "dW": "gemm.grad_weight", "weight": "weight"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FAULT_STEP = 3


def spec(site: str, field: str, dtype: str, schedule: str, moment: int, target: str, seed: int) -> FaultSpec:
    width = 32 if dtype == "fp32" or site == "weight" else 16
    sched = {
        "transient": {"kind": "transient", "step": FAULT_STEP, "micro_batch": moment},
        "intermittent": {"kind": "intermittent", "p": 0.3, "start": FAULT_STEP},
        "permanent": {"kind": "permanent", "start": FAULT_STEP},
    }[schedule]
    if site == "weight":
        sched.pop("micro_batch", None)
    return FaultSpec(
        site=SITES[site],
        target=target,
        model="bitflip",
        bits=(FIELDS[field][width],),
        pattern={"kind": "element", "index": "random"},
        schedule=sched,
        seed=seed,
    )


class Run:
    """One plain loop with gradient accumulation (two micro-batches per step) on the tiny GPT."""

    def __init__(self, profile: str | None, dtype: str, fault: FaultSpec | None, steps: int) -> None:
        self.w = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=4))
        torch.manual_seed(0)
        self.model = self.w.build_model()
        self.opt = self.w.build_optimizer(self.model)
        self.dtype, self.steps = DTYPES[dtype], steps
        self.inj = Injector(self.model, [fault] if fault else [], self.opt).attach()
        self.guard = None
        if profile is not None:
            cfg = GuardConfig(profile=profile, stall_after=steps)
            self.guard = Guard(self.model, self.opt, cfg, step_fn=self.step_fn).attach()

    def step_fn(self, model, micro):
        total = 0.0
        for i, mb in enumerate(micro):
            self.inj.set_position(self.step, i)
            with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                loss = self.w.loss(model, mb) / len(micro)
            loss.backward()
            total += float(loss.detach())
        return torch.tensor(total)

    def run(self) -> tuple[float, list[dict]]:
        clip = lambda: torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # noqa: E731
        step = 0
        while step < self.steps:
            self.step = step
            x, y = self.w.batch(0, step)
            micro = [(x[:2], y[:2]), (x[2:], y[2:])]
            self.opt.zero_grad(set_to_none=True)
            if self.guard is None:
                self.step_fn(self.model, micro)
                clip()
                self.opt.step()
                step += 1
                continue
            with self.guard.step(step, micro):
                loss = self.step_fn(self.model, micro)
            self.guard.optimizer_step(loss, before_step=clip)
            if self.guard.stalled:
                break
            back = self.guard.rolled_back_to
            step = back + 1 if back is not None else step + 1
        self.model.eval()
        with torch.no_grad():
            val = float(self.w.evaluate(self.model)["val_loss"])
        return val, [] if self.guard is None else self.guard.events


def smallest_detected(dtype: str, trials: int = 24) -> tuple[float, float]:
    """Smallest relative change y → y(1+ε) of one random element of a Linear(128, 128)'s Y over
    2,048 tokens caught in at least half / all of ``trials`` (ε = 2^-j, j = 0..22)."""
    from sdcscope.detect import ABFTConfig, ABFTDetector

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(128, 128))
    x = torch.randn(16, 128, 128)
    change: dict = {}

    def hook(mod, args, out):
        if change:
            out = out.clone()
            flat = out.view(-1)
            flat[change["i"]] = flat[change["i"]] * (1 + change["eps"])
            return out

    layer[0].register_forward_hook(hook)
    det = ABFTDetector(layer, ABFTConfig(gemms=("forward",), kinds=["linear"])).attach()
    rng = random.Random(0)
    half = every = None
    for j in range(22, -1, -1):
        eps, hits = 2.0**-j, 0
        for t in range(trials):
            change.update(i=rng.randrange(16 * 128 * 128), eps=eps)
            with torch.no_grad(), torch.autocast("cpu", dtype=DTYPES[dtype] or torch.bfloat16, enabled=dtype != "fp32"):
                layer(x)
            hits += bool(det.check(t))
        if half is None and hits >= trials / 2:
            half = eps
        if every is None and hits == trials:
            every = eps
    det.detach()
    return half or math.inf, every or math.inf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profiles", nargs="+", default=["minimal", "balanced", "full"])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 10, quick 7)")
    parser.add_argument("--clean-steps", type=int, default=None, help="steps of the clean runs (default 200, quick 40)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    steps = args.steps or (7 if args.quick else 10)
    schedules = ["transient", "permanent"] if args.quick else ["transient", "intermittent", "permanent"]
    moments = [1] if args.quick else [0, 1]
    w = make_workload(WorkloadConfig(workload="gpt", preset="tiny"))
    torch.manual_seed(0)
    targets = [n for n, m in w.build_model().named_modules() if isinstance(m, torch.nn.Linear)]
    golden = {d: Run(None, d, None, steps).run()[0] for d in DTYPES}
    cells = list(itertools.product(SITES, FIELDS, DTYPES, schedules, moments))
    rows = defaultdict(list)  # profile -> [(cell, detected, latency, repaired)]
    for i, (site, field, dtype, sched, moment) in enumerate(cells):
        rng = random.Random(i)
        target = rng.choice(targets)
        fault = spec(site, field, dtype, sched, moment, target, seed=i)
        for prof in args.profiles:
            val, events = Run(prof, dtype, fault, steps).run()
            late = [e["step"] for e in events if e["step"] >= FAULT_STEP]
            repaired = abs(val - golden[dtype]) <= 0.005 * abs(golden[dtype])
            rows[prof].append(
                ((site, field, dtype, sched, moment), bool(late), min(late) - FAULT_STEP if late else None, repaired)
            )
    clean_steps = args.clean_steps or (40 if args.quick else 200)
    false = {}
    for prof in args.profiles:
        false[prof] = sum(len(Run(prof, d, None, clean_steps).run()[1]) for d in DTYPES)
    axes = ("site", "field", "dtype", "schedule", "moment")
    summary = []
    for prof in args.profiles:
        n = len(rows[prof])
        print(f"== profile {prof}: {n} fault classes, clean events {false[prof]} over {clean_steps} steps x 3 dtypes")
        for a, axis in enumerate(axes):
            groups = defaultdict(list)
            for cell, det, lat, rep in rows[prof]:
                groups[cell[a]].append((det, lat, rep))
            for key, vals in groups.items():
                lats = [lat for _, lat, _ in vals if lat is not None]
                print(
                    f"  {axis:8s} {str(key):14s} detected {sum(v[0] for v in vals)}/{len(vals)}  "
                    f"latency {statistics.median(lats) if lats else float('nan'):4.1f}  "
                    f"repaired {sum(v[2] for v in vals)}/{len(vals)}"
                )
        n = len(rows[prof])
        det = sum(r[1] for r in rows[prof])
        rep = sum(r[3] for r in rows[prof])
        summary.append(f"{prof} detected {det}/{n} repaired {rep}/{n} clean-events {false[prof]}")
    for d in DTYPES:
        half, every = smallest_detected(d)
        print(
            f"smallest relative change of one element of Y caught ({d}): half of the elements {half:.1e}, "
            f"all {every:.1e}"
        )
    print("coverage: " + "; ".join(summary))


if __name__ == "__main__":
    sys.exit(main())
