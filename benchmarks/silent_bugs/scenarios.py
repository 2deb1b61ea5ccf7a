"""Small, realistic training scripts, each with silent bugs that a flag switches on.

Every script is the clean twin of its bugs: with ``bug=None`` it is a correct training loop,
and each bug changes one or two lines, as the real mistake would.  Scripts take an ``attach``
function that wraps the model and optimizer with a tool (a ``TraceRecorder`` for references,
an ``InvariantChecker`` for checked runs; both share ``step_begin``/``step_end``/
``log_metrics``/``detach``) and return that tool when training ends.

Families (the reference training scripts):

- ``gpt_loop``: a plain PyTorch loop on the tiny byte GPT with dropout, AdamW, a warm-up +
  cosine ``LambdaLR``, gradient clipping and periodic evaluation;
- ``gpt_amp``: the same model with a ``GradScaler`` loop (fp32 compute on CPU, where fp16
  autocast is impractically slow; the scaler's logic is the same);
- ``cnn_epochs``: the digits CNN trained in epochs, reshuffling the data every epoch;
- ``engine``: sdcscope's own ``Trainer``, the recorder attached as an engine callback;
- ``replicas``: two data-parallel replicas of the GPT in one process, gradients averaged
  (all-reduce) every step, as DDP does;
- ``gpt_groups``: a nanoGPT-style loop: AdamW with a decay and a no-decay param group,
  optional gradient accumulation, and settings that a correct loop may choose differently
  (where and how gradients are cleared, how backward, clipping, the step and the loss are
  called).

The last ten bugs and three clean variants were written after the invariants that the first
ones exercise, as bugs the mechanism had not seen; two of them (a detached residual stream, an
attention mask of ones) look normal in a short run's trace: the mask of ones is caught by the
``Causal`` relation's probe of the model, the detached residual stream by ``GradShare`` (its
forward is unchanged; only how its gradient is spread over the layers differs).

Clean variants (``VARIANTS``) are correct loops that differ from their family's references in
such a setting; checked against the references' invariants, they must raise nothing.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # bound before any tool attaches

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.workloads import GPT, GPTConfig, LeNet, WorkloadConfig, lm_loss, make_workload
from sdcscope.workloads.base import GPTWorkload
from sdcscope.workloads.cnn import cnn_preset
from sdcscope.workloads.data import load_digits_tensors

Attach = Callable[..., Any]


@functools.lru_cache(maxsize=1)
def _gpt_data() -> GPTWorkload:
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny"))


@functools.lru_cache(maxsize=1)
def _val_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _gpt_data().corpus.val_batches(2, 16, 64)


@functools.lru_cache(maxsize=1)
def _digits():
    return load_digits_tensors()


def _batch(data: GPTWorkload, seed: int, step: int, micro_batch: int = 0, batch: int | None = None):
    """The workload's batch for (seed, step, micro_batch), with ``batch`` sequences when given."""
    size = data.config.batch_size if batch is None else batch  # GPTWorkload.batch, with another size
    return data.corpus.batch(seed, step, micro_batch, size, data.model_config.block_size)


def _warm_cosine(warm: int, steps: int) -> Callable[[int], float]:
    """A linear warm-up over ``warm`` steps (none for 0) times a cosine over the run."""

    return lambda s: (min(1.0, (s + 1) / warm) if warm else 1.0) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))


def _gpt(dropout: float = 0.0) -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=64, dropout=dropout))


