"""Tiny models shared by the observe/detect tests (no dependency on sdcscope.workloads)."""

from __future__ import annotations

import math

import torch
from torch import nn

from sdcscope.inject.targets import weight_grad_edge


class MatMul(nn.Module):
    """The MatMul contract: ``is_matmul = True`` and ``forward(a, b) = a @ b``."""

    is_matmul = True

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)
        self.score = MatMul()
        self.context = MatMul()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln(x)
        q, k, v = self.split(self.q_proj(h)), self.split(self.k_proj(h)), self.split(self.v_proj(h))
        s = self.score(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        y = self.context(p, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(y)
        return x + self.proj(torch.relu(self.fc(x)))


class TinyTransformer(nn.Module):
    """Byte-level 2-block transformer with an explicit score/context MatMul per block."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2,
                 seq: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_batch(step: int, vocab: int = 32, batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def flip_bit(t: torch.Tensor, index: tuple, bit: int) -> None:
    """Flip one bit of one float32 element in place."""
    assert t.dtype == torch.float32
    flat = t.detach().view(torch.int32)
    flat[index] = flat[index] ^ torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def on_grad_weight(module: nn.Module, fn) -> None:
    """Apply ``fn(dW) -> dW`` to the dW of every call of ``module``'s GEMM (where hardware
    corrupts it: the call's own autograd node, before the weight's other uses are summed in)."""
    def forward_hook(mod, args, out):
        edge = weight_grad_edge(out, mod.weight)
        if edge is not None:
            node, i = edge
            node.register_hook(lambda gi, go: tuple(fn(g) if k == i else g for k, g in enumerate(gi)))
    module.register_forward_hook(forward_hook)


# --- the helpers above are imported by the other observe/detect tests; sanity checks here ---

def test_flip_bit_exponent():
    t = torch.tensor([0.75, -0.25])
    flip_bit(t, (0,), 30)
    assert t[0].item() == 0.75 * 2.0 ** 128
    flip_bit(t, (1,), 31)
    assert t[1].item() == 0.25


def test_tiny_transformer_runs():
    m = TinyTransformer()
    loss = lm_loss(m, lm_batch(0))
    loss.backward()
    assert torch.isfinite(loss)
