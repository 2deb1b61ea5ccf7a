"""The step cost of attaching the guard to an unmodified script against the explicit Guard API.

    python benchmarks/bench_attach_cost.py [--rounds 21] [--inner 4] [--threads 1] [--profile balanced] [--floor]

The model, data and loop are ``examples/plain_train.py``'s (its own byte-level model, AdamW, two
micro-batches per step, clipping; ``--d`` its width, ``--batch-size`` per micro-batch). Two twins
train side by side in one process:

- **explicit**: the loop written for the guard -- ``with guard.step(step)``, the micro-batches'
  backward, ``guard.optimizer_step(loss, before_step=clip)``;
- **attach**: the script's plain loop, unchanged, under :class:`~sdcscope.integrations.script.ScriptAttach`
  (what ``sdcscope guard -- python train.py`` installs): the optimizer found when built, the
  step from a forward pre-hook and the global optimizer step hooks, the loss from the backward
  wrapper. Its global hooks are switched on for its own steps only (so the explicit twin runs
  without them) and the switching is timed with the attach side.

``--inner`` steps per side per round (the attach side switches its hooks once per round), sides
alternating (``_timing.interleaved_ratio``), the median of per-round ratios attach/explicit, in
wall and in CPU time; ``--floor`` adds the explicit API against a second explicit twin (the
machine's noise, which a ratio within it cannot be told from). Both guards have the same settings
(``--profile``) and write the same run directory files (events.jsonl, metrics.jsonl: the guards
are built by ``sdcscope.integrations.open_guard``, as the attach mode builds its own) to a
temporary folder. The last line holds both
ratios (target: attach ≤ explicit + 2 %).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _timing import interleaved_ratio  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.integrations import open_guard  # noqa: E402
from sdcscope.integrations.script import ScriptAttach  # noqa: E402


def load_example():
    spec = importlib.util.spec_from_file_location("plain_train", ROOT / "examples" / "plain_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Twin:
    """One copy of the script's model, optimizer and data stream."""

    def __init__(self, example, args) -> None:
        torch.manual_seed(0)
        data = torch.frombuffer(bytearray(open(os.__file__, "rb").read()), dtype=torch.uint8).long()
        self.windows = data.unfold(0, example.CTX + 1, 1)
        self.model = example.TinyLM(args.d)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(0)
        self.example, self.accum, self.batch_size, self.step_no = example, args.accum, args.batch_size, 0

    def micro(self) -> torch.Tensor:
        x, y = self.example.batch(self.windows, self.gen, self.batch_size)
        loss = F.cross_entropy(self.model(x), y) / self.accum
        loss.backward()
        return loss.detach()

    def clip(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def plain_step(self) -> None:
        """The script's own step, as examples/plain_train.py writes it."""
        self.optimizer.zero_grad()
        for _ in range(self.accum):
            self.micro()
        self.clip()
        self.optimizer.step()

    def explicit_step(self, guard: Guard) -> None:
        """The same step written for the explicit Guard API."""
        self.optimizer.zero_grad()
        with guard.step(self.step_no):
            loss = sum(self.micro() for _ in range(self.accum))
        guard.optimizer_step(loss, before_step=self.clip)
        self.step_no += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--inner", type=int, default=4, help="steps per side per round")
    ap.add_argument("--floor", action="store_true", help="also the explicit API against a second explicit twin")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default="balanced", choices=("minimal", "balanced", "full"))
    ap.add_argument("--d", type=int, default=64, help="the model's width")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    example = load_example()
    config = GuardConfig.from_dict({"profile": args.profile})
    with tempfile.TemporaryDirectory() as tmp:
        explicit = Twin(example, args)
        guard = open_guard(explicit.model, explicit.optimizer, config, Path(tmp) / "explicit")
        attach = ScriptAttach(Path(tmp) / "attach", config).install()
        attached = Twin(example, args)  # its optimizer is seen when built, as in a script
        attach.unhook()
        assert attach.optimizer is attached.optimizer

        def explicit_block() -> None:
            for _ in range(args.inner):
                explicit.explicit_step(guard)

        def attach_block() -> None:
            attach.hook()
            for _ in range(args.inner):
                attached.plain_step()
            attach.unhook()

        pairs = {"attach": attach_block}
        if args.floor:  # the explicit API against a second explicit twin: the noise of this machine
            twin = Twin(example, args)
            guard2 = open_guard(twin.model, twin.optimizer, config, Path(tmp) / "explicit2")
            pairs["floor"] = lambda: [twin.explicit_step(guard2) for _ in range(args.inner)]
        results = {}
        for name, tool in pairs.items():
            for clock in ("wall", "cpu"):
                ratio, tb, tt = interleaved_ratio(explicit_block, tool, rounds=args.rounds, inner=1, clock=clock)
                results[name, clock] = ratio, tb / args.inner, tt / args.inner
        attach.uninstall(0)
        guard.close()
        events = len(guard.events), (0 if attach.session is None else len(attach.session.guard.events))
    for (name, clock), (ratio, tb, tt) in results.items():
        print(f"{name} {clock}: explicit {tb * 1e3:.2f} ms/step, {name} {tt * 1e3:.2f} ms/step, ratio {ratio:.3f}")
    print(f"events on these clean steps: explicit {events[0]}, attach {events[1]}")
    floor = (
        f"; floor wall {results['floor', 'wall'][0]:.3f}x, cpu {results['floor', 'cpu'][0]:.3f}x" if args.floor else ""
    )
    print(
        f"attach vs explicit API per step (profile {args.profile}, d={args.d}, {args.threads} thread): "
        f"wall {results['attach', 'wall'][0]:.3f}x, cpu {results['attach', 'cpu'][0]:.3f}x (target <= 1.02x){floor}"
    )


if __name__ == "__main__":
    main()
