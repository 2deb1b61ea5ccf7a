"""Pipeline parallelism: one stage of the workload's model per rank, run by
``torch.distributed.pipelining`` (``ScheduleGPipe`` or ``Schedule1F1B`` over the step's
micro-batches), optionally each stage sharded by FSDP2 over its data-parallel ranks.

- **Stages.** Every rank builds the whole model from the seed, then keeps its stage
  (:meth:`Workload.split_stage <sdcscope.workloads.Workload.split_stage>`: contiguous blocks, the
  first stage the embeddings, the last the head), under the whole model's names, so events,
  snapshots and hashes name parameters as one process does. Ranks are stage-major: rank
  ``stage · dp + d``.
- **A step.** The step's ``grad_accum`` micro-batches are concatenated and the schedule splits them
  again; the last stage computes each micro-batch's loss (its data loader gives it the targets:
  nothing is broadcast) and every stage accumulates its gradients. A head tied to the embedding
  lives on the first and the last stage: their gradients are summed over the two (one
  all-reduce, as Megatron does), so the copies stay equal. A replay runs the whole schedule again
  on every rank.
- **Boundary.** The schedule runs the stage module inside a
  :class:`~sdcscope.common.pipeline.StageBoundary`, where the p2p check and the ``comm.p2p``
  fault site tap each transfer; the injector follows the micro-batch the stage works on.
- **Evaluation.** The stages pass each evaluation batch on with plain send/recv; the last stage's
  mean loss is shared with every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from sdcscope.common.pipeline import StageBoundary, StageInfo
from sdcscope.common.world import local


class Pipeline:
    """This rank's stage of ``trainer``'s model and the schedule that runs it (see the module
    docstring); built by :class:`~sdcscope.engine.distributed.DistTrainer` for ``--parallel pp``
    and ``fsdp+pp``."""

    def __init__(self, trainer: Any, topology: Any, mesh: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.trainer = trainer
        workload, model = trainer.workload, trainer.model
        size, rank = dist.get_world_size(), dist.get_rank()
        degrees = topology.degrees(size)
        stages, dp = degrees["pp"], degrees.get("dp", 1)
        stage, dp_rank = divmod(rank, dp)
        example = trainer.workload.batch(trainer.config.seed, 0, 0)[0]
        shapes, ties = stage_shapes(workload, model, stages, example)  # before the split: every stage's
        boundaries, tied = workload.split_stage(model, stage, stages)
        fsdp = "dp" in degrees
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            blocks = model.get_submodule(workload.parallelize_plan().blocks)
            for block in blocks.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        accum = trainer.config.grad_accum
        self.info = StageInfo(
            stage,
            stages,
            dp,
            dp_rank,
            topology.schedule,
            accum,
            workload.config.batch_size,
            boundaries,
            tied=tuple(id(p) for p in model.parameters() if any(p is t for t in tied)),
            ties=ties,
            fsdp=fsdp,
        )
        self.boundary = StageBoundary(model, self.info)
        group = mesh["pp"].get_group() if fsdp else mesh.get_group()
        args, out = shapes[stage]
        self.stage = PipelineStage(
            self.boundary, stage, stages, trainer.device, input_args=args, output_args=out, group=group
        )
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[topology.schedule]
        # each micro-batch's loss divided by their number, as one process accumulates them (the
        # schedule's own scaling of the summed gradients is off: FSDP2 reduces them unscaled)
        loss_fn = lambda out, y: workload.output_loss(out, y) / accum  # noqa: E731
        self.schedule = schedule(self.stage, accum, loss_fn=loss_fn, scale_grads=False)
        self.tied_group = None
        if ties:
            for d in range(dp):  # every rank creates every group
                g = dist.new_group([self.info.rank_of(0, d), self.info.rank_of(stages - 1, d)])
                if d == dp_rank and (self.info.first or self.info.last):
                    self.tied_group = g

    def forward_backward(self, ctx: Any) -> torch.Tensor:
        """The step's micro-batches through the schedule on this stage; the mean loss on the last
        stage (0 on the others: the world's loss is the last stage's, see ``World.loss_ranks``)."""
        trainer = self.trainer
        accum = trainer.config.grad_accum
        trainer.optimizer.zero_grad(set_to_none=True)
        batches = [trainer.batch_for(ctx.data_pos, m) for m in range(accum)]
        ctx.micro_batch, ctx.batch = accum - 1, batches[-1]
        x, y = (torch.cat([b[i] for b in batches]) for i in (0, 1))
        self.boundary.begin()
        losses: list[torch.Tensor] = []
        info = self.info
        args = (x,) if info.first else ()
        kwargs = {"target": y, "losses": losses} if info.last else {}
        self.schedule.step(*args, **kwargs)
        if self.tied_group is not None:
            for p in trainer.model.parameters():
                if id(p) in info.tied and p.grad is not None:
                    dist.all_reduce(local(p.grad), group=self.tied_group)
        loss = torch.stack([v.detach() for v in losses]).sum() if losses else torch.zeros((), device=trainer.device)
        ctx.loss = loss
        trainer._emit("after_backward", ctx)
        return loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The workload's evaluation loss through every stage (a collective of every rank)."""
        trainer, info = self.trainer, self.info
        model, workload = trainer.model, trainer.workload
        model.eval()
        try:
            total, n = 0.0, 0
            prev = info.rank_of(info.stage - 1) if not info.first else None
            nxt = info.rank_of(info.stage + 1) if not info.last else None
            for x, y in workload.eval_batches():
                x, y = x.to(trainer.device), y.to(trainer.device)
                if prev is not None:
                    shape = torch.zeros(3, dtype=torch.int64)
                    dist.recv(shape, prev)
                    x = torch.empty(*shape.tolist(), device=trainer.device)
                    dist.recv(x, prev)
                out = model(x)
                if nxt is not None:
                    dist.send(torch.tensor(out.shape, dtype=torch.int64), nxt)
                    dist.send(out.contiguous(), nxt)
                else:
                    total += float(workload.output_loss(out, y))
                    n += 1
        finally:
            model.train()
        mine = torch.tensor([total / n if n else math.nan], dtype=torch.float64)
        rows = trainer.world.gather(mine)
        values = [float(rows[r]) for r in trainer.world.loss_ranks]
        return {"val_loss": math.fsum(values) / len(values)}


def stage_shapes(workload: Any, model: torch.nn.Module, stages: int, example: torch.Tensor) -> tuple[list[tuple], bool]:
    """Each stage's example input and output (meta tensors) for one micro-batch shaped like
    ``example`` -- the whole ``model`` copied to the meta device, split and run stage by stage --
    and whether some stages hold tied parameters. Given to ``PipelineStage``, the shapes spare it
    the run-time shape inference (an extra forward pass the injector and the checks would meet)."""
    import copy

    x = example.to("meta")
    out, ties = [], False
    for s in range(stages):
        part = copy.deepcopy(model).to("meta")
        _, tied = workload.split_stage(part, s, stages)
        ties |= bool(tied)
        y = part(x)  # with autograd: the stage learns which outputs carry gradients back
        out.append((x, y.detach().requires_grad_(y.requires_grad)))
        x = out[-1][1]
    return out, ties


__all__ = ["Pipeline", "stage_shapes"]
