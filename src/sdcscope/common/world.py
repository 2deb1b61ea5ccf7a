"""The world a run lives in -- one process, data parallel (DDP), sharded (FSDP2, tensor parallel,
FSDP×TP, HSDP), expert parallel (an MoE's experts sharded over ranks, alone or with FSDP2) or a
pipeline of stages (optionally each sharded by FSDP2) -- described once and built by one factory,
:func:`world_of`.

This module is the only code that inspects DDP wrappers or DTensor types. The engine and the guard
are composed with a :class:`World`: its degrees and capability properties (``sharded``,
``tp_enabled``, ``data_parallel``), its placement arithmetic (:meth:`World.replicas`: how many
ranks hold the same values of a parameter; a replicated shard counts once in a global norm), and
the tensor helpers every room uses on sharded values (:func:`local`, :func:`shard_coords`,
:func:`rewrap`). :data:`SUPPORT` is the one table of what each world supports, read by the CLI,
the guard, the trainer adapters and the docs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sdcscope.common.alltoall import exchanges, is_expert

KINDS = ("single", "ddp", "sharded", "expert", "pipeline")
"""The worlds a run can live in. ``expert``: an MoE whose experts are sharded over ranks and
reached by all-to-all, with or without FSDP2 for the rest; ``pipeline``: stages of the model on
ranks, joined by send/recv, with or without FSDP2 in each stage."""


# -- sharded values ----------------------------------------------------------------------------
def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed`` DTensor (a sharded or replicated parameter or
    activation of an FSDP2 / tensor-parallel model), without importing torch.distributed."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (no collective), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def shard_coords(t: torch.Tensor) -> dict | None:
    """Where a DTensor's local shard sits in the global tensor -- ``{"global_shape", "offset",
    "local_shape", "placements"}`` (an event names an element in both coordinates: global index
    = offset + local index) -- or None for a plain tensor."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {
        "global_shape": list(t.shape),
        "offset": list(offset),
        "local_shape": list(shape),
        "placements": [str(p) for p in t.placements],
    }


