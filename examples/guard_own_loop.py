"""Guard your own training loop: any model, optimizer, data and loss -- here the tiny byte-level
GPT of sdcscope's workloads on Python's standard library source -- and, with ``--fault``, a bit
flip in one of its GEMMs halfway, to watch the guard find it, replay the step and keep the clean
result.

    python examples/guard_own_loop.py                                  # 40 guarded steps
    python examples/guard_own_loop.py --fault                          # a flipped exponent bit at step 20
    python examples/guard_own_loop.py --guard-config examples/guard.yaml --fault
    python examples/guard_own_loop.py --no-guard --lr 3e-4             # the plain loop, e.g. traced by
        sdcscope invariants trace --out runs/mine -- python examples/guard_own_loop.py --no-guard

Each finding is a WARNING line here and a line of ``OUT/events.jsonl`` (docs/guard.md).
"""

from __future__ import annotations

import argparse
import logging

import torch

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload


def flip_at(step: int) -> FaultSpec:
    """The top exponent bit of one element of an attention projection's output, at ``step``."""
    return FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "blocks.0.attn.q_proj",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": 5},
            "schedule": {"kind": "transient", "step": step},
            "seed": 1,
        }
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default="runs/own_loop", help="the guard's run directory (events.jsonl)")
    parser.add_argument("--guard-config", help="a guard config file, e.g. examples/guard.yaml")
    parser.add_argument("--fault", action="store_true", help="flip a bit in a GEMM output halfway")
    parser.add_argument("--no-guard", action="store_true", help="train without the guard")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(args.seed)
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=args.batch_size, lr=args.lr))
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    loss_fn = workload.loss  # loss_fn(model, batch) -> the scalar loss
    injector = Injector(model, [flip_at(args.steps // 2)] if args.fault else [], optimizer).attach()
    guard = None
    if not args.no_guard:
        config = GuardConfig.load(args.guard_config) if args.guard_config else GuardConfig()
        guard = Guard(model, optimizer, config, run_dir=args.out, loss_fn=loss_fn).attach()
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    step, data_pos, loss = 0, 0, None
    while step < args.steps:
        batch = workload.batch(args.seed, data_pos)  # the data moves on: a rolled-back step gets new batches
        data_pos += 1
        injector.set_position(step)
        optimizer.zero_grad()
        if guard is None:
            loss = loss_fn(model, batch)
            loss.backward()
            clip()
            optimizer.step()
            step += 1
            continue
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        guard.optimizer_step(loss, before_step=clip)  # checks; replays on a detection; clips; steps or vetoes
        if guard.stopped:  # a fault it cannot repair: guard.stop_reason says why
            break
        step = guard.rolled_back_to if guard.rolled_back_to is not None else step + 1
    injector.detach()
    events = [] if guard is None else list(guard.events)
    result = {"steps": step, "loss": loss.item(), "faults_fired": len(injector.records), "events": events}
    if guard is not None:
        result["stopped"] = guard.stop_reason if guard.stopped else None
        guard.close()
    print(
        f"{step} steps, last loss {result['loss']:.4f}; {result['faults_fired']} fault(s) fired, "
        f"{len(events)} guard event(s)" + ("" if guard is None else f" (in {args.out}/events.jsonl)")
    )
    return result


if __name__ == "__main__":
    main()
