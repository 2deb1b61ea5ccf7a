"""One trainer for every distributed world (gloo on CPU, nccl on GPU): the workload's model on each
rank of an initialized process group, laid out by a :class:`~sdcscope.engine.topology.Topology`.

- **World.** The topology wraps the model in DDP (``ddp``) or splits it by the workload's plan
  (FSDP2, tensor parallel); then :func:`~sdcscope.common.world.world_of` describes the world and
  the trainer follows its properties: a data-parallel world runs the DDP wrapper (the all-reduce
  through the bucket hook, open to fault injection, signatures and rank exclusion) and can replay
  any rank's local gradient (:meth:`DistTrainer.local_gradients`); a sharded world reduces inside
  FSDP2 and TP, and clips by the global norm (:meth:`~sdcscope.common.world.World.global_sq_norm`).
- **Shards.** Data-parallel coordinate d trains micro-batch ``shard(d, grad_accum, m)`` of each
  step (:func:`~sdcscope.engine.dist.shard`); the ranks of one tensor-parallel group share it.
  One data-parallel rank reproduces the single-process :class:`Trainer`.
- **Faults.** Each rank arms the fault specs bound to it: site ``comm`` through the bucket hook
  (a data-parallel world only), ``comm.all_gather`` / ``comm.reduce_scatter`` on FSDP2's units
  (:mod:`sdcscope.inject.collectives`), every other site through an :class:`Injector`.

``self.model`` is the plain (or split) module: FSDP2 and TP keep its names, so snapshots and
hashes name parameters as in one process. The run bound to a run directory is
:class:`~sdcscope.engine.distrun.DistRun`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.common.alltoall import is_expert
from sdcscope.common.world import local, world_of
from sdcscope.engine.buckets import BucketHook, bucket_hook
from sdcscope.engine.dist import DistConfig, device_for, shard
from sdcscope.engine.pipeline import Pipeline
from sdcscope.engine.topology import Topology
from sdcscope.engine.trainer import StepContext, TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, reexecution
from sdcscope.inject.alltoall import AllToAllInjector
from sdcscope.inject.collectives import CollectiveInjector, is_collective
from sdcscope.inject.comm import CommInjector
from sdcscope.inject.p2p import SITE as P2P_SITE
from sdcscope.inject.p2p import P2PInjector, check_p2p_spec
from sdcscope.workloads import Workload

NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else {"broadcast_buffers": False}
)
"""The workloads' buffers (masks, constants) are alike on every rank: no broadcast before each forward."""


