"""A mixture-of-experts GPT: the byte-level GPT whose MLP is a top-k routed layer of E experts.

Each block's MLP becomes a :class:`MoELayer`, five steps each its own piece so hooks, ABFT and
fault injection reach them by name, and so an expert-parallel world can replace the local
permutation by an all-to-all (:func:`dispatch` and :func:`combine` are plain functions)::

    blocks.{i}.moe.router            nn.Linear(d, E): the router logits
    (route)                          softmax, top-k with ties broken towards the lower expert
    blocks.{i}.moe.dispatch          TokenDispatch: the token permutation (tokens sorted by expert)
    blocks.{i}.moe.experts.{e}.fc    each expert's own GEMMs: nn.Linear modules
    blocks.{i}.moe.experts.{e}.proj
    (combine)                        the inverse permutation, weighted by the router probabilities

The experts run as a loop of plain GEMMs, one ``nn.Linear`` call pair per expert: a
grouped kernel (``torch._grouped_mm``) would be one op over a 3-D weight, which no module hook
sees, so ABFT and the GEMM fault sites could not name the expert. The load-balancing loss is the
Switch Transformer's, ``E · Σ_e f_e · P_e`` (f_e the share of the token slots routed to expert e,
P_e the mean router probability of e), weighted by ``aux_loss``; its gradient joins the
backward pass through the layer's output (:class:`_AuxLoss`), so the loss a loop reports is the
language-model loss alone and every training loop (plain, DDP, the guard's replay) trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.alltoall import EXPERT, Exchange
from sdcscope.common.validate import check_choice, check_float, check_positive
from sdcscope.workloads.gpt import GPT, CausalSelfAttention, GPTConfig


@dataclass(kw_only=True)
class MoEConfig(GPTConfig):
    """The GPT's shape plus the experts: ``n_expert`` experts of hidden width ``mlp_ratio ·
    d_model`` each, ``top_k`` of them per token, the load-balancing loss weight ``aux_loss``."""

    n_expert: int = 4
    top_k: int = 2
    aux_loss: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("n_expert", self.n_expert)
        check_positive("top_k", self.top_k)
        if self.top_k > self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be <= n_expert={self.n_expert} (allowed: 1..{self.n_expert})")
        check_float("aux_loss", self.aux_loss, low=0)


MOE_PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(n_layer=2, n_head=2, d_model=64, block_size=64, mlp_ratio=2, n_expert=4, top_k=2),
    "small": MoEConfig(n_layer=4, n_head=4, d_model=128, block_size=128, mlp_ratio=2, n_expert=8, top_k=2),
}


def moe_preset(name: str) -> MoEConfig:
    check_choice("preset", name, MOE_PRESETS)
    return MoEConfig(**MOE_PRESETS[name].to_dict())


class Dispatched(NamedTuple):
    """The dispatch's result: ``rows`` [N·k, d] the token rows in expert order (what the experts
    read, and what an expert-parallel all-to-all moves), ``order`` [N·k] the assignment each slot
    holds (token ``order // k``, its ``order % k``-th choice), ``counts`` [E] the slots per expert."""

    rows: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [N, E], weights [N, k], experts [N, k])`` from router logits [N, E]: the softmax in
    fp32 and its ``top_k`` largest, ties broken towards the lower expert index (a stable sort:
    ``torch.topk`` promises no order among equal values)."""
    probs = F.softmax(logits.float(), dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return probs, probs.gather(1, experts), experts


def dispatch(x: torch.Tensor, experts: torch.Tensor, n_expert: int) -> Dispatched:
    """Sort the token slots by expert: token t's j-th choice is assignment ``t·k + j``; slots keep
    the token order within an expert (a stable sort), so the permutation is a pure function of
    the routing."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_expert)
    return Dispatched(x[order // experts.shape[1]], order, counts)


def combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of :func:`dispatch`: the expert outputs ``y`` [N·k, d] back in
    assignment order, summed over each token's k choices weighted by ``weights`` [N, k] (a fixed
    order of additions: deterministic)."""
    n, k = weights.shape
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return (y[back].view(n, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1)


class TokenDispatch(nn.Module):
    """:func:`dispatch` as a module (``is_dispatch``: the contract the dispatch integrity check and
    the ``dispatch`` fault site look for): ``forward(x [N, d], experts [N, k]) -> Dispatched``."""

    is_dispatch = True

    def __init__(self, n_expert: int) -> None:
        super().__init__()
        self.n_expert = n_expert

    def forward(self, x: torch.Tensor, experts: torch.Tensor) -> Dispatched:
        return dispatch(x, experts, self.n_expert)


class Expert(nn.Module):
    """One expert: the GPT's MLP, ``proj(gelu(fc(x)))``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward hands ``aux`` the gradient ``weight``: as if ``weight · aux``
    were added to the loss (Megatron-LM's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.save_for_backward(aux)
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


class MoELayer(nn.Module):
    """Router, top-k, dispatch, one GEMM pair per expert, combine (see the module docstring)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.n_expert, self.aux_weight = cfg.top_k, cfg.n_expert, cfg.aux_loss
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.dispatch = TokenDispatch(cfg.n_expert)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.mlp_ratio * cfg.d_model) for _ in range(cfg.n_expert))
        self.dropout = nn.Dropout(cfg.dropout)
        self.aux: torch.Tensor | None = None
        """The last forward's load-balancing loss (unweighted, detached)."""
        self.exchange: Exchange | None = None
        """Expert parallel (:func:`shard_experts`): the all-to-all to the ranks owning the experts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, experts = route(self.router(x), self.top_k)
        rows, order, counts = self.dispatch(x, experts)
        # every expert runs, one without tokens on an empty slice: its gradient is zero, not
        # missing (DDP reduces every parameter's gradient each step)
        if self.exchange is None:
            chunks = rows.split(counts.tolist())
            y = torch.cat([expert(c) for expert, c in zip(self.experts, chunks)])
        else:
            y = self._remote_experts(rows, counts)
        out = combine(y, order, weights)
        share = counts.to(probs.dtype) / order.numel()
        aux = self.n_expert * (share * probs.mean(0)).sum()
        self.aux = aux.detach()
        if self.aux_weight and torch.is_grad_enabled() and aux.requires_grad:
            out = _AuxLoss.apply(out, aux, self.aux_weight)
        return self.dropout(out).view(shape)

    def _remote_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs of ``rows`` (in expert order, ``counts`` per expert) when the
        experts live on the ranks of the exchange: rank ``r`` owns experts ``r·E/W ..``; the
        slot counts are exchanged first (the split sizes), then the rows go out (``dispatch``),
        each local expert runs on what every rank sent it, and the outputs come back
        (``combine``) in the order the rows left."""
        import torch.distributed as dist

        ex = self.exchange
        W, per = ex.size, self.n_expert // ex.size
        arrived = torch.empty_like(counts)  # [W·per]: rank s's slots for each of this rank's experts
        dist.all_to_all_single(arrived, counts, group=ex.group)
        both = torch.cat([counts, arrived]).tolist()  # the step's split sizes: one host read
        send = [sum(both[r * per : (r + 1) * per]) for r in range(W)]
        got = torch.tensor(both[self.n_expert :]).view(W, per)
        recv = got.sum(1).tolist()
        here = ex.move(rows, send, recv, "dispatch")  # [Σ recv, d]: by source rank, then expert
        start = torch.cat([got.new_zeros(1), got.flatten().cumsum(0)[:-1]]).view(W, per)
        by_expert = [torch.arange(int(start[s, j]), int(start[s, j] + got[s, j])) for j in range(per) for s in range(W)]
        perm = torch.cat(by_expert).to(rows.device)  # source-major -> expert-major
        sizes = got.sum(0).tolist()
        y = torch.cat([e(c) for e, c in zip(self.experts.values(), here[perm].split(sizes))])
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return ex.move(y[back], recv, send, "combine")


def shard_experts(model: nn.Module, group: object) -> list[str]:
    """Expert parallelism in place: every :class:`MoELayer` of ``model`` keeps only the experts
    its rank of ``group`` owns (``E / W`` consecutive ones, still named by their global index:
    ``experts.{e}``) and exchanges tokens with the other ranks through an all-to-all
    (:class:`~sdcscope.common.alltoall.Exchange`). Every rank must call it on the same model
    (same initialisation); rebuild the optimizer after. Returns the layers' names."""
    import torch.distributed as dist

    ranks = list(dist.get_process_group_ranks(group))
    W, me = len(ranks), dist.get_rank(group)
    done = []
    for name, layer in model.named_modules():
        if not isinstance(layer, MoELayer) or layer.exchange is not None:
            continue
        if layer.n_expert % W:
            raise ValueError(f"n_expert={layer.n_expert} must be a multiple of the expert-parallel degree {W}")
        per = layer.n_expert // W
        layer.experts = nn.ModuleDict({str(e): layer.experts[e] for e in range(me * per, (me + 1) * per)})
        for p in layer.experts.parameters():
            setattr(p, EXPERT, W)
        layer.exchange = Exchange(name, group, ranks, dist.get_rank())
        done.append(name)
    return done


class MoEBlock(nn.Module):
    """Pre-LayerNorm transformer block whose MLP is a :class:`MoELayer`."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    """The byte-level GPT (embeddings, attention, head, initialisation) with :class:`MoEBlock` s."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg, block=MoEBlock)

    def aux_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss summed over the layers (unweighted; None before one)."""
        got = [b.moe.aux for b in self.blocks if b.moe.aux is not None]
        return torch.stack(got).sum() if got else None