def gpt_loop(
    seed: int,
    bug: str | None,
    attach: Attach,
    *,
    lr: float = 3e-3,
    steps: int = 24,
    eval_every: int = 8,
    warm: int = 5,
    batch: int | None = None,
):
    torch.manual_seed(seed)
    data = _gpt_data()
    model = _gpt(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warm_cosine(warm, steps))
    tool = attach(model, opt, schedulers=[sched])
    clipped = model.blocks.parameters if bug == "clip_wrong_params" else model.parameters
    for step in range(steps):
        tool.step_begin(step)
        x, y = _batch(data, seed, step, batch=batch)
        if bug not in ("missing_zero_grad", "zero_grad_after_backward"):
            opt.zero_grad()
        logits = model(x)
        if bug == "softmax_before_loss":  # probabilities given to a loss that expects logits
            logits = logits.softmax(-1)
        reduction = "sum" if bug == "wrong_loss_reduction" else "mean"
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction=reduction)
        if bug == "step_before_backward":
            opt.step()
        loss.backward()
        if bug == "zero_grad_after_backward":
            opt.zero_grad()
        if bug != "clip_after_step":
            torch.nn.utils.clip_grad_norm_(clipped(), 1.0)
        if bug != "step_before_backward":
            opt.step()
        if bug == "clip_after_step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if bug != "lr_schedule_not_stepped":
            sched.step()
        tool.step_end()
        if (step + 1) % eval_every == 0:
            if bug != "dropout_at_eval":
                model.eval()
            with torch.no_grad():
                val = [lm_loss(model(vx), vy).item() for vx, vy in _val_batches()]
            tool.log_metrics(val_loss=sum(val) / len(val))
            if bug != "eval_mode_left_on":
                model.train()
    tool.detach()
    return tool


def gpt_amp(seed: int, bug: str | None, attach: Attach, *, lr: float = 3e-3, steps: int = 16, batch: int | None = None):
    torch.manual_seed(seed)
    data = _gpt_data()
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    tool = attach(model, opt, scaler=scaler)
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        x, y = _batch(data, seed, step, batch=batch)
        loss = lm_loss(model(x), y)
        if bug == "scaler_skipped":  # the scaler is created but bypassed
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        tool.step_end()
    tool.detach()
    return tool


def cnn_epochs(seed: int, bug: str | None, attach: Attach, *, lr: float = 3e-3, steps: int = 26, batch: int = 128):
    x_train, y_train, _, _ = _digits()
    torch.manual_seed(seed)
    model = LeNet(cnn_preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tool = attach(model, opt)
    per_epoch = len(x_train) // batch
    g = torch.Generator().manual_seed(seed)
    step = 0
    for _epoch in range(math.ceil(steps / per_epoch)):
        if bug == "same_shuffle_every_epoch":  # generator re-seeded inside the epoch loop
            g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(x_train), generator=g)
        if bug == "labels_misaligned":  # inputs and labels shuffled by separate permutations
            label_perm = torch.randperm(len(y_train), generator=g)
        for b in range(per_epoch):
            if step == steps:
                break
            idx = perm[b * batch : (b + 1) * batch]
            labels = y_train[label_perm[b * batch : (b + 1) * batch]] if bug == "labels_misaligned" else y_train[idx]
            tool.step_begin(step)
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), labels).backward()
            opt.step()
            tool.step_end()
            step += 1
    tool.detach()
    return tool


class _FrozenLayerGPT(GPTWorkload):
    """A fine-tuning leftover: the first block is frozen and never unfrozen."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        model.blocks[0].requires_grad_(False)
        return model


class _DecayOnlyGPT(GPTWorkload):
    """Parameter groups built by a filter that silently drops the no-decay group."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.config.weight_decay}],
            lr=self.config.lr,
            betas=(0.9, 0.95),
            foreach=True,
        )


def engine(
    seed: int,
    bug: str | None,
    attach: Attach,
    *,
    lr: float = 3e-3,
    steps: int = 16,
    warm: int = 20,
    batch: int | None = None,
):
    kind = {None: GPTWorkload, "frozen_layer": _FrozenLayerGPT, "param_not_in_optimizer": _DecayOnlyGPT}[bug]
    config = WorkloadConfig(workload="gpt", preset="tiny", lr=lr, warmup=warm, batch_size=batch)
    trainer = Trainer(kind(config), TrainConfig(seed=seed))
    tool = attach(trainer.model, trainer.optimizer)
    trainer.add_callback(tool)
    for _ in range(steps):
        trainer.train_step()
    trainer.evaluate()
    tool.detach()
    return tool


