"""The guard's coverage matrix: for each profile, what share of each fault class is detected, how
fast, and repaired -- and how many events clean runs raise.

    python benchmarks/bench_guard_coverage.py [--quick] [--misses] [--profiles minimal balanced full]
        [--compile] [--sites Y dX dW weight] [--schedules transient intermittent permanent periodic]
        [--patterns element burst lane warp warp-periodic]

A fault class is site (a Linear's forward output Y, its dX, its dW, its weight in memory) × bit
field of the stored format (top exponent bit, lowest exponent bit, top mantissa bit; Y, dX and
dW are stored in the autocast dtype, weights in fp32) × dtype (fp32, bf16 autocast, fp16
autocast) × schedule (transient at the fault step; intermittent, p = 0.3 per micro-batch from
it on; permanent from it on; periodic: every second step from it on, at the moment's
micro-batch) × moment in the step (micro-batch 0 or 1 of two) × pattern (``element``: one
element, the field's bit; ``burst``: one element, a burst of the field's bit and the two below;
``lane``: a faulty SIMT lane, every 32nd element; ``warp``: one whole warp of 32 elements;
``warp-periodic``: every 8th warp; the last three flip the field's bit). By default the matrix
is the element pattern under the first three schedules. The full mode runs every class of the
cross-product; ``--quick`` runs a stratified sample of it: every (site, field, dtype) once, with
the (schedule, moment) pairs of the first three schedules dealt out evenly by a fixed seed (each
schedule a third of the classes, each moment half), the transient ones again as periodic, each
pattern on the same classes. A class's Linear and element are drawn with a seed fixed per class
(the classes of the element pattern under the first three schedules keep the seeds they had
before the pattern axis), so a class is the same fault in both modes.

Workload: the tiny GPT, batch 4 as two micro-batches, in a plain loop with gradient
accumulation driven through ``Guard(step_fn=...)``; faults come from ``sdcscope.inject``; the
profile is taken by name (``GuardConfig(profile=...)``, whatever
:data:`sdcscope.guard.config.PROFILES` makes of it). Each dtype first trains 100 steps without
a guard (past the loss's steep first descent, so that one lost update moves the validation loss
little); every run goes on from there for a few steps, the fault from its fourth step on, with
the guard's spike detectors fed the losses and gradient norms of those 100 steps (what a guard
on from step 0 would have seen: their warm-up is over). Per class and profile: detected (a
detector's event at or after the fault's first firing), latency (steps from that firing to the
first such event), repaired (final validation loss within 0.5 % of the golden -- fault-free,
unguarded -- run's; a run the guard stopped counts as not repaired), stopped. As context,
harmful: the same fault without a guard leaves the validation loss more than 0.5 % off (or
non-finite). False events: those of clean guarded runs of each profile in each dtype, and those
of the faulty runs before their fault. The last line holds each profile's detected / repaired
shares and its false events. One torch thread: the tiny model gains nothing from more.

*Silent* classes are where a guard earns its place: the unguarded faulty run's losses and
gradient norms stay finite and trip neither spike detector (fed what the guard's would be), so
no cheap signal sees them; the table gives them a row of their own (``silent``) and the last line
their detected share. ``--compile`` runs the guarded runs as compiled training instead
(``torch.compile``, inductor): the guard's ABFT through graph taps and the faults through the
injector's graph mode, each run compiled afresh; the unguarded runs stay eager. ``--sites`` and
``--schedules`` restrict the classes (``--sites Y dX dW --schedules transient``: the transient GEMM
faults, whose catch rate in their step the profiles' coverage lines quote); ``--patterns`` picks
the patterns (``--quick --patterns burst lane warp warp-periodic --schedules transient periodic``:
the hardware-shaped faults, once and recurring). ``--score DIR`` also
writes the runs as the detector scoreboard's rows (``DIR/truth.jsonl``: one trial per class and one
clean trial per dtype; ``DIR/verdicts.jsonl``: each profile's events), so ``sdcscope score
DIR/truth.jsonl DIR/verdicts.jsonl --by site,schedule`` gives this matrix as a scoreboard report,
with its localization (layer, element) beside detection and latency.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import random
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch

from sdcscope.detect.spike import SpikeConfig, SpikeDetector
from sdcscope.faults import FaultSpec, get_format
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.config import PROFILES
from sdcscope.inject import Injector
from sdcscope.study.scoreboard import known_shape, truth_row, verdict_rows, write_rows
from sdcscope.workloads import WorkloadConfig, make_workload

SITES = {"Y": "gemm.forward", "dX": "gemm.grad_input", "dW": "gemm.grad_weight", "weight": "weight"}
FIELDS = ("exp-high", "exp-low", "mant-high")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("transient", "intermittent", "permanent", "periodic")
MOMENTS = (0, 1)
BURST = 3  # bits of a multi-bit burst: the field's bit and the two below it
WARP = 32  # lanes of a warp (NVIDIA)
PATTERNS = {  # pattern class -> (the spec's pattern, burst_bits)
    "element": ({"kind": "element", "index": "random"}, None),
    "burst": ({"kind": "element", "index": "random"}, BURST),
    "lane": ({"kind": "strided", "stride": WARP}, None),  # a faulty SIMT lane: one lane of every warp
    "warp": ({"kind": "warp", "lanes": "all"}, None),  # one whole warp's elements
    "warp-periodic": ({"kind": "warp", "lanes": "all", "stride": 8}, None),  # every 8th warp
}
AXES = ("site", "field", "dtype", "schedule", "moment", "pattern")
OLD = ("transient", "intermittent", "permanent")  # the schedules of the matrix before periodic
WARM = 100  # steps of each dtype's start (:class:`Start`)
FAULT_STEP = 3  # steps of each run before its fault (the guard's first snapshot, clean checks)
TOLERANCE = 0.005  # repaired: validation loss within 0.5 % of the golden run's
SAMPLE_SEED = 0
QUIET = ("stopped", "stalled")  # the guard's own events that are no failure of it


def field_bit(field: str, fmt: str) -> int:
    """The bit of ``field`` in the stored format ``fmt``."""
    f = get_format(fmt)
    return {"exp-high": f.exponent[-1], "exp-low": f.exponent[0], "mant-high": f.mantissa[-1]}[field]


def make_spec(cell: tuple, target: str, seed: int, at: int) -> FaultSpec:
    site, field, dtype, schedule, moment, pattern = cell
    stored = "fp32" if site == "weight" else dtype  # weights stay fp32; GEMM results are autocast's
    sched = {
        "transient": {"kind": "transient", "step": at, "micro_batch": moment},
        "intermittent": {"kind": "intermittent", "p": 0.3, "start": at},
        "permanent": {"kind": "permanent", "start": at},
        "periodic": {"kind": "periodic", "every": 2, "start": at, "micro_batch": moment},
    }[schedule]
    where, burst = PATTERNS[pattern]
    bit = field_bit(field, stored)
    return FaultSpec(
        site=SITES[site],
        target=target,
        model="bitflip",
        bits=tuple(range(bit - burst + 1, bit + 1)) if burst else (bit,),
        burst_bits=burst,
        pattern=where,
        schedule=sched,
        seed=seed,
    )


class Run:
    """One plain loop with gradient accumulation (two micro-batches per step) on the tiny GPT: no
    guard (``profile`` None) or a guard of that profile, with or without a fault, from a fresh
    model (``start`` None) or from ``start`` (a :class:`Start`). Like the engine it keeps step
    and data position apart: a rollback resumes at the snapshot's step and data position,
    batches the guard skipped are never drawn again, a vetoed step is lost."""

    def __init__(
        self,
        w,
        start,
        profile: str | None,
        dtype: str,
        fault: FaultSpec | None,
        steps: int,
        compile: str | bool = False,
    ) -> None:
        """``compile``: a torch.compile backend (or False: eager)."""
        self.w, self.steps, self.dtype = w, steps, DTYPES[dtype]
        self.first = 0 if start is None else start.steps  # data position and LR schedule go on from the start
        torch.manual_seed(0)
        self.model = w.build_model()
        self.opt = w.build_optimizer(self.model)
        if start is not None:
            self.model.load_state_dict(copy.deepcopy(start.model_state))
            self.opt.load_state_dict(copy.deepcopy(start.opt_state))
        self.inj = Injector(self.model, [fault] if fault else [], self.opt, warn_unfired=False, graph=bool(compile))
        self.inj.attach()
        self.history: list[tuple[float, float]] = []  # (loss, gradient norm) of the unguarded steps
        self.guard = None
        if profile is not None:  # the profile by name, nothing else changed but graph taps when compiled
            config = GuardConfig(profile=profile)
            if compile and config.abft is not None:
                config = GuardConfig(profile=profile, abft=dataclasses.replace(config.abft, graph=True))
            self.guard = Guard(self.model, self.opt, config, step_fn=self.step_fn).attach()
            for i, (loss, norm) in enumerate(start.history if start is not None else ()):
                # the spike detectors have watched the start's training, as a guard on from step 0 would
                for spike, value in ((self.guard.loss_spike, loss), (self.guard.grad_spike, norm)):
                    if spike is not None:
                        spike.check(i - self.first, value)
        if compile:
            torch._dynamo.reset()  # a run's own taps and descriptors: compiled afresh
        self.forward = torch.compile(self.model, backend=compile) if compile else self.model

    def step_fn(self, model, micro) -> torch.Tensor:
        total = 0.0
        for i, mb in enumerate(micro):
            self.inj.set_position(self.step, i)
            with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                loss = self.w.loss(self.forward, mb) / len(micro)
            loss.backward()
            total += float(loss.detach())
        return torch.tensor(total)

    def run(self) -> dict:
        clip = lambda: torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # noqa: E731
        step, pos = 0, self.first
        pos_of: dict[int, int] = {}  # step -> data position it trained on
        skipped: set[int] = set()  # data positions the guard said never to train on again
        for _ in range(4 * self.steps):  # a bound on rollbacks; the guard stalls long before
            if step >= self.steps:
                break
            while pos in skipped:
                pos += 1
            self.step, pos_of[step] = step, pos
            for g in self.opt.param_groups:
                g["lr"] = self.w.lr_at(self.first + step)
            x, y = self.w.batch(0, pos)
            micro = [(x[:2], y[:2]), (x[2:], y[2:])]
            self.opt.zero_grad(set_to_none=True)
            if self.guard is None:
                loss = self.step_fn(self.model, micro)
                self.history.append((float(loss), float(clip())))
                self.opt.step()
                step, pos = step + 1, pos + 1
                continue
            with self.guard.step(step, micro):
                loss = self.step_fn(self.model, micro)
            self.guard.optimizer_step(loss, before_step=clip)
            skipped |= {pos_of[s] for s in self.guard.skip_batches if s in pos_of}
            if self.guard.stopped:
                break
            back = self.guard.rolled_back_to
            step, pos = (back, pos_of[back]) if back is not None else (step + 1, pos + 1)
        self.inj.close()  # evaluate the trained weights on healthy hardware
        self.model.eval()
        val = float(self.w.evaluate(self.model)["val_loss"])
        fired = [r["step"] for r in self.inj.records if r["when"] == "train"]
        events = [] if self.guard is None else list(self.guard.events)
        stopped = self.guard is not None and self.guard.stopped
        if self.guard is not None:
            self.guard.close()
        return {
            "val": val,
            "fired": min(fired) if fired else None,
            "events": events,
            "records": list(self.inj.records),
            "stopped": stopped,
            "history": self.history,
        }


class Start:
    """Where every run of a dtype starts: the tiny GPT trained ``steps`` steps in that dtype
    without faults or a guard, past the steep first descent of the loss (one lost update then
    moves the validation loss little, as mid-training), with the losses and gradient norms the
    spike detectors of a guard on from step 0 would have seen."""

    def __init__(self, w, dtype: str, steps: int) -> None:
        run = Run(w, None, None, dtype, None, steps)
        run.run()
        self.steps, self.history = steps, run.history
        self.model_state, self.opt_state = run.model.state_dict(), run.opt.state_dict()


def silent(start: Start, bare: dict) -> bool:
    """Whether an unguarded faulty run's losses and gradient norms stayed finite and tripped
    neither spike detector of a guard (primed, as the guard's, with the start's history)."""
    spikes = [SpikeDetector(SpikeConfig.loss()), SpikeDetector(SpikeConfig.grad_norm())]
    for i, pair in enumerate(start.history + bare["history"]):
        if not all(map(math.isfinite, pair)):
            return False
        alarms = [d.check(i - start.steps, v) for d, v in zip(spikes, pair)]  # both fed, always
        if any(alarms) and i >= start.steps:
            return False
    return True


def every_class() -> list[tuple]:
    """Every fault class, numbered by position (a class's seed): the classes of the matrix before
    the periodic schedule and the pattern axis first, in their old order, so they keep their seeds."""
    product = itertools.product(SITES, FIELDS, DTYPES, SCHEDULES, MOMENTS, PATTERNS)
    return sorted(product, key=lambda c: c[3] not in OLD or c[5] != "element")  # stable


def cells_for(quick: bool, patterns: list[str]) -> list[tuple]:
    """Every fault class of ``patterns``, or (quick) the stratified sample described in the module
    docstring: each pattern on the same dealt classes, and the transient ones again as periodic."""
    if not quick:
        return [c for c in every_class() if c[5] in patterns]
    base = list(itertools.product(SITES, FIELDS, DTYPES))
    pairs = list(itertools.product(OLD, MOMENTS))
    dealt = (pairs * math.ceil(len(base) / len(pairs)))[: len(base)]
    random.Random(SAMPLE_SEED).shuffle(dealt)
    once = [(*b, *pair) for b, pair in zip(base, dealt)]
    again = [(*c[:3], "periodic", c[4]) for c in once if c[3] == "transient"]
    return [(*c, p) for p in patterns for c in once + again]


def rel(val: float, golden: float) -> float:
    """``val`` off ``golden``, in percent."""
    return 100 * (val - golden) / abs(golden)


def off(val: float, golden: float) -> bool:
    return not math.isfinite(val) or abs(val - golden) > TOLERANCE * abs(golden)


def pct(k: int, n: int) -> str:
    return f"{k:3d}/{n:<3d} {100 * k / n:3.0f}%" if n else "   -       "


def table(rows: list[dict]) -> list[str]:
    """One row per value of each axis, then all classes."""
    head = f"  {'group':22s} {'n':>3s}  {'harmful':11s}  {'detected':11s}  {'lat':>4s}  {'repaired':11s}  "
    out = [head + f"{'rep|harm':11s}  stopped"]
    groups = [
        (f"{axis} {key}", [r for r in rows if r["cell"][a] == key])
        for a, axis in enumerate(AXES)
        for key in dict.fromkeys(r["cell"][a] for r in rows)
    ]
    quiet = [r for r in rows if r["silent"]]
    sites = [
        (f"silent site {key}", [r for r in quiet if r["cell"][0] == key])
        for key in dict.fromkeys(r["cell"][0] for r in rows)
    ]
    for name, rs in groups + sites + [("silent", quiet), ("all", rows)]:
        n, hurt = len(rs), [r for r in rs if r["harmful"]]
        lats = [r["lat"] for r in rs if r["lat"] is not None]
        lat = f"{statistics.median(lats):4.1f}" if lats else "   -"
        out.append(
            f"  {name:22s} {n:3d}  {pct(len(hurt), n)}  {pct(sum(r['det'] for r in rs), n)}  {lat}  "
            f"{pct(sum(r['rep'] for r in rs), n)}  {pct(sum(r['rep'] for r in hurt), len(hurt))}  "
            f"{sum(r['stopped'] for r in rs)}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a stratified sample of the classes, fewer steps")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--after", type=int, default=None, help="steps from the fault on (default 6, quick 4)")
    parser.add_argument("--clean-steps", type=int, default=None, help="steps of each clean run (default 100, quick 40)")
    parser.add_argument("--misses", action="store_true", help="list each harmful class a profile did not repair")
    parser.add_argument("--compile", action="store_true", help="guarded runs compiled (graph taps, graph injector)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of --compile (default inductor)")
    parser.add_argument(
        "--write", default=None, help="write the silent classes' detected counts per profile and site (JSON)"
    )
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=list(SITES))
    parser.add_argument("--schedules", nargs="+", default=list(OLD), choices=list(SCHEDULES))
    parser.add_argument("--patterns", nargs="+", default=["element"], choices=list(PATTERNS))
    parser.add_argument("--score", default=None, help="write the runs as scoreboard rows to this folder")
    args = parser.parse_args()
    after = args.after or (4 if args.quick else 6)
    if after < 1:
        parser.error(f"--after {after} must be >= 1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # a tiny model gains nothing from more; on shared cores extra threads spin
    t0 = time.perf_counter()
    w = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=4))
    at = FAULT_STEP
    steps = at + after
    clean_steps = args.clean_steps or (40 if args.quick else 100)
    starts = {d: Start(w, d, WARM) for d in DTYPES}
    model = w.build_model()  # names and shapes
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    golden = {d: Run(w, starts[d], None, d, None, steps).run()["val"] for d in DTYPES}
    every = every_class()
    cells = [c for c in cells_for(args.quick, args.patterns) if c[0] in args.sites and c[3] in args.schedules]
    # the matrix the chosen patterns span (the periodic schedule's classes when it is asked for)
    pool = [c for c in every if c[5] in args.patterns and (c[3] in OLD or c[3] in args.schedules)]
    mode = f"a stratified sample (seed {SAMPLE_SEED}) of {len(cells)}" if args.quick else "all"
    print(
        f"tiny GPT trained {WARM} steps in each dtype (spike detectors primed with them), then {steps} steps per run "
        f"(batch 4 = 2 micro-batches), faults from step {at}; {mode} of the {len(pool)} fault classes"
        + (
            f" (sites {' '.join(args.sites)}; {' '.join(args.schedules)}; patterns {' '.join(args.patterns)})"
            if len(cells) < len(pool)
            else ""
        )
        + ("; guarded runs compiled" if args.compile else ""),
        flush=True,
    )
    rows: dict[str, list[dict]] = defaultdict(list)
    truth, verdicts = [], []  # the scoreboard's rows (--score)
    early: dict[str, list[dict]] = defaultdict(list)  # events of the faulty runs before their fault fired
    unfired = 0
    for cell in cells:
        k = every.index(cell)  # the class's own seed: the same fault in quick and full mode
        fault = make_spec(cell, random.Random(k).choice(targets), seed=k, at=at)
        bare = Run(w, starts[cell[2]], None, cell[2], fault, steps).run()
        if bare["fired"] is None:  # an intermittent fault that drew no event: no fault to find
            unfired += 1
            continue
        harmful = off(bare["val"], golden[cell[2]])
        trial = "/".join(map(str, cell))
        labels = {
            "site": fault.site,
            "model": "bitflip",
            "pattern": cell[5],
            "schedule": cell[3],
            "bit": fault.bits[0],
        }
        records = [{**r, "shape": known_shape(model, r["site"], r["module"])} for r in bare["records"]]
        truth.append(truth_row(trial, records, labels))
        for prof in args.profiles:
            r = Run(w, starts[cell[2]], prof, cell[2], fault, steps, args.compile and args.backend).run()
            verdicts += verdict_rows(trial, prof, r["events"])
            first = r["fired"] if r["fired"] is not None else bare["fired"]
            early[prof] += [dict(e, dtype=cell[2]) for e in r["events"] if e["step"] < first]
            late = [e["step"] for e in r["events"] if e["step"] >= first and e["detector"] != "guard"]
            rows[prof].append(
                {
                    "cell": cell,
                    "harmful": harmful,
                    "silent": silent(starts[cell[2]], bare),
                    "det": bool(late),
                    "lat": min(late) - first if late else None,
                    "rep": not off(r["val"], golden[cell[2]]),
                    "stopped": r["stopped"],
                    "errors": [e for e in r["events"] if e["detector"] == "guard" and e["verdict"] not in QUIET],
                    "bare": rel(bare["val"], golden[cell[2]]),
                    "off": rel(r["val"], golden[cell[2]]),
                    "first": next((f"{e['detector']}:{e['verdict']}" for e in r["events"] if e["step"] >= first), None),
                }
            )
    t_cells = time.perf_counter() - t0
    clean: dict[str, list[dict]] = {}
    truth += [truth_row(f"clean/{d}", [], None) for d in DTYPES]
    for prof in args.profiles:
        clean[prof] = []
        for d in DTYPES:
            events = Run(w, starts[d], prof, d, None, clean_steps, args.compile and args.backend).run()["events"]
            clean[prof] += [dict(e, dtype=d) for e in events]
            verdicts += verdict_rows(f"clean/{d}", prof, events)
    if args.score:
        write_rows(f"{args.score}/truth.jsonl", truth)
        write_rows(f"{args.score}/verdicts.jsonl", verdicts)
    summary = []
    for prof in args.profiles:
        n = len(rows[prof])
        false = clean[prof] + early[prof]
        print(
            f"\n== profile {prof}: {n} fault classes"
            f"{f' ({unfired} intermittent ones drew no event: left out)' if unfired else ''}; false events: "
            f"{len(clean[prof])} in clean runs of {clean_steps} steps x {len(DTYPES)} dtypes, {len(early[prof])} in "
            f"the {at} steps before the fault of each faulty run"
        )
        print("\n".join(table(rows[prof])))
        misses = [r for r in rows[prof] if r["harmful"] and not r["rep"]]
        for r in misses if args.misses else ():
            print(
                f"   harmful, not repaired: {'/'.join(map(str, r['cell']))}: unguarded {r['bare']:+.2f} %, guarded "
                f"{r['off']:+.2f} %, first event {r['first']}{', stopped' if r['stopped'] else ''}"
            )
        for r in rows[prof]:
            for e in r["errors"]:
                print(
                    f"   guard's own event ({'/'.join(map(str, r['cell']))}): step {e['step']} {e['verdict']} "
                    f"{e.get('evidence')}"
                )
        for e in false:
            print(f"   false event ({e['dtype']}): step {e['step']} {e['detector']}:{e['verdict']} {e.get('evidence')}")
        det, rep = (100 * sum(r[k] for r in rows[prof]) / max(n, 1) for k in ("det", "rep"))
        quiet = [r for r in rows[prof] if r["silent"]]
        summary.append((prof, det, rep, len(false), sum(r["det"] for r in quiet), len(quiet)))
    print(
        f"\nrepaired: final validation loss within {100 * TOLERANCE:.1f} % of the golden run's; harmful: so is not the "
        f"unguarded faulty run's; rep|harm: repaired of the harmful; a stopped run counts as not repaired"
    )
    print(
        f"wall {time.perf_counter() - t0:.0f} s (fault classes {t_cells:.0f} s); golden val loss "
        + ", ".join(f"{d} {v:.4f}" for d, v in golden.items())
    )
    if args.write:
        measured = {
            "command": "python benchmarks/bench_guard_coverage.py " + " ".join(sys.argv[1:]),
            "workload": "tiny GPT, batch 4 as 2 micro-batches",
            "steps_after_fault": after,
            "compiled": bool(args.compile),
            "schedules": args.schedules,
            "patterns": args.patterns,
            "silent": {
                p: {
                    site: [sum(r["det"] for r in rs), len(rs)]
                    for site in args.sites
                    for rs in [[r for r in rows[p] if r["silent"] and r["cell"][0] == site]]
                }
                for p in args.profiles
            },
        }
        with open(args.write, "w") as f:
            json.dump(measured, f, indent=1)
    print(
        f"coverage detected/repaired ({'quick: ' if args.quick else ''}{len(cells)} classes): "
        + ", ".join(f"{p} {d:.0f}%/{r:.0f}%" for p, d, r, *_ in summary)
        + "; silent detected "
        + ", ".join(f"{p} {k}/{n}" for p, *_, k, n in summary)
        + "; false events "
        + "/".join(str(s[3]) for s in summary)
        + ("; compiled" if args.compile else "")
    )


if __name__ == "__main__":
    sys.exit(main())