def rewrap(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's part of ``like``, as ``local(like)`` is shaped) as a tensor like
    ``like``: for a DTensor, wrapped with its mesh, placements and global shape, without a
    collective (``run_check=False``); a plain tensor is itself."""
    if not is_dtensor(like):
        return values
    from torch.distributed.tensor import DTensor

    stride = like.stride()
    if values.stride() != local(like).stride():  # a contiguous copy: the global tensor's contiguous strides
        stride = tuple(math.prod(like.shape[d + 1 :]) for d in range(len(like.shape)))
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(values, mesh, placements, shape=like.shape, stride=stride, run_check=False)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: a DTensor gathered (a collective: every rank calls it), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def is_ddp(module: object) -> bool:
    """Whether ``module`` is a ``DistributedDataParallel`` wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


# -- what each world supports -------------------------------------------------------------------
SUPPORT: dict[str, dict[str, str]] = {
    "guard.metrics": {
        "sharded": "per-step metrics read whole parameters and gradients; over shards they would be each "
        "rank's partial values",
        "expert": "per-step metrics read whole parameters and gradients; each rank holds only its own experts",
        "pipeline": "per-step metrics read whole parameters and gradients; a stage holds only its own layers",
    },
    "guard.zclip": {
        "sharded": "ZClip clips by a gradient norm it computes itself, which over shards is each rank's own "
        "norm (ranks would clip differently); clip in before_step with a DTensor-aware clip_grad_norm_",
        "expert": "ZClip clips by a gradient norm it computes itself, which is each rank's own (its experts "
        "differ): ranks would clip differently",
        "pipeline": "ZClip clips by a gradient norm it computes itself, which in a pipeline is each stage's own norm",
    },
    "guard.qk_clip": {
        "ddp": "each rank sees only its own attention logits, and rescaling on some ranks would split the replicas",
        "sharded": "each rank sees only its own heads' attention logits, and rescaling on some ranks would "
        "split the shards",
        "expert": "each rank sees only its own tokens' attention logits, and rescaling on some ranks would "
        "split the replicas",
        "pipeline": "each stage sees only its own layers' attention logits, and rescaling on some stages would "
        "split the model",
    },
    "guard.invariants": {
        "ddp": "the invariant checker traces one process's loop",
        "sharded": "the invariant checker traces whole tensors in one process",
        "expert": "the invariant checker traces whole tensors in one process",
        "pipeline": "the invariant checker traces whole models in one process",
    },
    "guard.scaler": {
        "ddp": "the rank guard compares gradients before the scaler unscales them",
        "sharded": "train in bf16 (FSDP2's MixedPrecisionPolicy) instead of fp16 with a GradScaler",
        "expert": "the gradients are averaged by the trainer before any scaler could unscale them; train in fp32 "
        "or bf16",
        "pipeline": "a GradScaler's overflow check would see one stage's gradients; train in fp32 or bf16",
    },
    "guard.ranks_null": {
        "ddp": "every rank must take the same decision, which the ranks section provides; give ranks: {}",
        "sharded": "every rank must take the same decision, which the ranks section provides; give ranks: {}",
        "expert": "every rank must take the same decision, which the ranks section provides; give ranks: {}",
        "pipeline": "every rank must take the same decision, which the ranks section provides; give ranks: {}",
    },
    "fault.comm": {
        "single": "site 'comm' corrupts a DDP gradient bucket: it needs --nproc 2 or more with --parallel ddp",
        "sharded": "site 'comm' is the DDP bucket hook's: it needs --parallel ddp",
        "expert": "site 'comm' is the DDP bucket hook's: it needs --parallel ddp",
        "pipeline": "site 'comm' is the DDP bucket hook's: it needs --parallel ddp",
    },
    "fault.all_to_all": {
        "single": "site 'comm.all_to_all' corrupts an MoE's expert-parallel all-to-all: it needs --nproc 2 or "
        "more with --parallel ep or fsdp+ep",
        "ddp": "DDP runs no all-to-all (each rank holds every expert); use --parallel ep",
        "sharded": "FSDP2 and tensor parallelism run no all-to-all; use --parallel ep or fsdp+ep",
        "pipeline": "a pipeline of the GPT runs no all-to-all; use --parallel ep or fsdp+ep with the MoE workload",
    },
    "fault.collectives": {
        "single": "sites 'comm.all_gather' and 'comm.reduce_scatter' corrupt FSDP2's collectives: they need "
        "--nproc 2 or more with --parallel fsdp, hsdp, fsdp+tp or fsdp+pp",
        "ddp": "DDP runs no all-gather or reduce-scatter (its all-reduce is site 'comm'); use --parallel fsdp",
        "expert": "sites 'comm.all_gather' and 'comm.reduce_scatter' corrupt FSDP2's collectives: they need "
        "--parallel fsdp+ep (--parallel ep runs none)",
    },
    "fault.p2p": {
        "single": "site 'comm.p2p' corrupts a pipeline's send/recv: it needs --nproc 2 or more with --parallel pp "
        "or fsdp+pp",
        "ddp": "DDP runs no pipeline send/recv; use --parallel pp",
        "sharded": "FSDP2 and tensor parallelism run no pipeline send/recv; use --parallel pp or fsdp+pp",
        "expert": "an expert-parallel MoE runs no pipeline send/recv; use --parallel pp or fsdp+pp with the GPT",
    },
    "guard.collectives": {
        "single": "one process runs no collective: nothing to check",
        "ddp": "DDP's all-reduce reduces: the rank guard's pre-reduction signatures and replica hashes check it",
    },
    "train.eval_every": {
        "sharded": "evaluation of a sharded model is a collective and runs once, at the end",
        "expert": "evaluation of an expert-parallel model is a collective (all-to-all) and runs once, at the end",
        "pipeline": "evaluation of a pipeline runs through every stage and runs once, at the end",
    },
    "action.recompute": {
        "ddp": "the clean re-execution is a local replay of one rank's shard, not a world step: a veto",
    },
    "action.quarantine": {
        "single": "no other rank can carry on: the step is vetoed and training stops",
        "sharded": "no rank can be excluded: each owns a shard no other rank holds; the run stops",
        "expert": "no rank can be excluded: each owns experts no other rank holds; the run stops",
        "pipeline": "no rank can be excluded: each holds a stage no other rank holds; the run stops",
    },
}
"""``feature -> {world kind: why it is not supported there}``; a kind not named supports it. The
``action.*`` rows say what an action becomes in a world that cannot take it as such."""


def unsupported(feature: str, kind: str) -> str | None:
    """Why ``feature`` is not supported in a ``kind`` world (None: it is)."""
    assert feature in SUPPORT, feature
    return SUPPORT[feature].get(kind)


def support_table() -> list[tuple[str, dict[str, str]]]:
    """The table as rows ``(feature, {kind: "yes" or the reason})``."""
    return [(f, {k: SUPPORT[f].get(k, "yes") for k in KINDS}) for f in SUPPORT]


def support_markdown() -> str:
    """The table as docs/architecture.md shows it (a test keeps the two the same)."""
    lines = ["| feature | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    for feature, row in support_table():
        lines.append(f"| `{feature}` | " + " | ".join(row[k] for k in KINDS) + " |")
    return "\n".join(lines)


# -- the world ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    """One run's world: its kind, this process's rank, the world size and, when sharded, the
    device mesh and the parallel degrees."""

    kind: str = "single"
    rank: int = 0
    size: int = 1
    mesh: Any = None
    """The device mesh of a sharded world (None otherwise)."""
    degrees: dict[str, int] = field(default_factory=dict)
    """Mesh dim name -> size (``dp``, ``tp``, ``replicate``, ``shard``); DDP: ``{"dp": size}``."""
    ddp: Any = None
    """The DDP wrapper of a data-parallel world's model."""
    collectives: tuple[str, ...] = ()
    """The collectives a training step runs: ``all_reduce`` (DDP, tensor parallel, an expert
    world's replicated parameters), ``all_gather`` and ``reduce_scatter`` (FSDP2), ``all_to_all``
    (an expert world's token dispatch and combine), ``p2p`` (a pipeline's send/recv); what the
    collective checks and fault sites need."""
    stage: Any = None
    """A pipeline world's :class:`~sdcscope.common.pipeline.StageInfo` of this rank (None otherwise)."""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @property
    def distributed(self) -> bool:
        return self.kind != "single"

    @property
    def sharded(self) -> bool:
        """The model is split over ranks (a step is a collective every rank runs): sharded or expert."""
        return self.kind in ("sharded", "expert")

    @property
    def expert_parallel(self) -> bool:
        return self.kind == "expert"

    @property
    def pipeline(self) -> bool:
        return self.kind == "pipeline"

    @property
    def split(self) -> bool:
        """No rank holds the whole model (shards or stages): a global value sums every rank's part,
        a step is one collective of every rank, and no rank can be left out."""
        return self.kind in ("sharded", "expert", "pipeline")

    @property
    def data_parallel(self) -> bool:
        """Whole replicas on every rank, averaged gradients (a rank can be left out of the average)."""
        return self.kind == "ddp"

    @property
    def tp_enabled(self) -> bool:
        return self.degrees.get("tp", 1) > 1

    @property
    def dp_size(self) -> int:
        """Ranks that train on different data."""
        if self.kind == "single":
            return 1
        if self.pipeline:
            return self.stage.dp
        return self.size // self.degrees.get("tp", 1)

    @property
    def loss_ranks(self) -> list[int]:
        """The ranks whose loss is the model's: the last stage's in a pipeline, else every rank."""
        if self.pipeline:
            info = self.stage
            return [info.rank_of(info.stages - 1, d) for d in range(info.dp)]
        return list(range(self.size))

    def unsupported(self, feature: str) -> str | None:
        return unsupported(feature, self.kind)

    def comm_device(self) -> torch.device:
        """Where this world's collectives take their tensors: the current CUDA device under nccl."""
        import torch.distributed as dist

        if self.distributed and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- placement arithmetic ------------------------------------------------------------------
    def replicas(self, p: torch.Tensor) -> int:
        """How many ranks hold the same values as this rank's part of ``p``: a DTensor's size of the
        mesh dims it is replicated over (the dims it is sharded over split it); a plain tensor is
        alike on every rank of a distributed world, except an expert's, held by the ranks of its
        expert-parallel coordinate only. In a pipeline only the ranks of its stage hold it (its
        data-parallel replicas, unless FSDP2 shards it), and a tied parameter's copies on other
        stages count too."""
        if self.pipeline:
            tied = 2 if id(p) in self.stage.tied else 1
            if not is_dtensor(p):
                return self.stage.dp * tied
            mesh = p.device_mesh
            return tied * math.prod(mesh.size(d) for d, pl in enumerate(p.placements) if pl.is_replicate())
        expert = is_expert(p)
        if not is_dtensor(p):
            return self.size // self.degrees.get("ep", 1) if expert else self.size
        mesh = p.device_mesh
        n = 1
        for dim, placement in enumerate(p.placements):
            if placement.is_replicate():
                n *= mesh.size(dim)
        return n if expert else n * (self.size // mesh.size())  # ranks outside the mesh hold their own copy

    def replica_weights(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``1 / replicas(p)`` per parameter, in fp64: summed over every rank, each value counts once."""
        if not self.split:  # every rank holds the whole of every parameter: one rank speaks for all
            return torch.ones(len(params), dtype=torch.float64)
        return torch.tensor([1.0 / self.replicas(p) for p in params], dtype=torch.float64)

    def replica_key(self, params: Iterable[torch.Tensor]) -> tuple:
        """This rank's coordinates on the mesh dims its replicated parameters are split over: the
        ranks sharing a key hold copies of the same shards."""
        key = []
        for p in params:
            if is_dtensor(p):
                coord = p.device_mesh.get_coordinate() or []
                key.append(tuple(c for c, pl in zip(coord, p.placements) if not pl.is_replicate()))
        return tuple(key)

    def gather(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``row`` (same shape and dtype on every rank), in rank order; a collective."""
        if not self.distributed:
            return [row]
        import torch.distributed as dist

        row = row.to(self.comm_device())
        rows = [torch.zeros_like(row) for _ in range(self.size)]
        dist.all_gather(rows, row)
        return rows

    def global_sq_norm(self, sq: torch.Tensor | None, params: Sequence[torch.Tensor], idx: Sequence[int]) -> float:
        """The squared global gradient norm from this rank's squared local norms ``sq`` of
        ``params[i] for i in idx``: in a sharded world summed over every rank, each replicated
        shard counted once, in rank order (every rank gets the same bits); elsewhere ``sq`` summed."""
        total = torch.zeros((), dtype=torch.float64)
        if sq is not None and len(idx):
            w = self.replica_weights(params)[list(idx)].to(sq.device)
            total = (sq.double() * w).sum() if self.split else sq.double().sum()
        if not self.split:
            return float(total)
        sums = [float(r) for r in self.gather(total.reshape(1))]
        out = math.fsum(sums)
        return out if math.isfinite(out) else math.inf


def world_of(model: torch.nn.Module, ddp: Any = None, *, rank: int | None = None) -> World:
    """The world ``model`` trains in: a pipeline when it is a stage (:func:`~sdcscope.common.pipeline.stage_of`),
    expert parallel when its MoE layers exchange tokens by
    all-to-all (:func:`~sdcscope.common.alltoall.exchanges`), sharded when its parameters are
    DTensors, data parallel when ``ddp`` (or ``model`` itself) is a ``DistributedDataParallel``
    wrapper, else one process.
    ``rank``, when given, must be this process's rank (ValueError otherwise)."""
    if ddp is None and is_ddp(model):
        ddp, model = model, model.module
    from sdcscope.common.pipeline import stage_of

    if (info := stage_of(model)) is not None:
        return _pipeline_world(model, info, rank)
    params = list(model.parameters())
    sharded = [p for p in params if is_dtensor(p)]
    if ddp is not None:
        if not is_ddp(ddp):
            raise TypeError(f"ddp must be a torch DistributedDataParallel module, got {type(ddp).__name__}")
        if sharded:
            raise ValueError("a DDP wrapper around sharded (DTensor) parameters is not a topology the guard knows")
        if model is not ddp.module:
            raise ValueError(
                "under DDP the guard watches the wrapped module: pass ddp.module as model (or the "
                "DDP module itself as model and leave ddp out)"
            )
        import torch.distributed as dist

        own, size = dist.get_rank(ddp.process_group), dist.get_world_size(ddp.process_group)
        _check_rank(rank, own, "the DDP process group")
        return World("ddp", own, size, degrees={"dp": size}, ddp=ddp, collectives=("all_reduce",))
    moved = exchanges(model)
    if sharded or moved:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a model with DTensor parameters needs an initialized torch.distributed process group")
        own, size = dist.get_rank(), dist.get_world_size()
        _check_rank(rank, own, "the world")
        mesh = max((p.device_mesh for p in sharded), key=lambda m: m.ndim) if sharded else None
        names = () if mesh is None else mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        degrees = {n: mesh.size(i) for i, n in enumerate(names)}
        from sdcscope.common.fsdp import fsdp_units

        # TP, HSDP's replicas; an expert world's replicated parameters (the trainer's average, HSDP's)
        replicas = "tp" in degrees or "replicate" in degrees or bool(moved)
        collectives = ("all_reduce",) if replicas else ()
        if moved:  # expert parallel: the ep degree is the exchanges' group; FSDP2 (fsdp+ep) over the rest
            degrees = {**{k: v for k, v in degrees.items() if k != "ep"}, "ep": moved[0].size}
            if "dp" not in degrees and size > moved[0].size:
                degrees = {"dp": size // moved[0].size, **degrees}
            collectives += ("all_to_all",)
        collectives += ("all_gather", "reduce_scatter") if fsdp_units(model) else ()
        kind = "expert" if moved else "sharded"
        return World(kind, own, size, mesh=mesh, degrees=degrees, collectives=collectives)
    return World("single", 0 if rank is None else rank, 1)


def _pipeline_world(model: torch.nn.Module, info: Any, rank: int | None) -> World:
    """A pipeline stage's world: every rank of the pipeline, the stage's FSDP2 shards (if any)."""
    import torch.distributed as dist

    own, size = dist.get_rank(), dist.get_world_size()
    _check_rank(rank, own, "the pipeline")
    sharded = [p for p in model.parameters() if is_dtensor(p)]
    mesh = sharded[0].device_mesh if sharded else None
    from sdcscope.common.fsdp import fsdp_units

    collectives = ("p2p",) + (("all_reduce",) if info.ties else ())  # the tied head's gradient sum
    collectives += ("all_gather", "reduce_scatter") if fsdp_units(model) else ()
    return World("pipeline", own, size, mesh=mesh, degrees=info.degrees, collectives=collectives, stage=info)


def _check_rank(rank: int | None, own: int, where: str) -> None:
    if rank is not None and rank != own:
        raise ValueError(f"rank={rank!r} is not this process's rank {own} in {where}")