class Replicas(nn.Module):
    """Data-parallel replicas in one process: replica r runs on its own shard of the batch."""

    def __init__(self, model: nn.Module, n: int = 2) -> None:
        super().__init__()
        self.replicas = nn.ModuleList([model] + [copy.deepcopy(model) for _ in range(n - 1)])

    def forward(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        return [r(x) for r, x in zip(self.replicas, shards)]


def replicas(
    seed: int,
    bug: str | None,
    attach: Attach,
    *,
    lr: float = 3e-3,
    steps: int = 16,
    lose_sync_at: int = 6,
    batch: int | None = None,
):
    torch.manual_seed(seed)
    data = _gpt_data()
    model = Replicas(_gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tool = attach(model, opt)
    pairs = list(zip(model.replicas[0].parameters(), model.replicas[1].parameters()))
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        shards = [_batch(data, seed, step, r, batch) for r in range(2)]
        logits = model([x for x, _ in shards])
        sum(lm_loss(out, y) for out, (_, y) in zip(logits, shards)).backward()
        # DDP's all-reduce; the bug: its hooks are lost (the model was moved and moved back).
        if bug != "replica_diverges" or step < lose_sync_at:
            with torch.no_grad():
                for a, b in pairs:
                    mean = (a.grad + b.grad) / 2
                    a.grad.copy_(mean)
                    b.grad.copy_(mean)
        opt.step()
        tool.step_end()
    tool.detach()
    return tool


def _groups(model: nn.Module, lr: float, weight_decay: float, bug: str | None) -> list[dict[str, Any]]:
    """nanoGPT's param groups: matrices decay, vectors (biases, LayerNorm weights) do not."""
    params = list(model.parameters())
    no_decay = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
    if bug == "decay_on_norms":  # a name filter meant to exclude biases and LayerNorms only excludes biases
        named = list(model.named_parameters())
        return [
            {"params": [p for n, p in named if not n.endswith(".bias")], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n.endswith(".bias")], "weight_decay": 0.0},
        ]
    if bug == "group_lr_10x":  # a per-group learning rate meant for another base rate
        no_decay["lr"] = lr * 10
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay}, no_decay]


def gpt_groups(
    seed: int,
    bug: str | None,
    attach: Attach,
    *,
    lr: float = 3e-3,
    steps: int = 24,
    eval_every: int = 8,
    accum: int = 1,
    clear: str = "first",
    backward: str = "tensor",
    clip: str = "module",
    step_style: str = "plain",
    loss_style: str = "functional",
    warm: int = 5,
    batch: int | None = None,
):
    """``accum`` micro-batches per step; ``clear``: where and how the gradients are cleared
    (``first``: optimizer.zero_grad() before the forward, ``after_step``: at the end of the step,
    ``keep_tensors``: zero_grad(set_to_none=False), ``model``: model.zero_grad(), ``by_hand``:
    ``p.grad = None``); ``backward``: ``tensor`` (loss.backward()) or ``autograd``
    (torch.autograd.backward(loss)) or ``once`` (one backward over the summed micro-batch
    losses); ``clip``: ``module`` (torch.nn.utils.clip_grad_norm_) or ``imported`` (a
    clip_grad_norm_ imported before the tool attached); ``step_style``: ``plain`` or ``closure``
    (optimizer.step(closure), the closure clearing, running the micro-batches and clipping);
    ``loss_style``: ``functional`` (lm_loss) or ``module`` (nn.CrossEntropyLoss, evaluation
    under torch.inference_mode)."""
    torch.manual_seed(seed)
    data = _gpt_data()
    model = _gpt(dropout=0.1)
    if bug == "residual_detached":
        for block in model.blocks:
            block.forward = functools.partial(_detached_residual, block)
    elif bug == "no_causal_mask":  # the mask built with torch.ones instead of torch.tril
        for block in model.blocks:
            block.attn.causal_mask.fill_(True)
    wd = 0.1
    opt = torch.optim.AdamW(_groups(model, lr, wd, bug), lr=lr, maximize=bug == "gradient_ascent")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warm_cosine(warm, steps))
    if bug == "scheduler_stale_optimizer":  # the optimizer rebuilt after the scheduler (resume code)
        opt = torch.optim.AdamW(_groups(model, lr, wd, None), lr=lr)
    tool = attach(model, opt, schedulers=[sched])
    clip_grad_norm_ = imported_clip_grad_norm_ if clip == "imported" else torch.nn.utils.clip_grad_norm_
    for step in range(steps):
        tool.step_begin(step)

        def compute():
            """Clear, forward and backward every micro-batch, clip; the loss (a closure's return)."""
            if clear == "first":
                opt.zero_grad()
            elif clear == "keep_tensors":
                opt.zero_grad(set_to_none=False)
            elif clear == "model":
                model.zero_grad()
            elif clear == "by_hand":
                for p in model.parameters():
                    p.grad = None
            total = 0.0
            for micro in range(accum):
                if bug == "zero_grad_in_accum":
                    opt.zero_grad()
                x, y = _batch(data, seed, 0 if bug == "same_batch_every_step" else step, micro, batch)
                if bug == "inputs_targets_swapped":  # the batch unpacked in the wrong order
                    y, x = x, y
                elif bug == "targets_equal_inputs":
                    y = x
                elif bug == "labels_shifted_by_2":  # an off-by-one in slicing the windows
                    x, y = x[:, :-1], y[:, 1:]
                logits = model(x)
                if loss_style == "module":
                    loss = nn.CrossEntropyLoss()(logits.view(-1, logits.size(-1)), y.view(-1))
                else:
                    loss = lm_loss(logits, y)
                if bug != "accum_loss_not_averaged":
                    loss = loss / accum
                total = total + loss.detach() if backward != "once" else total + loss
                if backward == "autograd":
                    torch.autograd.backward(loss)
                elif backward == "tensor":
                    loss.backward()
                if bug == "sched_per_micro":
                    sched.step()
            if backward == "once":  # one backward over the summed micro-batch losses
                total.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            return total

        if step_style == "closure":
            opt.step(compute)
        else:
            compute()
            opt.step()
        if bug == "weight_decay_twice":  # decoupled decay applied by hand as well (ported SGD code)
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
        if bug != "sched_per_micro":
            sched.step()
        if clear == "after_step":
            opt.zero_grad()
        tool.step_end()
        if (step + 1) % eval_every == 0:
            model.eval()
            with torch.inference_mode() if loss_style == "module" else torch.no_grad():
                val = [lm_loss(model(vx), vy).item() for vx, vy in _val_batches()]
            tool.log_metrics(val_loss=sum(val) / len(val))
            model.train()
    tool.detach()
    return tool


