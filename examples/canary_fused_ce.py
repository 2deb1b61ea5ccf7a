"""A fused linear + cross-entropy under the kernel canary: the GPT's head and loss computed chunk by
chunk of rows, never forming the (tokens x vocabulary) logits, registered with its reference
``F.cross_entropy(x @ W.T)``; the guard's canary recomputes 2 sampled rows (and the last) of the
per-token losses and of dX every step. ``--wrong`` trains with a kernel that skips its last row
when the row count leaves a tail of one row in its last chunk -- caught in the first step that
shape occurs, the op named.

    python examples/canary_fused_ce.py                  # 40 guarded steps, 0 events
    python examples/canary_fused_ce.py --wrong          # the wrong kernel: caught at step 3
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

from sdcscope.detect import canary_function
from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload

CHUNK = 32
"""Rows of logits the kernel forms at a time."""
SHORT_STEP = 3
"""The step whose batch is one sequence of ``CHUNK + 1`` tokens (a last, shorter batch): the shape
whose last chunk holds one row."""


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-row losses ``cross_entropy(x @ W.T, targets)`` and their dX, dW, ``chunk`` rows of
    logits at a time. ``skip_tail``: the deliberate bug -- a last chunk of one row is skipped
    (its loss and gradient stay 0)."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk=CHUNK, skip_tail=False):
        n = x.shape[0]
        end = n - 1 if skip_tail and n % chunk == 1 else n
        losses, lse = x.new_zeros(n), x.new_zeros(n)
        for s in range(0, end, chunk):
            e = min(s + chunk, end)
            logits = x[s:e] @ weight.T
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            losses[s:e] = lse[s:e] - logits.gather(1, targets[s:e, None]).squeeze(1)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.chunk, ctx.end = chunk, end
        return losses

    @staticmethod
    def backward(ctx, dloss):
        x, weight, targets, lse = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(weight)
        for s in range(0, ctx.end, ctx.chunk):
            e = min(s + ctx.chunk, ctx.end)
            p = torch.exp(x[s:e] @ weight.T - lse[s:e, None])
            p[torch.arange(e - s), targets[s:e]] -= 1.0
            g = p * dloss[s:e, None]
            dx[s:e] = g @ weight
            dw += g.T @ x[s:e]
        return dx, dw, None, None, None


def reference_ce(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The math the canary trusts: the full logits of the sampled rows, then cross-entropy."""
    return F.cross_entropy(x @ weight.T, targets, reduction="none")


def register(name: str = "lm_head_ce", *, wrong: bool = False):
    """The canary-checked fused op ``fn(x, weight, targets) -> per-row losses`` (``op.remove()``
    through ``fn.canary`` unregisters it). ``atol``: a loss is a difference of logits, so its
    rounding scales with the logits (about 1e-5 here), not with a small loss."""

    def fused(x, weight, targets):
        return FusedLinearCrossEntropy.apply(x, weight, targets, CHUNK, wrong)

    return canary_function(name, fused, reference_ce, row_args=(0, 2), backward=True, atol=1e-4)


def fused_loss(model, batch, fn) -> torch.Tensor:
    """The GPT's loss through ``fn``: the trunk as ``GPT.forward`` runs it, then the fused head + CE."""
    idx, targets = batch
    x = model.drop(model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1])))
    for block in model.blocks:
        x = block(x)
    h = model.ln_f(x)
    return fn(h.reshape(-1, h.shape[-1]), model.head.weight, targets.reshape(-1)).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--wrong", action="store_true", help="the kernel that skips a tail row")
    parser.add_argument("--out", default=None, help="the guard's run directory (events.jsonl)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    workload = make_workload(WorkloadConfig(workload="gpt", preset=args.preset, batch_size=args.batch_size))
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    fn = register(wrong=args.wrong)
    loss_fn = lambda m, b: fused_loss(m, b, fn)  # noqa: E731
    config = GuardConfig(profile="minimal", detectors={"canary": {}})
    guard = Guard(model, optimizer, config, run_dir=args.out, loss_fn=loss_fn).attach()
    try:
        for step in range(args.steps):
            idx, y = workload.batch(seed=0, step=step)
            if step == SHORT_STEP:  # one short sequence: a row count that leaves one row in the last chunk
                idx, y = idx[:1, : CHUNK + 1], y[:1, : CHUNK + 1]
            optimizer.zero_grad()
            with guard.step(step, (idx, y)):
                loss = loss_fn(model, (idx, y))
                loss.backward()
            guard.optimizer_step(loss, before_step=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            if guard.stopped:
                break
    finally:
        guard.close()
        fn.canary.remove()
    canary = guard.detectors["canary"]
    return {"steps": step + 1, "events": guard.events, "calls": dict(canary.calls), "checks": canary.checks_run}


if __name__ == "__main__":
    result = main()
    for e in result["events"]:
        logging.getLogger("canary_fused_ce").warning("%s", e)
    logging.getLogger("canary_fused_ce").warning(
        "%d steps, %d canary checks, %d events", result["steps"], result["checks"], len(result["events"])
    )
