"""The topology of a distributed run, described once: ``--parallel`` and ``--nproc`` as mesh
degrees, the device mesh, the data-parallel coordinate of a rank, and the workload's parallelize
plan applied with PyTorch's own engines.

- ``ddp``: a whole replica per rank, no mesh (:class:`~sdcscope.engine.distributed.DistTrainer`
  wraps the model in DDP);
- ``fsdp``: one mesh dim of N ranks (``dp``): FSDP2 shards every block, then the root;
- ``tp``: one dim of N ranks (``tp``): the workload's tensor-parallel plan in every block;
- ``fsdp+tp`` and ``hsdp``: a 2-D mesh of ``(N / inner, inner)`` ranks, ``dp``×``tp`` (TP first,
  then FSDP2 over ``dp``) or ``replicate``×``shard`` (FSDP2 over the whole mesh);
- ``ep``: one dim of N ranks (``ep``): the MoE workload's experts sharded ``E / N`` per rank,
  tokens moved by all-to-all (:func:`~sdcscope.workloads.moe.shard_experts`), the rest a whole
  replica per rank whose gradients the trainer averages;
- ``fsdp+ep``: a 2-D mesh ``dp``×``ep`` of ``(N / inner, inner)`` ranks: the experts sharded
  over ``ep``, then FSDP2 over the whole mesh for the rest (attention, router, embeddings) and
  over ``dp`` for each rank's experts.
- ``pp``: N pipeline stages (``pp``), each rank one stage of the workload's blocks, run by
  ``torch.distributed.pipelining`` (:mod:`sdcscope.engine.pipeline`); ``fsdp+pp``: ``pp``×``dp``,
  ``(N / inner, inner)`` ranks, each stage sharded by FSDP2 over its ``dp`` ranks.

Ranks of one tensor-parallel group train the same micro-batch, each data-parallel coordinate its
own (:meth:`Topology.dp_coordinate`), so one data-parallel rank reproduces the single-process
run's data order. What a trainer may do in the world this builds (a DDP wrapper, a rank replay,
a global norm) follows from the :class:`~sdcscope.common.world.World` of the wrapped model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from sdcscope.common.validate import check_choice, check_positive
from sdcscope.workloads import Workload

PARALLEL = ("ddp", "fsdp", "tp", "fsdp+tp", "hsdp", "ep", "fsdp+ep", "pp", "fsdp+pp")
"""``--parallel`` choices: ``ddp`` keeps the model whole on every rank; the others split it."""
MESH_DIMS = {
    "ddp": ("dp",),
    "fsdp": ("dp",),
    "tp": ("tp",),
    "fsdp+tp": ("dp", "tp"),
    "hsdp": ("replicate", "shard"),
    "ep": ("ep",),
    "fsdp+ep": ("dp", "ep"),
    "pp": ("pp",),
    "fsdp+pp": ("pp", "dp"),
}
"""The mesh dim names of each kind: one dim of every rank, or ``(N / inner, inner)``."""
SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules (``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B``)."""


