"""A byte-level GPT in the spirit of nanoGPT, built so every GEMM is reachable by hooks.

Each attention projection is its own ``nn.Linear`` (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``) and the two attention products are :class:`MatMul` modules (``score`` computes
``(q * scale) @ kᵀ``, ``context`` computes ``probs @ v``), so fault injectors, ABFT checkers and
metrics can hook them like any other layer.  Qualified names::

    tok_emb, pos_emb,
    blocks.{i}.ln1, blocks.{i}.attn.{q_proj,k_proj,v_proj,o_proj,score,context},
    blocks.{i}.ln2, blocks.{i}.mlp.{fc,proj},
    ln_f, head
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.fp8 import convert_to_fp8
from sdcscope.common.validate import check_choice, check_positive

PRECISIONS = ("fp32", "fp8")
"""What the blocks' Linears compute in (:attr:`GPTConfig.precision`)."""


@dataclass(kw_only=True)
class GPTConfig:
    """Shape and options of the byte-level GPT."""

    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    block_size: int = 64
    vocab_size: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    tied_head: bool = True
    qk_norm: bool = False
    z_loss: float = 0.0
    """Weight of the PaLM z-loss ``z · log²Σexp(logits)``; 0 disables it."""
    precision: str = "fp32"
    """``'fp8'``: the blocks' Linears run their Y, dX and dW as FP8 GEMMs
    (:class:`~sdcscope.common.fp8.Fp8Linear`: e4m3 X and W, e5m2 dY, dynamic per-tensor scales);
    embeddings, norms, attention products and the head stay fp32."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "block_size", "vocab_size", "mlp_ratio"):
            check_positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.z_loss < 0:
            raise ValueError(f"z_loss={self.z_loss} must be >= 0")
        check_choice("precision", self.precision, PRECISIONS)

    def to_dict(self) -> dict:
        return asdict(self)


GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=64),
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, block_size=128),
    "base": GPTConfig(n_layer=6, n_head=6, d_model=384, block_size=256),
}


TP_PLAN = {
    "attn.q_proj": "col",
    "attn.k_proj": "col",
    "attn.v_proj": "col",
    "attn.o_proj": "row",
    "mlp.fc": "col",
    "mlp.proj": "row",
}
"""The tensor-parallel plan of a :class:`Block`: q, k, v colwise and o rowwise (each rank holds
whole heads), the MLP's fc colwise and proj rowwise; one all-reduce per pair. Embeddings, norms
and the head stay whole."""


def check_tensor_parallel(cfg: GPTConfig, degree: int, what: str) -> None:
    """Refuse (ValueError) a tensor-parallel ``degree`` that does not divide the heads and the MLP
    width of ``cfg``, naming the allowed degrees; ``what``: how the user chose it."""
    width = cfg.mlp_ratio * cfg.d_model
    if cfg.n_head % degree == 0 and width % degree == 0:
        return
    common = math.gcd(cfg.n_head, width)
    allowed = [d for d in range(1, common + 1) if common % d == 0]
    raise ValueError(
        f"{what} splits every block over {degree} ranks (tensor-parallel degree {degree}), but the GPT's "
        f"n_head={cfg.n_head} and MLP width {width} are not both divisible by {degree}; allowed degrees: "
        f"{', '.join(map(str, allowed))}"
    )


def gpt_preset(name: str) -> GPTConfig:
    check_choice("preset", name, GPT_PRESETS)
    return GPTConfig(**GPT_PRESETS[name].to_dict())


class MatMul(nn.Module):
    """``a @ b`` as a module, so a hook can see (and an injector can alter) the product.

    ``is_matmul`` is the duck-typed contract other rooms rely on: ``forward(a, b)`` returns
    ``torch.matmul(a, b)``.
    """

    is_matmul = True

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.score = MatMul()
        self.context = MatMul()
        self.q_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)  # -1: a tensor-parallel rank holds some heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = self.score(q * (1.0 / math.sqrt(self.head_dim)), k.transpose(-2, -1))
        scores = scores.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        probs = self.dropout(F.softmax(scores, dim=-1))
        y = self.context(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``block``: the class of the repeated blocks (:class:`Block`; the MoE GPT's own, which
    replaces the MLP by a routed layer of experts)."""

    def __init__(self, cfg: GPTConfig, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 style scaled init of the residual projections (the MLP's, or each expert's).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", ".proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.precision == "fp8":  # after init: the same parameters as the fp32 model's
            convert_to_fp8(self, "blocks.*")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of the byte ids ``idx``; a pipeline stage (:func:`split_stage`) without the
        embeddings takes the previous stage's activation, one without the head returns its own."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        x = idx
        if self.tok_emb is not None:
            pos = torch.arange(t, device=idx.device)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x)
        return x if self.head is None else self.head(self.ln_f(x))


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` pipeline stages: contiguous, as even as they go (the
    first stages take one more)."""
    per, extra = divmod(n_layer, stages)
    starts = [s * per + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def split_stage(model: GPT, stage: int, stages: int) -> tuple[tuple[str, ...], list[nn.Parameter]]:
    """Keep only pipeline stage ``stage`` of ``stages`` of ``model``, in place: the first stage
    keeps the embeddings, the last the final norm and head, each its blocks
    (:func:`stage_blocks`) under their own names (``blocks.3`` stays ``blocks.3``). Returns the
    names of the activations each stage sends on (the output of its last block) and the
    parameters of this stage another stage holds too (a tied head: the embedding)."""
    ranges = stage_blocks(len(model.blocks), stages)
    keep = ranges[stage]
    tied = [model.head.weight] if model.cfg.tied_head and stages > 1 and stage in (0, stages - 1) else []
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in keep})
    if stage > 0:
        model.tok_emb = model.pos_emb = model.drop = None
    if stage < stages - 1:
        model.ln_f = model.head = None
    return tuple(f"blocks.{r[-1]}" for r in ranges[:-1]), tied


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Next-byte cross-entropy, plus the z-loss ``z · mean(logsumexp(logits)²)`` when z > 0."""
    flat = logits.reshape(-1, logits.size(-1))
    loss = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss > 0:
        loss = loss + z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
    return loss