def _detached_residual(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Block.forward whose residual stream is detached (a leftover of a memory experiment)."""
    x = x.detach() + block.attn(block.ln1(x))
    return x.detach() + block.mlp(block.ln2(x))


@dataclass(frozen=True)
class Family:
    script: Callable[..., Any]
    references: tuple[dict[str, Any], ...] = ({"seed": 1}, {"seed": 2, "lr": 2e-3})
    checked: dict[str, Any] = field(default_factory=lambda: {"lr": 2.5e-3})
    """References use other seeds *and* other learning rates than the checked runs."""


FAMILIES = {
    "gpt_loop": Family(gpt_loop),
    "gpt_amp": Family(gpt_amp),
    "cnn_epochs": Family(cnn_epochs),
    "engine": Family(engine),
    "replicas": Family(replicas),
    "gpt_groups": Family(gpt_groups),
}


@dataclass(frozen=True)
class Bug:
    name: str
    family: str
    what: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)
    """Settings of the script for the bug and its clean twin, beyond the family's ``checked``."""


BUGS = [
    Bug("missing_zero_grad", "gpt_loop", "optimizer.zero_grad() never called: gradients add up"),
    Bug("zero_grad_after_backward", "gpt_loop", "zero_grad() placed between backward and step"),
    Bug("clip_wrong_params", "gpt_loop", "clipping applied to model.blocks only"),
    Bug("clip_after_step", "gpt_loop", "clip_grad_norm_ called after optimizer.step()"),
    Bug("dropout_at_eval", "gpt_loop", "evaluation without model.eval(): dropout active"),
    Bug("eval_mode_left_on", "gpt_loop", "model.train() forgotten after evaluation"),
    Bug("lr_schedule_not_stepped", "gpt_loop", "scheduler.step() never called"),
    Bug("wrong_loss_reduction", "gpt_loop", "cross-entropy summed instead of averaged"),
    Bug("scaler_skipped", "gpt_amp", "GradScaler created but backward/step bypass it"),
    Bug("same_shuffle_every_epoch", "cnn_epochs", "shuffle generator re-seeded every epoch"),
    Bug("frozen_layer", "engine", "first transformer block left frozen"),
    Bug("param_not_in_optimizer", "engine", "no-decay parameters never given to the optimizer"),
    Bug("replica_diverges", "replicas", "gradient all-reduce lost from step 6: replicas diverge"),
    Bug("weight_decay_twice", "gpt_groups", "weight decay applied by hand after AdamW's own"),
    Bug(
        "scheduler_stale_optimizer",
        "gpt_groups",
        "optimizer rebuilt after the scheduler: the learning rate never follows the schedule",
    ),
    Bug("group_lr_10x", "gpt_groups", "the no-decay group's learning rate set 10x the base rate"),
    Bug(
        "zero_grad_in_accum",
        "gpt_groups",
        "zero_grad() inside the accumulation loop: only the last micro-batch counts",
        config={"accum": 2},
    ),
    Bug("targets_equal_inputs", "gpt_groups", "the targets are the inputs: the model learns to copy"),
    Bug("labels_shifted_by_2", "gpt_groups", "targets two tokens ahead of the inputs instead of one"),
    Bug("gradient_ascent", "gpt_groups", "AdamW(maximize=True): the loss is climbed, not descended"),
    # Written after the invariants above were designed (bugs the mechanism had not seen):
    Bug("softmax_before_loss", "gpt_loop", "cross-entropy given probabilities (softmax applied twice)"),
    Bug("step_before_backward", "gpt_loop", "optimizer.step() called before loss.backward()"),
    Bug("labels_misaligned", "cnn_epochs", "inputs and labels shuffled by separate permutations"),
    Bug("residual_detached", "gpt_groups", "residual stream detached in every block"),
    Bug("no_causal_mask", "gpt_groups", "attention mask all ones: tokens see the future"),
    Bug(
        "accum_loss_not_averaged",
        "gpt_groups",
        "micro-batch losses not divided by the accumulation",
        config={"accum": 4},
    ),
    Bug("sched_per_micro", "gpt_groups", "scheduler stepped once per micro-batch", config={"accum": 2}),
    Bug("decay_on_norms", "gpt_groups", "LayerNorm weights put in the weight-decay group"),
    Bug("same_batch_every_step", "gpt_groups", "the step index is not passed to the data: same batch"),
    Bug("inputs_targets_swapped", "gpt_groups", "the batch unpacked as (targets, inputs)"),
]


@dataclass(frozen=True)
class Variant:
    """A correct loop that differs from its family's references in a setting."""

    name: str
    family: str
    what: str
    config: dict[str, Any] = field(default_factory=dict, hash=False)


VARIANTS = [
    Variant("zero_grad_after_step", "gpt_groups", "gradients cleared at the end of the step", {"clear": "after_step"}),
    Variant(
        "grads_none_by_hand",
        "gpt_groups",
        "p.grad = None for every parameter instead of zero_grad()",
        {"clear": "by_hand"},
    ),
    Variant("zero_grad_keep_tensors", "gpt_groups", "zero_grad(set_to_none=False)", {"clear": "keep_tensors"}),
    Variant("model_zero_grad", "gpt_groups", "model.zero_grad() instead of optimizer.zero_grad()", {"clear": "model"}),
    Variant("autograd_backward", "gpt_groups", "torch.autograd.backward(loss)", {"backward": "autograd"}),
    Variant(
        "imported_clip",
        "gpt_groups",
        "clip_grad_norm_ imported under its own name before attaching",
        {"clip": "imported"},
    ),
    Variant("accum_2", "gpt_groups", "2 micro-batches per step (references: 1)", {"accum": 2}),
    Variant(
        "accum_3_cleared_after_step",
        "gpt_groups",
        "3 micro-batches, gradients cleared after the step",
        {"accum": 3, "clear": "after_step"},
    ),
    Variant(
        "closure_step",
        "gpt_groups",
        "optimizer.step(closure): zero_grad, forward, backward, clip inside",
        {"step_style": "closure"},
    ),
    Variant(
        "accum_one_backward",
        "gpt_groups",
        "2 micro-batch losses summed, one backward per step",
        {"accum": 2, "backward": "once"},
    ),
    Variant(
        "ce_module_inference_mode",
        "gpt_groups",
        "nn.CrossEntropyLoss module, eval under inference_mode",
        {"loss_style": "module"},
    ),
]