@dataclass(kw_only=True)
class Topology:
    """How a run is laid over its ranks (``--parallel``); validated before any rank starts."""

    kind: str = "ddp"
    """One of :data:`PARALLEL`."""
    inner: int = 2
    """``fsdp+tp``: the tensor-parallel degree; ``hsdp``: the ranks that shard one replica;
    ``fsdp+ep``: the expert-parallel degree; ``fsdp+pp``: the ranks that shard one pipeline stage."""
    schedule: str = "1f1b"
    """``pp``, ``fsdp+pp``: the pipeline schedule, ``gpipe`` or ``1f1b`` (micro-batches:
    the training's ``grad_accum``)."""

    def __post_init__(self) -> None:
        check_choice("parallel", self.kind, PARALLEL)
        check_positive("parallel inner", self.inner)
        check_choice("pipeline schedule", self.schedule, SCHEDULES)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def sharded(self) -> bool:
        """The model is split over ranks (DTensor parameters), not replicated whole."""
        return self.kind != "ddp"

    @property
    def pipeline(self) -> bool:
        """The model is split into stages (``pp``, ``fsdp+pp``)."""
        return "pp" in MESH_DIMS[self.kind]

    @property
    def world_kind(self) -> str:
        """The :data:`~sdcscope.common.world.KINDS` entry of the world this topology builds."""
        return (
            "pipeline" if self.pipeline else "expert" if self.expert_parallel else "sharded" if self.sharded else "ddp"
        )

    @property
    def expert_parallel(self) -> bool:
        """The experts are sharded over an ``ep`` mesh dim."""
        return "ep" in MESH_DIMS[self.kind]

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives a training step of this topology runs (the fault sites and checks of
        :data:`~sdcscope.faults.vocab.COLLECTIVE_SITES` need theirs): DDP's gradient all-reduce,
        FSDP2's parameter all-gather and gradient reduce-scatter, tensor parallelism's reductions."""
        out = ("p2p", "all_reduce") if self.pipeline else ()  # a tied head's gradients are summed over stages
        out += ("all_reduce",) if self.kind in ("ddp", "tp", "fsdp+tp", "hsdp", "ep", "fsdp+ep") else ()
        out += ("all_to_all",) if self.expert_parallel else ()
        fsdp = ("fsdp", "fsdp+tp", "hsdp", "fsdp+ep", "fsdp+pp")
        return out + (("all_gather", "reduce_scatter") if self.kind in fsdp else ())

    @property
    def mixes_plain_parameters(self) -> bool:
        """Tensor parallelism alone leaves some parameters plain (embeddings, norms) beside DTensor
        ones, and ``fsdp+ep`` shards experts and the rest on different meshes: the optimizer
        cannot step them in one fused (``foreach``) call."""
        return self.kind in ("tp", "fsdp+ep")

    def degrees(self, size: int) -> dict[str, int]:
        """Mesh dim name -> size over ``size`` ranks."""
        dims = MESH_DIMS[self.kind]
        if len(dims) == 1:
            return {dims[0]: size}
        return {dims[0]: size // self.inner, dims[1]: self.inner}

    def tp_degree(self, size: int) -> int:
        return self.degrees(size).get("tp", 1)

    def ep_degree(self, size: int) -> int:
        return self.degrees(size).get("ep", 1)

    def check(self, size: int, workload: Workload | None = None) -> None:
        """Refuse (ValueError, naming the values and the allowed ones) a topology that does not fit
        ``size`` ranks or, when given, the ``workload``'s model (its plan, its shapes)."""
        if self.kind == "pp" and size < 2:
            raise ValueError(f"--parallel pp needs --nproc 2 or more (one pipeline stage per rank), got --nproc {size}")
        if len(MESH_DIMS[self.kind]) == 2 and (size % self.inner or size // self.inner < 2):
            raise ValueError(
                f"--parallel {self.kind} needs --nproc a multiple of {self.inner} with at least 2 groups "
                f"(a (N / {self.inner})×{self.inner} mesh: --nproc {2 * self.inner}, {3 * self.inner}, ...), "
                f"got --nproc {size}"
            )
        if workload is not None and self.sharded:
            workload.check_parallel(self.kind, self.tp_degree(size), self.ep_degree(size))
        if workload is not None and self.pipeline:
            workload.check_pipeline(self.kind, self.degrees(size)["pp"])

    def check_micro_batches(self, size: int, grad_accum: int) -> None:
        """Refuse (ValueError) a 1F1B pipeline with fewer micro-batches (``--grad-accum``) than
        stages: its steady state needs one in flight per stage."""
        if self.pipeline and self.schedule == "1f1b" and grad_accum < (stages := self.degrees(size)["pp"]):
            raise ValueError(
                f"--schedule 1f1b over {stages} pipeline stages needs --grad-accum {stages} or more "
                f"(micro-batches in flight), got --grad-accum {grad_accum}; raise it or use --schedule gpipe"
            )

    def build_mesh(self, size: int, device_type: str) -> Any:
        """The device mesh over ``size`` ranks (None for ``ddp``: a DDP wrapper needs none)."""
        if not self.sharded:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        degrees = self.degrees(size)
        return init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))

    def dp_coordinate(self, mesh: Any, rank: int, size: int) -> tuple[int, int]:
        """``(this rank's data-parallel index, the data-parallel size)``: the ranks of one
        tensor-parallel group share their data."""
        degrees = self.degrees(size)
        if "tp" not in degrees and "pp" not in degrees:
            return rank, size
        if "dp" not in degrees:
            return 0, 1
        return mesh.get_local_rank("dp"), degrees["dp"]

    def apply(self, model: nn.Module, mesh: Any, workload: Workload) -> nn.Module:
        """Split ``model`` in place by the ``workload``'s plan on ``mesh``: the tensor-parallel styles
        in every block over the ``tp`` dim, then FSDP2 over the data-parallel dims (each block,
        then the root). ``check`` refused a workload without a plan."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = workload.parallelize_plan()
        assert plan is not None and self.sharded and not self.pipeline, (plan, self.kind)
        blocks = model.get_submodule(plan.blocks)
        names = mesh.mesh_dim_names
        if "ep" in names:
            from sdcscope.common.alltoall import EXPERT
            from sdcscope.workloads.moe import shard_experts

            shard_experts(model, mesh["ep"].get_group())
            if names == ("ep",):
                return model  # the rest stays whole: the trainer averages its gradients (and the experts')
            for layer in model.modules():  # each rank's experts: FSDP2 over the ranks that hold them
                for expert in layer.experts.values() if getattr(layer, "exchange", None) is not None else ():
                    fully_shard(expert, mesh=mesh["dp"])
                    for p in expert.parameters():  # FSDP2's own parameters now: marked again
                        setattr(p, EXPERT, mesh.size(names.index("ep")))
        if "tp" in names:
            styles = {"col": ColwiseParallel, "row": RowwiseParallel}
            for block in blocks:
                parallelize_module(block, mesh["tp"], {n: styles[s]() for n, s in plan.tensor_parallel.items()})
        if names != ("tp",):
            dp = mesh["dp"] if "tp" in names else mesh
            for block in blocks:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
        return model


__all__ = ["MESH_DIMS", "PARALLEL", "SCHEDULES", "Topology"]
