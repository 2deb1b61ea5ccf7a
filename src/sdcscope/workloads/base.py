"""The workload contract the engine trains: model, optimizer, data, loss, evaluation, and how the
model may be split over ranks (its :class:`ParallelizePlan`).

``make_workload(WorkloadConfig(...))`` returns a :class:`GPTWorkload`, :class:`MoEWorkload` or
:class:`CNNWorkload`.
Everything a run depends on is in the config, so a run is reproducible from ``config.json``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.validate import check_bool, check_choice, check_float, check_non_negative, check_positive
from sdcscope.workloads.cnn import CNN_PRESETS, LeNet, cnn_preset
from sdcscope.workloads.data import ByteCorpus, load_digits_tensors, step_generator
from sdcscope.workloads.gpt import (
    GPT,
    GPT_PRESETS,
    PRECISIONS,
    TP_PLAN,
    check_tensor_parallel,
    gpt_preset,
    lm_loss,
    split_stage,
)
from sdcscope.workloads.moe import MOE_PRESETS, MoEGPT, moe_preset

WORKLOADS = {"gpt": GPT_PRESETS, "cnn": CNN_PRESETS, "moe": MOE_PRESETS}
TEXT_WORKLOADS = ("gpt", "moe")
DEFAULTS = {  # per workload: batch_size, lr, weight_decay
    "gpt": (16, 3e-3, 0.1),
    "moe": (16, 3e-3, 0.1),
    "cnn": (64, 3e-3, 0.0),
}


@dataclass(kw_only=True)
class WorkloadConfig:
    """What to train. ``None`` fields take the workload's default."""

    workload: str = "gpt"
    preset: str = "tiny"
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    warmup: int = 20
    """Linear learning-rate warm-up steps, then constant (independent of run length, so a
    run of 2N steps equals N steps resumed for N more)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    corpus: str | None = None
    """Text file or folder for the GPT and the MoE GPT; ``None`` = the running Python's standard library."""
    max_corpus_bytes: int = 4_000_000
    eval_batches: int = 8
    qk_norm: bool = False
    z_loss: float = 0.0
    precision: str = "fp32"
    """gpt: ``'fp8'`` runs the blocks' Linears as FP8 GEMMs (:attr:`GPTConfig.precision`)."""
    label_noise: float = 0.0
    """cnn: the chance that a training label is replaced by a random class, drawn afresh every step
    (validation stays clean): a task the model cannot fit, whose loss never reaches zero."""

    def __post_init__(self) -> None:
        check_choice("workload", self.workload, WORKLOADS)
        check_choice(f"{self.workload} preset", self.preset, WORKLOADS[self.workload])
        b, lr, wd = DEFAULTS[self.workload]
        self.batch_size = b if self.batch_size is None else self.batch_size
        if self.lr is None:
            self.lr = lr
        if self.weight_decay is None:
            self.weight_decay = wd
        check_positive("batch_size", self.batch_size)
        check_float("lr", self.lr, low=0, low_open=True)
        check_float("weight_decay", self.weight_decay, low=0)
        check_non_negative("warmup", self.warmup)
        check_float("grad_clip", self.grad_clip, low=0)  # 0: no clipping
        check_positive("eval_batches", self.eval_batches)
        check_positive("max_corpus_bytes", self.max_corpus_bytes)
        check_bool("qk_norm", self.qk_norm)
        check_float("z_loss", self.z_loss, low=0)
        check_choice("precision", self.precision, PRECISIONS)
        check_float("label_noise", self.label_noise, low=0, high=1, high_open=True)
        self.label_noise = float(self.label_noise)
        if self.label_noise and self.workload != "cnn":
            raise ValueError(f"label_noise applies to the cnn workload only, not {self.workload!r}")
        if self.precision != "fp32" and self.workload != "gpt":
            raise ValueError(f"precision {self.precision!r} applies to the gpt workload only, not {self.workload!r}")
        self.lr, self.weight_decay = float(self.lr), float(self.weight_decay)
        self.grad_clip, self.z_loss = float(self.grad_clip), float(self.z_loss)
        if isinstance(self.corpus, os.PathLike):
            self.corpus = os.fspath(self.corpus)
        if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus):
            error = ValueError if self.corpus == "" else TypeError
            raise error(
                f"corpus={self.corpus!r} must be a path (a text file or a folder) or null "
                "(the running Python's standard library)"
            )
        if self.corpus is not None and self.workload not in TEXT_WORKLOADS:
            raise ValueError(
                f"corpus applies to the {' and '.join(TEXT_WORKLOADS)} workloads only, not {self.workload!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ParallelizePlan:
    """How a workload's model is split over ranks, by module names: the model owns its plan, the
    engine (:mod:`sdcscope.engine.topology`) applies it with PyTorch's own engines on its mesh."""

    blocks: str
    """The ``nn.ModuleList`` of repeated blocks: FSDP2 shards each block, then the root."""
    tensor_parallel: Mapping[str, str]
    """Module name inside a block -> ``"col"`` (``ColwiseParallel``) or ``"row"`` (``RowwiseParallel``)."""
    experts: bool = False
    """The model's MoE layers shard their experts over an ``ep`` mesh dim
    (:func:`~sdcscope.workloads.moe.shard_experts`): ``--parallel ep`` and ``fsdp+ep``."""


class Workload:
    """Base class: subclasses build the model and define data, loss and evaluation."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.config.lr, betas=(0.9, 0.95), foreach=True)

    def lr_at(self, step: int) -> float:
        w = self.config.warmup
        return self.config.lr * (min(1.0, (step + 1) / w) if w else 1.0)

    def batch(self, seed: int, step: int, micro_batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Facts about the data worth recording in config.json."""
        return {}

    def task(self) -> str:
        """What the model learns, from what data, in words (the demo's first line)."""
        return f"the {self.config.workload} workload"

    def parallelize_plan(self) -> ParallelizePlan | None:
        """How the model is split over ranks (``--parallel fsdp|tp|fsdp+tp|hsdp``); None: the model
        trains whole only (one process, or a replica per rank with ``--parallel ddp``)."""
        return None

    def check_parallel(self, kind: str, tp_degree: int, ep_degree: int = 1) -> None:
        """Refuse (ValueError) ``--parallel kind`` at tensor-parallel degree ``tp_degree`` (expert
        parallel degree ``ep_degree``) when the model cannot be split so: here, when it has no
        plan or no experts for an expert-parallel kind. A workload with a plan checks its shapes."""
        plan = self.parallelize_plan()
        if plan is None:
            raise ValueError(
                f"--parallel {kind}: the {self.config.workload} workload has no parallelize plan (its model "
                "trains whole); use --parallel ddp (a replica per rank) or a workload with a plan (gpt)"
            )
        if ep_degree > 1 and not plan.experts:
            raise ValueError(
                f"--parallel {kind} shards experts: the {self.config.workload} workload has none; use --workload moe"
            )

    def check_pipeline(self, kind: str, stages: int) -> None:
        """Refuse (ValueError) ``--parallel kind`` over ``stages`` pipeline stages when the model
        cannot be split so: here, always (a workload that can overrides :meth:`split_stage`)."""
        raise ValueError(
            f"--parallel {kind}: the {self.config.workload} workload cannot be split into pipeline stages; "
            "use --parallel ddp or fsdp, or the gpt workload"
        )

    def split_stage(self, model: nn.Module, stage: int, stages: int) -> tuple[tuple[str, ...], list]:
        """Keep pipeline stage ``stage`` of ``stages`` of ``model`` in place; return the names of
        the activations each stage sends on and this stage's parameters tied to another stage's."""
        raise NotImplementedError

    def output_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the model's ``output`` (the last pipeline stage's) against ``targets``."""
        raise NotImplementedError

    def eval_batches(self) -> list:
        """The evaluation batches ``(inputs, targets)`` :meth:`evaluate` reads (a pipeline passes
        them through its stages)."""
        raise NotImplementedError


class GPTWorkload(Workload):
    model_preset = staticmethod(gpt_preset)
    model_words = "a byte-level GPT"

    def __init__(self, config: WorkloadConfig) -> None:
        super().__init__(config)
        self.model_config = self.model_preset(config.preset)
        self.model_config.qk_norm = config.qk_norm
        self.model_config.z_loss = config.z_loss
        self.model_config.precision = config.precision
        self.corpus = ByteCorpus.load(config.corpus, max_bytes=config.max_corpus_bytes)
        bs = self.model_config.block_size
        if len(self.corpus.val) < bs + 2 or len(self.corpus.train) < bs + 2:
            raise ValueError(f"corpus {self.corpus.source!r} is too small for block_size={bs}")
        self._val = self.corpus.val_batches(config.eval_batches, config.batch_size, bs)

    def build_model(self) -> nn.Module:
        return GPT(self.model_config)

    def batch(self, seed, step, micro_batch=0):
        return self.corpus.batch(seed, step, micro_batch, self.config.batch_size, self.model_config.block_size)

    def loss(self, model, batch):
        x, y = batch
        return lm_loss(model(x), y, self.model_config.z_loss)

    @torch.no_grad()
    def evaluate(self, model):
        losses = [lm_loss(model(x), y).item() for x, y in self._val]
        return {"val_loss": sum(losses) / len(losses)}

    def parallelize_plan(self) -> ParallelizePlan:
        return ParallelizePlan(blocks="blocks", tensor_parallel=TP_PLAN)

    def check_pipeline(self, kind: str, stages: int) -> None:
        self.check_parallel(kind, 1)
        if self.model_config.n_layer < stages:
            raise ValueError(
                f"--parallel {kind}: {stages} pipeline stages need at least {stages} blocks; the "
                f"{self.config.preset} GPT has n_layer={self.model_config.n_layer} (use --nproc "
                f"{self.model_config.n_layer} or fewer stages, or a larger preset)"
            )

    def split_stage(self, model, stage, stages):
        return split_stage(model, stage, stages)

    def output_loss(self, output, targets):
        return lm_loss(output, targets, self.model_config.z_loss)

    def eval_batches(self):
        return self._val

    def check_parallel(self, kind: str, tp_degree: int, ep_degree: int = 1) -> None:
        super().check_parallel(kind, tp_degree, ep_degree)
        if self.config.precision == "fp8":
            raise ValueError(
                f"--parallel {kind}: FP8 Linears (precision fp8) are not split over ranks (torch._scaled_mm "
                "takes no DTensor shards); train them in one process or with --parallel ddp"
            )
        check_tensor_parallel(self.model_config, tp_degree, f"--parallel {kind}")

    def task(self) -> str:
        size = f"{(len(self.corpus.train) + len(self.corpus.val)) / 1e6:.1f} MB"
        data = (
            f"the source of Python's standard library ({size} of .py files under {self.corpus.source})"
            if self.config.corpus is None
            else f"{size} of text from {self.corpus.source}"
        )
        return f"{self.model_words} ({self.config.preset}: {self._shape()}) learning to predict the next byte of {data}"

    def _shape(self) -> str:
        m = self.model_config
        return f"{m.n_layer} layers, d={m.d_model}, {m.block_size}-byte context"

    def describe(self):
        return {
            "corpus_source": self.corpus.source,
            "corpus_sha256": self.corpus.sha256,
            "train_bytes": len(self.corpus.train),
            "val_bytes": len(self.corpus.val),
            "model": self.model_config.to_dict(),
        }


class MoEWorkload(GPTWorkload):
    """The GPT's data and loss with a mixture-of-experts model (:mod:`sdcscope.workloads.moe`);
    the load-balancing loss trains through the model's backward pass, so ``loss`` is the
    language-model loss. Its plan is expert parallelism (``--parallel ep``, ``fsdp+ep``: the
    experts sharded over ranks, tokens moved by all-to-all), or a whole replica per rank
    (``--parallel ddp``)."""

    model_preset = staticmethod(moe_preset)
    model_words = "a byte-level mixture-of-experts GPT"

    def build_model(self) -> nn.Module:
        return MoEGPT(self.model_config)

    def parallelize_plan(self) -> ParallelizePlan:
        return ParallelizePlan(blocks="blocks", tensor_parallel={}, experts=True)

    def check_parallel(self, kind: str, tp_degree: int, ep_degree: int = 1) -> None:
        if ep_degree == 1:
            raise ValueError(
                f"--parallel {kind}: the moe workload splits its experts only: use --parallel ep or fsdp+ep "
                "(or ddp: a whole replica per rank)"
            )
        n = self.model_config.n_expert
        if n % ep_degree:
            raise ValueError(
                f"--parallel {kind} shards {n} experts over {ep_degree} ranks: n_expert must be a multiple "
                f"of the expert-parallel degree {ep_degree}"
            )

    def _shape(self) -> str:
        m = self.model_config
        return f"{super()._shape()}, {m.n_expert} experts, top-{m.top_k}"


class CNNWorkload(Workload):
    def __init__(self, config: WorkloadConfig) -> None:
        super().__init__(config)
        self.model_config = cnn_preset(config.preset)
        self.x_train, self.y_train, self.x_val, self.y_val = load_digits_tensors()

    def build_model(self) -> nn.Module:
        return LeNet(self.model_config)

    def batch(self, seed, step, micro_batch=0):
        g = step_generator(seed, step, micro_batch)
        idx = torch.randint(0, len(self.x_train), (self.config.batch_size,), generator=g)
        y = self.y_train[idx]
        if self.config.label_noise:  # fresh every step: noise the model cannot learn or memorize
            flip = torch.rand(len(y), generator=g) < self.config.label_noise
            y = torch.where(flip, torch.randint(0, 10, (len(y),), generator=g), y)
        return self.x_train[idx], y

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        logits = model(self.x_val)
        return {
            "val_loss": F.cross_entropy(logits, self.y_val).item(),
            "val_acc": (logits.argmax(-1) == self.y_val).float().mean().item(),
        }

    def task(self) -> str:
        return (
            f"a LeNet-style CNN ({self.config.preset}) learning to classify scikit-learn's 8x8 handwritten digits "
            f"({len(self.x_train)} training images)"
        )

    def describe(self):
        return {
            "dataset": "sklearn digits",
            "train_size": len(self.x_train),
            "val_size": len(self.x_val),
            "model": self.model_config.to_dict(),
        }


def make_workload(config: WorkloadConfig) -> Workload:
    return {"gpt": GPTWorkload, "moe": MoEWorkload, "cnn": CNNWorkload}[config.workload](config)
