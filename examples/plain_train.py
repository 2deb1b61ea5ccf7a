"""A plain training script that knows nothing of sdcscope: its own model, AdamW, gradient
accumulation, gradient clipping; DDP when a launcher starts it. Guard it or inject faults into it
unchanged (docs/guard.md, "Attach to a script unchanged"):

    sdcscope guard --out runs/plain -- python examples/plain_train.py
    sdcscope inject --spec examples/plain_train_flip.yaml --guard --out runs/flip -- python examples/plain_train.py
    sdcscope guard --out runs/plain2 -- torchrun --nproc_per_node 2 examples/plain_train.py
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

CTX = 16  # bytes of context; the model predicts the next byte


class TinyLM(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.fc1 = nn.Linear(CTX * d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.emb(x).flatten(1)))
        return self.head(F.gelu(self.fc2(h)))


def batch(windows: torch.Tensor, gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = windows[torch.randint(0, len(windows), (size,), generator=gen)]
    return w[:, :-1], w[:, -1]


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--steps", 20), ("--accum", 2), ("--batch-size", 8), ("--lr", 3e-3), ("--seed", 0)):
        p.add_argument(flag, type=type(default), default=default)  # --accum: micro-batches per step
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(open(os.__file__, "rb").read()), dtype=torch.uint8).long()
    windows = data.unfold(0, CTX + 1, 1)  # the standard library's own source: real text, no download
    model = TinyLM()
    model = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + rank)
    for _ in range(args.steps):
        optimizer.zero_grad()
        for _ in range(args.accum):
            x, y = batch(windows, gen, args.batch_size)
            loss = F.cross_entropy(model(x), y) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    print(f"rank {rank}: {args.steps} steps, last loss {loss.item() * args.accum:.4f}")
    if world > 1:
        dist.destroy_process_group()
    return loss.item() * args.accum


if __name__ == "__main__":
    main()
