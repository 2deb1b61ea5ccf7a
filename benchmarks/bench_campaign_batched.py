"""Can campaign trials be batched? K trials of the tiny GPT as one vmapped step vs one by one.

    python benchmarks/bench_campaign_batched.py [--k 4 16] [--rounds 9]

A campaign trial is the workload trained for its horizon from a golden snapshot with one fault.
Batching K trials stacks K copies of the parameters and computes their losses and gradients in
one ``torch.func.vmap(grad_and_value(functional_call(...)))`` call. This script measures, with
one torch thread, (a) whether each trial's loss and gradients are bitwise equal to those of the
same trial run alone (the campaign's rows are compared with its golden twin bit for bit, so a
batched runner is only usable if they are), and (b) the time of one batched step over the time
of K single steps (interleaved, median of rounds). The last line prints both for each K.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.func import functional_call, grad_and_value, vmap

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved_ratio  # noqa: E402
from sdcscope.workloads.gpt import GPT, gpt_preset, lm_loss  # noqa: E402


def trial_params(model: torch.nn.Module, k: int) -> dict[str, torch.Tensor]:
    """K parameter copies, each trial's differing in one weight element (as after a fault)."""
    stacked = {n: p.detach().unsqueeze(0).repeat(k, *[1] * p.dim()).clone() for n, p in model.named_parameters()}
    for i in range(k):
        stacked["blocks.0.attn.q_proj.weight"][i, 0, i % 8] += 0.01 * (i + 1)
    return stacked


def one_by_one(model: torch.nn.Module, stacked: dict, x: torch.Tensor, y: torch.Tensor, i: int):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(stacked[n][i])
    loss = lm_loss(twin(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in twin.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(gpt_preset("tiny"))
    x, y = torch.randint(0, 256, (16, 64)), torch.randint(0, 256, (16, 64))

    def loss_of(params, x, y):
        return lm_loss(functional_call(model, params, (x,)), y)

    batched = vmap(grad_and_value(loss_of), in_dims=(0, None, None))
    rows = []
    for k in args.k:
        stacked = trial_params(model, k)
        grads, losses = batched(stacked, x, y)
        equal = 0
        for i in range(k):
            loss, ref = one_by_one(model, stacked, x, y, i)
            equal += int(torch.equal(loss, losses[i]) and all(torch.equal(ref[n], grads[n][i]) for n in ref))

        def singles(stacked=stacked, k=k):
            for i in range(k):
                model.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(stacked[n][i])
                lm_loss(model(x), y).backward()

        ratio, t_single, t_batch = interleaved_ratio(
            singles, lambda stacked=stacked: batched(stacked, x, y), rounds=args.rounds, inner=1, warmup=1
        )
        print(f"K={k}: {equal}/{k} trials bitwise equal; K singles {t_single:.3f} s, one batched step {t_batch:.3f} s")
        rows.append(f"K={k}: speed-up {1 / ratio:.2f}x, bitwise {equal}/{k}")
    print("batched trials vs one by one: " + "; ".join(rows))


if __name__ == "__main__":
    main()
