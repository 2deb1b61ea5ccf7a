"""The guard on a CUDA GPU (needs one; CI has none): clean runs, repaired GEMM faults, ABFT cost.

    python benchmarks/bench_guard_gpu.py [--steps 150] [--fault-steps 80] [--model 4x16x2048x1024] [--batch 8]

A plain training loop (the engine's Trainer is CPU-only) on the reference GPT moved to the GPU, in
fp32 (TF32 off) and under bf16 autocast:

1. clean: the default guard over ``--steps`` steps of the ``tiny`` and ``small`` presets — events
   (target 0) and the largest ABFT ratio seen (the threshold is c = 8);
2. faults: a transient exponent flip (fp32 bit 30; bf16 bit 14) in Y, dX and dW of a Linear and in
   the attention scores of the ``small`` preset at step 30 — golden / unguarded / guarded validation
   loss and the guard's first finding;
3. cost: ABFT alone on every Linear, every step, interleaved with an unguarded twin (median of
   per-round ratios), for ``--model`` (``layers x heads x d_model x block``) and ``small``. Small
   models are bound by kernel launches and the host, so their ratio says little about a large one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads.gpt import GPT, GPTConfig, gpt_preset, lm_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_guard_overhead import _ONLY_ABFT  # noqa: E402

DEV = "cuda"
MODES = ("fp32", "autocast")


def model_config(name: str) -> GPTConfig:
    if "x" not in name:
        return gpt_preset(name)
    fields = ("n_layer", "n_head", "d_model", "block_size")
    return GPTConfig(**dict(zip(fields, map(int, name.split("x")))))


def batch(step: int, cfg: GPTConfig, size: int):
    """Repeated random 8-byte phrases (learnable), a pure function of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    phrase = torch.randint(0, 256, (size, 8), generator=g)
    idx = phrase.repeat(1, cfg.block_size // 8 + 2)[:, : cfg.block_size + 1]
    return idx[:, :-1].to(DEV), idx[:, 1:].to(DEV)


def loss_fn(mode: str):
    def fn(model, b):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = model(b[0])
        return lm_loss(logits.float(), b[1])

    return fn


def train(
    cfg: GPTConfig, mode: str, steps: int, *, guard: dict | None = None, fault: dict | None = None, size: int = 16
):
    """-> (validation loss, guard or None). A rollback continues the loop from its step."""
    torch.manual_seed(0)
    model = GPT(cfg).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), 3e-3, weight_decay=0.1)
    lf = loss_fn(mode)
    inj = Injector(model, [FaultSpec.from_dict(fault)], opt).attach() if fault else None
    g = (
        Guard(model, opt, GuardConfig.from_dict(guard), run_dir=tempfile.mkdtemp(), loss_fn=lf).attach()
        if guard is not None
        else None
    )
    step = 0
    while step < steps:
        b = batch(step, cfg, size)
        if inj is not None:
            inj.set_position(step)
        opt.zero_grad()
        if g is None:
            lf(model, b).backward()
            opt.step()
        else:
            with g.step(step, b):
                loss = lf(model, b)
                loss.backward()
            if g.optimizer_step(loss) is False and g.rolled_back_to is not None:
                step = g.rolled_back_to
                continue
        step += 1
    with torch.no_grad():
        val = sum(float(lf(model, batch(10_000 + i, cfg, size))) for i in range(4)) / 4
    return val, g


def clean(steps: int) -> int:
    total = 0
    for preset in ("tiny", "small"):
        for mode in MODES:
            _, g = train(gpt_preset(preset), mode, steps, guard={})
            total += len(g.events)
            print(
                f"clean {preset:5s} {mode:8s} {steps} steps: events {len(g.events)}, "
                f"largest ABFT ratio {max(g.abft.max_ratio.values()):.3f} (threshold {g.abft.config.c:g})"
            )
    return total


def faults(steps: int) -> tuple[int, int]:
    cfg = gpt_preset("small")
    sites = [
        ("Y", "gemm.forward", "blocks.1.attn.v_proj"),
        ("dX", "gemm.grad_input", "blocks.2.mlp.fc"),
        ("dW", "gemm.grad_weight", "blocks.0.attn.q_proj"),
        ("scores", "gemm.forward", "blocks.3.attn.score"),
    ]
    repaired = n = 0
    for mode in MODES:
        golden, _ = train(cfg, mode, steps)
        bit = 30 if mode == "fp32" else 14
        for what, site, target in sites:
            spec = dict(
                site=site,
                target=target,
                model="bitflip",
                bits=[bit],
                seed=3,
                pattern={"kind": "element", "index": "random"},
                schedule={"kind": "transient", "step": 30},
            )
            faulty, _ = train(cfg, mode, steps, fault=spec)
            guarded, g = train(cfg, mode, steps, guard={}, fault=spec)
            first = next(
                ((e["detector"], e.get("module"), e.get("gemm"), e["verdict"], e["action"]) for e in g.events), None
            )
            n += 1
            repaired += abs(guarded / golden - 1) <= 0.005
            print(
                f"fault {mode:8s} {what:6s} {target:22s} bit {bit}: golden {golden:.4f} unguarded {faulty:.4f} "
                f"guarded {guarded:.4f} ({100 * (guarded / golden - 1):+.2f}%)  first finding {first}"
            )
    return repaired, n


def cost(name: str, size: int, rounds: int) -> list[str]:
    cfg = model_config(name)
    out = []
    for mode in MODES:
        lf = loss_fn(mode)
        torch.manual_seed(0)
        models = [GPT(cfg).to(DEV) for _ in range(2)]
        opts = [torch.optim.AdamW(m.parameters(), 1e-3) for m in models]
        g = Guard(
            models[1],
            opts[1],
            GuardConfig.from_dict(dict(_ONLY_ABFT, abft={"kinds": ["linear"]})),
            run_dir=tempfile.mkdtemp(),
            loss_fn=lf,
        ).attach()
        b = batch(0, cfg, size)
        step = [0]

        def base():
            opts[0].zero_grad()
            lf(models[0], b).backward()
            opts[0].step()

        def guarded():
            opts[1].zero_grad()
            with g.step(step[0], b):
                loss = lf(models[1], b)
                loss.backward()
            g.optimizer_step(loss)
            step[0] += 1

        ratios, times = [], []
        for r in range(rounds + 3):
            t = {}
            for fn in (base, guarded) if r % 2 else (guarded, base):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                t[fn] = time.perf_counter() - t0
            if r >= 3:  # warm-up
                ratios.append(t[guarded] / t[base])
                times.append(t[base])
        pct = 100 * (statistics.median(ratios) - 1)
        print(
            f"cost  {name:16s} {mode:8s} batch {size}: baseline {1e3 * statistics.median(times):7.2f} ms  "
            f"ABFT on every Linear, every step {pct:+.1f}%  (events {len(g.events)})"
        )
        out.append(f"{name}/{mode} {pct:+.1f}%")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fault-steps", type=int, default=80)
    parser.add_argument("--model", default="4x16x2048x1024", help="layers x heads x d_model x block, or a preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_guard_gpu needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    events = clean(args.steps)
    repaired, n = faults(args.fault_steps)
    costs = cost(args.model, args.batch, args.rounds) + cost("small", 32, args.rounds)
    print(
        f"gpu guard: clean events {events}; faults repaired within 0.5% of golden {repaired}/{n}; "
        f"ABFT every Linear: {'; '.join(costs)}"
    )


if __name__ == "__main__":
    main()
