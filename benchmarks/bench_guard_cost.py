"""What each guard profile costs per training step, interleaved with an unguarded twin (median ratio).

    python benchmarks/bench_guard_cost.py [--rounds 15] [--quick] [--clock cpu]

2 torch threads. Every row is a plain training loop -- forward, backward, clip, AdamW -- timed
with and without the guard in alternating order in one process, one step per side per round;
the figure is the median over rounds of guarded/unguarded time (``_timing.interleaved_ratio``).

Rows: the default profile (``GuardConfig().profile``) and each named profile on the ``small`` and
``base`` GPT presets and the CNN, and on a user-written loop with gradient accumulation (a
conv + transformer model, two micro-batches per step through ``step_fn``); then ABFT alone
(``profile: full``, no other detector) on a d=128, 4-layer, seq-128, batch-16 GPT in fp32 (target
≤ 1.10×) and under bf16 autocast (target ≤ 1.20×; bf16 results checked by tiles). The last line
holds the default profile's ratios and the two ABFT ratios. On a machine other jobs load, ratios
come out pessimistic and noisy: ``--clock cpu`` times the process's CPU time instead of wall time.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _timing import interleaved_ratio  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402

ABFT_ONLY = dict(metrics=None, nonfinite=None, loss_spike=None, grad_spike=None, state_checksum=None)


class ConvFormer(nn.Module):
    """A user's small model: a conv stem, two transformer layers (SDPA), a classifier."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.stem = nn.Conv1d(8, d, 3, padding=1)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x).transpose(1, 2)).mean(1))


class Loop:
    """One plain training loop (guarded or not) over a fixed set of batches."""

    def __init__(self, model, opt, loss_fn, batches, guard: dict | None, autocast=None, accumulate: bool = False):
        self.model, self.opt, self.loss_fn, self.batches = model, opt, loss_fn, batches
        self.autocast, self.accumulate, self.i = autocast, accumulate, 0
        self.clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.guard = None
        if guard is not None:
            kw = {"step_fn": self._step_fn} if accumulate else {"loss_fn": self._loss}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.guard = Guard(model, opt, GuardConfig.from_dict(guard), **kw).attach()

    def _loss(self, model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast is not None):
            return self.loss_fn(model, batch)

    def _step_fn(self, model, micro):
        total = 0.0
        for mb in micro:
            loss = self._loss(model, mb) / len(micro)
            loss.backward()
            total += float(loss)
        return torch.tensor(total)

    def __call__(self) -> None:
        step, self.i = self.i, self.i + 1
        batch = self.batches[step % len(self.batches)]
        self.opt.zero_grad(set_to_none=True)
        if self.guard is None:
            self._step_fn(self.model, batch) if self.accumulate else self._loss(self.model, batch).backward()
            self.clip()
            self.opt.step()
            return
        with self.guard.step(step, batch):
            loss = self._step_fn(self.model, batch) if self.accumulate else self._loss(self.model, batch)
            if not self.accumulate:
                loss.backward()
        self.guard.optimizer_step(loss.detach(), before_step=self.clip)


def workload_pair(name: str, preset: str, guard: dict, batch_size: int | None = None, autocast=None):
    def make(g):
        w = make_workload(WorkloadConfig(workload=name, preset=preset, batch_size=batch_size))
        torch.manual_seed(0)
        model = w.build_model()
        batches = [w.batch(0, s) for s in range(8)]
        return Loop(model, w.build_optimizer(model), w.loss, batches, g, autocast)

    return make(None), make(guard)


def user_pair(guard: dict):
    def make(g):
        torch.manual_seed(0)
        model = ConvFormer()
        gen = torch.Generator().manual_seed(1)
        batches = [
            [(torch.randn(16, 8, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)) for _ in range(2)]
            for _ in range(4)
        ]
        loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
        return Loop(model, torch.optim.AdamW(model.parameters(), 1e-3), loss_fn, batches, g, accumulate=True)

    return make(None), make(guard)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 rounds, the balanced profile, no base preset")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    parser.add_argument("--profiles", nargs="+", default=None, help="profiles to time (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rounds = 5 if args.quick else args.rounds
    default = GuardConfig().profile
    profiles = args.profiles or (["balanced"] if args.quick else ["minimal", "balanced", "full"])
    targets = [("gpt", "small"), ("cnn", "tiny")] + ([] if args.quick else [("gpt", "base")])
    result: dict[tuple, float] = {}

    def time_pair(label, base, guarded):
        r, tb, tg = interleaved_ratio(base, guarded, rounds=rounds, inner=1, warmup=2, clock=args.clock)
        print(f"{label:48s} baseline {tb * 1e3:8.1f} ms  guarded {tg * 1e3:8.1f} ms  ratio {r:5.3f}", flush=True)
        return r

    for prof in profiles:
        for name, preset in targets:
            result[(prof, name, preset)] = time_pair(
                f"{prof:8s} {name} {preset}", *workload_pair(name, preset, {"profile": prof})
            )
        result[(prof, "user", "accum")] = time_pair(
            f"{prof:8s} user conv+transformer, 2 micro-batches", *user_pair({"profile": prof})
        )
    abft = dict(ABFT_ONLY, profile="full")
    fp32 = time_pair("full ABFT alone, GPT d128 L4 seq128 b16, fp32", *workload_pair("gpt", "small", abft, 16))
    bf16 = time_pair(
        "full ABFT alone, GPT d128 L4 seq128 b16, bf16 autocast",
        *workload_pair("gpt", "small", abft, 16, autocast=torch.bfloat16),
    )
    shown = "balanced" if "balanced" in profiles else default
    d = [f"{n}-{p} {result[(shown, n, p)]:.3f}x" for n, p in targets if (shown, n, p) in result]
    if (shown, "user", "accum") in result:
        d.append(f"user-loop {result[(shown, 'user', 'accum')]:.3f}x")
    print(
        f"{shown} profile (default: {default}; target 1.05): "
        + ", ".join(d)
        + f"; full ABFT fp32 {fp32:.3f}x (target 1.10), bf16 {bf16:.3f}x (target 1.20)"
    )


if __name__ == "__main__":
    main()