class DistTrainer(Trainer):
    """:class:`Trainer` on every rank of an initialized world, laid out by ``topology`` (default:
    DDP). ``specs`` are this world's fault specs: each rank arms those bound to it."""

    def __init__(
        self,
        workload: Workload,
        config: TrainConfig | None = None,
        callbacks: Iterable[object] = (),
        *,
        topology: Topology | None = None,
        dist_config: DistConfig | None = None,
        specs: Sequence[FaultSpec] = (),
        injection_log: Callable[[dict], None] | None = None,
    ) -> None:
        self.topology = topology or Topology()
        size = dist.get_world_size()
        self.topology.check(size, workload)
        self.topology.check_micro_batches(size, (config or TrainConfig()).grad_accum)
        if config is not None and config.compile:
            raise ValueError(
                "compile=True (--compile) runs in one process; a distributed topology trains eagerly "
                "(its guard's hooks and collectives are not traced yet)"
            )
        super().__init__(workload, config, callbacks)
        self.dist_config = dist_config or DistConfig()
        self.device = device_for(self.dist_config)
        self.model.to(self.device)
        self.mesh = self.topology.build_mesh(size, self.device.type)
        ddp = None
        self.pipeline: Pipeline | None = None
        """A pipeline world's stage and schedule (:mod:`sdcscope.engine.pipeline`)."""
        if self.topology.pipeline:
            self.pipeline = Pipeline(self, self.topology, self.mesh)
            self.optimizer = workload.build_optimizer(self.model)  # over this stage's parameters
        elif self.topology.sharded:
            self.topology.apply(self.model, self.mesh, workload)
            self.optimizer = workload.build_optimizer(self.model)  # over the split parameters
            if self.topology.mixes_plain_parameters:
                for group in self.optimizer.param_groups:
                    group["foreach"] = False
        else:
            ddp = DDP(self.model, bucket_cap_mb=self.dist_config.bucket_cap_mb, **NO_BUFFER_SYNC)
        self.world = world_of(self.model, ddp)
        self.dp_rank, self.dp_size = self.topology.dp_coordinate(self.mesh, self.world.rank, size)
        self.hook: BucketHook | None = bucket_hook(ddp) if self.world.data_parallel else None
        """The DDP gradient-bucket hook of a data-parallel world (None in a sharded one)."""
        self.injector: Injector | None = None
        self.comm_injector: CommInjector | None = None
        self.collective_injector: CollectiveInjector | None = None
        self.all_to_all_injector: AllToAllInjector | None = None
        self.p2p_injector: P2PInjector | None = None
        self._attach_faults(list(specs), injection_log)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def ddp(self) -> DDP | None:
        """The DDP wrapper of a data-parallel world (None in a sharded one)."""
        return self.world.ddp

    @property
    def excluded(self) -> frozenset[int]:
        """The ranks left out of the gradient average (quarantined); none in a sharded world."""
        return frozenset() if self.hook is None else self.hook.excluded

    def _attach_faults(self, specs: list[FaultSpec], log: Callable[[dict], None] | None) -> None:
        comm = [(i, s) for i, s in enumerate(specs) if s.site == "comm"]
        a2a = [(i, s) for i, s in enumerate(specs) if s.site == "comm.all_to_all"]
        p2p = [(i, s) for i, s in enumerate(specs) if s.site == P2P_SITE]
        coll = [(i, s) for i, s in enumerate(specs) if is_collective(s) and s.site not in ("comm.all_to_all", P2P_SITE)]
        other = [(i, s) for i, s in enumerate(specs) if s.site != "comm" and not is_collective(s)]
        if self.world.expert_parallel or self.pipeline is not None:  # only faults that land on what this
            other = [(i, s) for i, s in other if _may_land(s, self.model, self.rank)]  # rank holds are armed
        if comm and (why := self.world.unsupported("fault.comm")):
            raise ValueError(f"faults of site 'comm' under --parallel {self.topology.kind}: {why}")
        if a2a and (why := self.world.unsupported("fault.all_to_all")):
            raise ValueError(f"faults of site 'comm.all_to_all' under --parallel {self.topology.kind}: {why}")
        if a2a:
            self.all_to_all_injector = AllToAllInjector(
                self.model, [s for _, s in a2a], rank=self.rank, log=log, spec_ids=[i for i, _ in a2a]
            )
            self.callbacks.insert(0, self.all_to_all_injector.callback())
        for _, spec in coll:
            why = self.world.unsupported("fault.collectives")
            if why is None and spec.site.split(".")[1] not in self.world.collectives:
                why = f"this world runs {', '.join(self.world.collectives) or 'no collective'}, no FSDP2 unit"
            if why:
                raise ValueError(f"faults of site {spec.site!r} under --parallel {self.topology.kind}: {why}")
        if p2p and (why := self.world.unsupported("fault.p2p")):
            raise ValueError(f"faults of site {P2P_SITE!r} under --parallel {self.topology.kind}: {why}")
        if p2p:
            boundary, info = self.pipeline.boundary, self.pipeline.info
            for i, spec in p2p:
                try:
                    check_p2p_spec(spec, info.boundaries, info.stages, info.dp)
                except ValueError as exc:
                    raise ValueError(f"fault spec #{i} ({spec.site}): {exc}") from None
            self.p2p_injector = P2PInjector(
                boundary, [s for _, s in p2p], rank=self.rank, log=log, spec_ids=[i for i, _ in p2p]
            )
            self.callbacks.insert(0, self.p2p_injector.callback())
        if coll:
            self.collective_injector = CollectiveInjector(
                self.model,
                [s for _, s in coll],
                rank=self.rank,
                world_size=self.world.size,
                log=log,
                spec_ids=[i for i, _ in coll],
            )
            self.callbacks.insert(0, self.collective_injector.callback())
        if comm:
            self.comm_injector = CommInjector(
                self.model,
                [s for _, s in comm],
                rank=self.rank,
                world_size=self.world.size,
                log=log,
                spec_ids=[i for i, _ in comm],
            )
            self.hook.add(self.comm_injector, first=True)
            self.callbacks.insert(0, self.comm_injector.callback())
        if other:
            ids = [i for i, _ in other]
            sink = None if log is None else (lambda rec: log({**rec, "spec": ids[rec["spec"]]}))
            self.injector = Injector(
                self.model, [s for _, s in other], self.optimizer, rank=self.rank, world_size=self.world.size, log=sink
            ).attach()
            self.callbacks.insert(0, self.injector.callback())
            if self.pipeline is not None:  # the schedule interleaves micro-batches: follow the stage's
                self.pipeline.boundary.on_micro_batch.append(self.injector.at_micro_batch)

    def batch_for(self, data_pos: int, micro_batch: int, rank: int | None = None):
        """Micro-batch ``micro_batch`` of data-parallel coordinate ``rank``'s shard (default: this
        rank's), on this rank's device."""
        dp = self.dp_rank if rank is None else rank
        batch = self.workload.batch(self.config.seed, data_pos, shard(dp, self.config.grad_accum, micro_batch))
        return tuple(t.to(self.device) for t in batch)

    def forward_backward(self, ctx: StepContext) -> torch.Tensor:
        """A pipeline world runs the step's micro-batches through its schedule; others, one by one."""
        if self.pipeline is not None:
            return self.pipeline.forward_backward(ctx)
        return super().forward_backward(ctx)

    @contextlib.contextmanager
    def micro_step(self, micro_batch: int, accum: int) -> Iterator[nn.Module]:
        """A data-parallel world runs the DDP wrapper, its all-reduce on the last micro-batch only; a
        sharded world runs the split model (FSDP2 and TP reduce inside)."""
        if not self.world.data_parallel:
            yield self.model
            if self.world.expert_parallel and micro_batch + 1 == accum:
                self._average_experts()
            return
        with self.world.ddp.no_sync() if micro_batch + 1 < accum else contextlib.nullcontext():
            yield self.world.ddp

    @torch.no_grad()
    def _average_experts(self) -> None:
        """Expert parallel, after the last micro-batch's backward: each expert's gradient -- the
        sum over the tokens of every expert-parallel rank of their ranks' mean losses -- becomes
        the gradient of the world-mean loss, as DDP's. Under ``ep`` the parameters every rank
        holds whole (attention, router, embeddings) get the world mean of their gradients (one
        all-reduce of a flat buffer) and the experts' are divided by the world size; under
        ``fsdp+ep`` FSDP2 has averaged both over its mesh, and the experts' are divided by the
        expert-parallel degree."""
        grads = [(is_expert(p), local(p.grad)) for p in self.model.parameters() if p.grad is not None]
        whole = [g for e, g in grads if not e]
        if self.topology.kind == "ep" and whole:
            flat = torch.cat([g.reshape(-1) for g in whole])
            dist.all_reduce(flat)
            flat.div_(self.world.size)
            torch._foreach_copy_(whole, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in whole]), whole)])
        experts = [g for e, g in grads if e]
        if experts:
            torch._foreach_div_(experts, self.world.size if self.topology.kind == "ep" else self.world.degrees["ep"])

    def local_gradients(self, rank: int, step: int, data_pos: int) -> torch.Tensor:
        """Recompute rank ``rank``'s local (pre-reduction) gradient of ``step`` into ``.grad`` and
        return its mean loss; a data-parallel world only (a sharded step is a collective).

        Runs on the plain module (no all-reduce, no callbacks), so any rank can replay any rank's
        shard. It is a re-execution (:func:`sdcscope.inject.reexecution`): only permanent faults
        act again, as a unit that stays broken would.
        """
        assert self.world.data_parallel, self.world.kind
        accum = self.config.grad_accum
        for p in self.model.parameters():
            p.grad = None
        total = torch.zeros((), device=self.device)
        with reexecution():
            for m in range(accum):
                if self.injector is not None:
                    self.injector.set_position(step, m)
                loss = self.workload.loss(self.model, self.batch_for(data_pos, m, rank))
                (loss / accum).backward()
                total = total + loss.detach()
        return total / accum

    def clip_gradients(self, params: list[nn.Parameter], clip: float, ctx: StepContext) -> torch.Tensor:
        """Clip to the global norm ``clip``; return that norm. Where every rank holds the whole
        reduced gradient, as one process does; in a sharded world by the norm over every shard
        (:meth:`~sdcscope.common.world.World.global_sq_norm`: the same bits on every rank), each
        rank scaling its local shards alike."""
        if not self.world.split:
            return super().clip_gradients(params, clip, ctx)
        grads = [local(p.grad) for p in params]
        sq = torch.stack([n.double().cpu() for n in torch._foreach_norm(grads)]).square() if grads else None
        norm = math.sqrt(self.world.global_sq_norm(sq, params, range(len(params))))
        if clip > 0 and math.isfinite(norm):
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        return torch.tensor(norm)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """As :meth:`Trainer.evaluate`. In a sharded world a collective (every rank evaluates:
        FSDP2 gathers the weights, TP reduces the outputs); elsewhere rank 0 alone calls it, and a
        GPU model is evaluated as a CPU copy (the workloads keep their evaluation data there)."""
        if self.pipeline is not None:
            self._emit("before_evaluate", self)
            result = {**self.pipeline.evaluate(), "step": self.step}
            self._emit("on_evaluate", result)
            return result
        if self.world.sharded or self.device.type == "cpu":
            return super().evaluate()
        model, self.model = self.model, copy.deepcopy(self.model).cpu()
        try:
            return super().evaluate()
        finally:
            self.model = model

    def close(self) -> None:
        injectors = (self.injector, self.comm_injector, self.collective_injector)
        for inj in injectors + (self.all_to_all_injector, self.p2p_injector):
            if inj is not None:
                inj.close()


def _may_land(spec: FaultSpec, model: nn.Module, rank: int) -> bool:
    """Whether ``spec`` may fire on ``rank`` of an expert-parallel or pipeline world: bound to it (or
    to no rank) and matching a module or parameter this rank holds (an expert or a stage's layers
    live on one rank)."""
    if spec.rank is not None and spec.rank != rank:
        return False
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return any(spec.matches(n) for n in names)


__all__ = ["NO_BUFFER_SYNC", "DistTrainer"]
