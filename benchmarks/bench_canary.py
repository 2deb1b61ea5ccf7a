"""The kernel canary's price per training step, and its false events over a long clean run.

    python benchmarks/bench_canary.py [--rounds 21] [--inner 2] [--clean-steps 1000] [--clean-preset small]

1 torch thread. The step: the ``small`` GPT preset (4 layers, d=128, seq 128, batch 16, AdamW) in
a plain loop -- forward, backward, clip, step -- whose LM head and loss are the fused linear +
cross-entropy of ``examples/canary_fused_ce.py`` (chunked, no full logits). Price: the same step
with that op registered as a canary (``canary_function``, reference ``F.cross_entropy(x @ W.T)``,
forward and dX) under the default ``CanaryConfig`` (2 sampled rows per call plus the last row),
and with 4 more canaries, each block's MLP (``canary_module``, reference fc, GELU, proj in the
argument's dtype). Four twin models -- plain, one canary, five canaries, and a second plain one
(the noise floor) -- are trained in rotating order in one process, ``inner`` steps per side per
round; each figure is the median over rounds of its step time / the plain one's, wall and process
CPU time (``--clock`` picks the last line's; CPU time is steadier on a loaded machine). Clean run
(``--clean-steps``, 0 to skip): the same fused op and the 4 MLP canaries under the guard
(``profile: minimal``, spike detectors off, ``detectors: {canary: {}}``) for that many steps of the
real data; target 0 events. Last line: one canary's price (target <= 1.03), five canaries', and the
clean run's events.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from sdcscope.detect import CanaryConfig, CanaryDetector, canary_module
from sdcscope.detect.protocol import CheckView
from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("canary_fused_ce", ROOT / "examples" / "canary_fused_ce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def register_canaries(model, prefix: str = "") -> list:
    """A canary on each block's MLP of ``model`` (references in the argument's dtype: fp32, or
    fp64 when the canary confirms a flagged row)."""
    ops = []
    for i, block in enumerate(model.blocks):
        m = block.mlp

        def mlp_ref(x, m=m):
            w1, b1, w2, b2 = (p.to(x.dtype) for p in (m.fc.weight, m.fc.bias, m.proj.weight, m.proj.bias))
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

        ops.append(canary_module(f"{prefix}blocks.{i}.mlp", m, mlp_ref, backward=True))
    return ops


class Side:
    """One plain training loop on a twin of the model through the fused head + loss; ``canaries``:
    0 (the op unregistered), 1 (the fused op) or 5 (and each MLP)."""

    def __init__(self, script, workload, batches, canaries: int, name: str) -> None:
        torch.manual_seed(0)
        self.workload, self.batches, self.i = workload, batches, 0
        self.model = workload.build_model()
        self.opt = workload.build_optimizer(self.model)
        self.ops: list = []
        if canaries:
            self.fn = script.register(f"{name}/lm_head_ce")
            self.ops = [self.fn.canary] + (register_canaries(self.model, f"{name}/") if canaries > 1 else [])
        else:
            self.fn = lambda x, w, t: script.FusedLinearCrossEntropy.apply(x, w, t, script.CHUNK, False)
        self.loss = lambda m, b: script.fused_loss(m, b, self.fn)
        self.det = CanaryDetector(CanaryConfig()) if canaries else None
        self.events: list = []

    def step(self) -> None:
        step, self.i = self.i, self.i + 1
        if self.det is not None:  # one canary records at a time: this side's, for its step
            self.det.attach()
            self.det.begin_step(step)
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.model, self.batches[step % len(self.batches)]).backward()
        if self.det is not None:
            self.events += self.det.check(CheckView(step))
            self.det.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def close(self) -> None:
        for op in self.ops:
            op.remove()


def price(rounds: int, inner: int) -> dict:
    """Each side's step time over the plain one's, per clock, and the canaries' counts."""
    script = _example()
    workload = make_workload(WorkloadConfig(workload="gpt", preset="small"))
    batches = [workload.batch(seed=0, step=s) for s in range(8)]
    kinds = {"plain": 0, "floor": 0, "one": 1, "five": 5}
    sides = {k: Side(script, workload, batches, n, k) for k, n in kinds.items()}
    for _ in range(2):  # warm-up
        for side in sides.values():
            side.step()
    times = {k: {"wall": [], "cpu": []} for k in sides}
    order = list(sides)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                sides[k].step()
            times[k]["wall"].append((time.perf_counter() - w0) / inner)
            times[k]["cpu"].append((time.process_time() - c0) / inner)
    out: dict = {"step_ms": 1000 * statistics.median(times["plain"]["wall"])}
    for k in ("floor", "one", "five"):
        out[k] = {c: statistics.median(x / y for x, y in zip(times[k][c], times["plain"][c])) for c in ("wall", "cpu")}
    out["checks"] = {k: sides[k].det.checks_run / sides[k].i for k in ("one", "five")}
    out["events"] = sum(len(sides[k].events) for k in ("one", "five"))
    for side in sides.values():
        side.close()
    return out


