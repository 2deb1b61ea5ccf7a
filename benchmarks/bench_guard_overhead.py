"""Guard cost per training step, interleaved with an unguarded twin in one process (median ratio).

    python benchmarks/bench_guard_overhead.py [--presets tiny small] [--rounds 41] [--clock cpu] [--workload cnn]

Configurations: (1) metrics + non-finite + spike detectors (target ≤ 3 %); (2) ABFT alone on every
Linear, forward/dX/dW, every step (target ≤ 15 % on CPU); (3) the same plus the attention products
(score and context MatMuls); (4) ABFT alone sampled to a 2 % budget (target ≤ 2 %); (5) the full
default guard (all of the above with ABFT every step, plus the weight/optimizer-state checksums).

``--hooks-only`` (analysis): ABFT's hooks, operand views and gradient captures run but record no
check — the floor of checking every GEMM through module hooks, whatever the checksum costs.

``--floor`` (analysis): adds a row "reductions only": the reductions and GEMVs that ABFT's column
checks of every Linear need (1ᵀX, ‖X‖, 1ᵀY, W's row norms and W·1ᵀX; at the GEMM's autograd node
1ᵀdX, ‖dY‖, W's column norms and Wᵀ·1ᵀdY; at dW's node dY·1, 1ᵀdW and Xᵀ·(dY·1)), one threshold
comparison per step, and nothing else: no rounding model, no localization, no sampling or
replay bookkeeping. What eager PyTorch charges for the checks' memory passes on this machine.
A row "reductions deferred (floor)": the same reductions run in one batch after backward, not
inside the hooks (whether interleaving them with the GEMMs is what makes them slow: it is not).
And a row "each result read once (bound)": one column sum of each GEMM result (Y, dX, dW) of
every Linear through the same hooks, no operand statistics, no expected side — less than any
checksum scheme can read, since each must also reduce an operand of every GEMM.

Each round times one step of each side, in alternating order (many short rounds: on this VM a
step timed against itself moved by +-4 % with 11 rounds of 5 steps, by +-1.5 % with 41 rounds of
one); the first line per preset is that noise floor, the baseline against itself.

``--clock cpu`` times with the process CPU clock (all threads): robust when other jobs share the
machine; the default wall clock is right on a quiet one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _timing import interleaved_ratio  # noqa: E402
from sdcscope.engine import TrainConfig, Trainer  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.workloads import WorkloadConfig, make_workload  # noqa: E402

_ONLY_ABFT = dict(metrics=None, nonfinite=None, loss_spike=None, grad_spike=None, state_checksum=None)
CONFIGS = {
    "metrics+nonfinite+spike": dict(abft=None, state_checksum=None),
    "ABFT every Linear, every step": dict(_ONLY_ABFT, abft={"kinds": ["linear"]}),
    "ABFT + attention products": _ONLY_ABFT,
    "ABFT sampled to a 2% budget": dict(_ONLY_ABFT, abft={"budget": 0.02}),
    "full default guard": dict(),
}


class _Reductions:
    """The floor: ABFT's column-check reductions on every Linear of ``model`` (see ``--floor``);
    ``touch=True``: only one column sum of each GEMM result (Y, dX, dW), the least any check reads;
    ``defer=True``: the same reductions, all run in one batch after backward instead of inside
    the hooks (the hooks keep references only)."""

    def __init__(self, model: torch.nn.Module, touch: bool = False, defer: bool = False) -> None:
        self.parts: list = []
        self.touch, self.defer = touch, defer
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(self._forward)

    def _add(self, thunk) -> None:
        self.parts.append(thunk if self.defer else thunk())

    def _forward(self, module, args, out) -> None:
        w, x, y = module.weight.detach(), args[0].detach(), out.detach()
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        node = out.grad_fn
        while type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0"):
            node = node.next_functions[0][0]
        xi = 1 if type(node).__name__ == "AddmmBackward0" else 0
        seen = {}
        if self.touch:
            self._add(lambda: (y2.sum(0),))

            def gemm_node(grad_inputs, grad_outputs):
                if (dx := grad_inputs[xi]) is not None:
                    self._add(lambda: (dx.sum(0),))

            def dw_node(grad_inputs, grad_outputs):
                dw = grad_inputs[0]
                self._add(lambda: (dw.sum(0),))
        else:

            def forward():
                s0 = x2.sum(0)
                seen["fx"] = fx = torch.linalg.vector_norm(x2).view(1)
                exp = torch.mv(w, s0) if module.bias is None else torch.addmv(module.bias.detach(), w, s0, beta=len(x2))
                return y2.sum(0), exp, torch.linalg.vector_norm(w, dim=1), fx

            self._add(forward)

            def gemm_node(grad_inputs, grad_outputs):  # dX = dY·W
                dy, dx, db = grad_outputs[0], grad_inputs[xi], grad_inputs[0] if xi == 1 else None

                def grad_input():
                    seen["norm"] = torch.linalg.vector_norm(dy).view(1)
                    s = db if db is not None else dy.sum(0)
                    return dx.sum(0), torch.mv(w.t(), s), torch.linalg.vector_norm(w, dim=0), seen["norm"]

                seen["dy"] = dy
                if dx is not None:
                    self._add(grad_input)
                else:
                    seen["norm"] = torch.linalg.vector_norm(dy).view(1)

            def dw_node(grad_inputs, grad_outputs):  # dW = dYᵀ·X
                dw, dy = grad_inputs[0], seen["dy"]

                def grad_weight():
                    r = dy.sum(1)
                    return dw.sum(0), torch.mv(x2.t(), r), seen["fx"].expand(x2.shape[1]), seen["norm"]

                self._add(grad_weight)

        node.register_hook(gemm_node)
        node.next_functions[xi + 1][0].register_hook(dw_node)

    def before_optimizer_step(self, ctx) -> None:
        if self.defer:
            self.parts = [thunk() for thunk in self.parts]
        if self.touch:
            assert float(torch.cat([p[0] for p in self.parts]).abs().amax()) < 1e38
        else:
            act, exp, scale, norm = (torch.cat(p) for p in zip(*self.parts))
            sizes = torch.tensor([p[0].numel() for p in self.parts])
            tau = scale * norm.repeat_interleave(sizes) * 1e-5 + act.abs() * 1e-6
            assert float(((act - exp).abs() / tau).amax()) < 1e30
        self.parts.clear()


WORKLOAD = "gpt"


def trainer(preset: str, guard: dict | None) -> Trainer:
    t = Trainer(make_workload(WorkloadConfig(workload=WORKLOAD, preset=preset)), TrainConfig(seed=0))
    if guard is not None:
        t.add_callback(Guard(t.model, t.optimizer, GuardConfig.from_dict(guard)).callback())
    return t


def _with_reductions(t: Trainer, touch: bool = False, defer: bool = False) -> Trainer:
    t.add_callback(_Reductions(t.model, touch, defer))
    return t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--hooks-only", action="store_true", help="ABFT records no check (analysis)")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add a row: ABFT's column-check reductions alone, no bookkeeping (analysis)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        metavar="NAME",
        help="subset of: " + "; ".join(CONFIGS).replace("%", "%%"),
    )
    parser.add_argument(
        "--workload",
        choices=("gpt", "cnn"),
        default="gpt",
        help="cnn: the LeNet-style CNN (its convolutions are in every config with ABFT's default kinds)",
    )
    args = parser.parse_args()
    global WORKLOAD
    WORKLOAD = args.workload
    if args.hooks_only:
        from sdcscope.detect.abft import ABFTDetector

        ABFTDetector._record = ABFTDetector._lean_line = lambda self, *a, **k: None
    summary = []
    for preset in args.presets:
        base = trainer(preset, None)
        noise, tb, _ = interleaved_ratio(
            base.train_step, base.train_step, rounds=args.rounds, inner=1, warmup=2, clock=args.clock
        )
        print(
            f"{preset:5s} {'noise floor (baseline vs itself)':30s} baseline {tb * 1e3:7.2f} ms  "
            f"{'':17s}overhead {100 * (noise - 1):+6.2f}%"
        )
        rows = [(name, lambda name=name: trainer(preset, CONFIGS[name])) for name in args.configs]
        if args.floor:
            rows.append(("reductions only (floor)", lambda: _with_reductions(trainer(preset, None))))
            rows.append(("reductions deferred (floor)", lambda: _with_reductions(trainer(preset, None), defer=True)))
            rows.append(("each result read once (bound)", lambda: _with_reductions(trainer(preset, None), True)))
        for name, build in rows:
            tool = build()
            ratio, tb, tt = interleaved_ratio(
                base.train_step, tool.train_step, rounds=args.rounds, inner=1, warmup=2, clock=args.clock
            )
            print(
                f"{preset:5s} {name:30s} baseline {tb * 1e3:7.2f} ms  guarded {tt * 1e3:7.2f} ms  "
                f"overhead {100 * (ratio - 1):+6.2f}%"
            )
            summary.append(f"{preset}/{name} {100 * (ratio - 1):+.1f}%")
    print("guard overhead per step: " + "; ".join(summary))


if __name__ == "__main__":
    main()