def clean(steps: int, preset: str) -> dict:
    """``steps`` guarded steps of the GPT with the fused linear + CE and the MLP canaries."""
    script = _example()
    torch.manual_seed(0)
    workload = make_workload(WorkloadConfig(workload="gpt", preset=preset))
    model = workload.build_model()
    opt = workload.build_optimizer(model)
    fused = script.register()
    ops = [fused.canary, *register_canaries(model)]
    config = GuardConfig(profile="minimal", loss_spike=None, grad_spike=None, detectors={"canary": {}})

    def loss_fn(m, b):
        return script.fused_loss(m, b, fused)

    guard = Guard(model, opt, config, loss_fn=loss_fn).attach()
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            batch = workload.batch(seed=0, step=step)
            for g in opt.param_groups:
                g["lr"] = workload.lr_at(step)
            opt.zero_grad(set_to_none=True)
            with guard.step(step, batch):
                loss = loss_fn(model, batch)
                loss.backward()
            guard.optimizer_step(loss, before_step=clip)
            if (step + 1) % 100 == 0:
                print(f"  step {step + 1}: loss {float(loss):.3f}, {len(guard.events)} events", flush=True)
    finally:
        guard.close()
        for op in ops:
            op.remove()
    det = guard.detectors["canary"]
    return {
        "events": guard.events,
        "calls": sum(det.calls.values()),
        "checks": det.checks_run,
        "cleared": det.cleared,
        "loss": float(loss),
        "s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu", help="the clock of the last line's ratio")
    parser.add_argument("--clean-steps", type=int, default=1000, help="steps of the clean run (0: skip it)")
    parser.add_argument("--clean-preset", default="small")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    p = price(args.rounds, args.inner)
    k = args.clock
    for name, what in (("one", "1 canary (fused LM head + CE)"), ("five", "5 canaries (+ each MLP)")):
        r = p[name]
        print(
            f"{what} / plain step on small ({p['step_ms']:.0f} ms, {args.threads} thread, "
            f"{p['checks'][name]:.0f} row checks a step): {r['wall']:.3f}x wall, {r['cpu']:.3f}x cpu",
            flush=True,
        )
    f = p["floor"]
    print(
        f"noise floor (plain twin / plain): {f['wall']:.3f}x wall, {f['cpu']:.3f}x cpu; {p['events']} events",
        flush=True,
    )
    tail = ""
    if args.clean_steps:
        c = clean(args.clean_steps, args.clean_preset)
        for e in c["events"][:20]:
            print(f"  event: {e}", flush=True)
        print(
            f"clean {args.clean_steps} steps of {args.clean_preset} (fused linear+CE and 4 MLP canaries): "
            f"{len(c['events'])} events, {c['calls']} calls checked ({c['checks']} row checks, "
            f"{c['cleared']} flagged by the fp32 bound and cleared by the fp64 reference), "
            f"final loss {c['loss']:.3f}, {c['s']:.0f} s",
            flush=True,
        )
        tail = f"; clean {args.clean_steps} steps: {len(c['events'])} events"
    print(
        f"canary (2 rows + last, fwd + dX) / plain step on small, {k}: 1 canary {p['one'][k]:.3f}x, "
        f"5 canaries {p['five'][k]:.3f}x (floor {p['floor'][k]:.3f}x)" + tail
    )


if __name__ == "__main__":
    sys.exit(main())
