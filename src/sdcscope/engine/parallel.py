"""Sharded training of the GPT workload with PyTorch's own engines: FSDP2 (``fully_shard``), tensor
parallel (``parallelize_module``), FSDP×TP on a 2-D mesh, and HSDP (``fully_shard`` over a
(replicate, shard) mesh). ``sdcscope train --nproc N --parallel fsdp|tp|fsdp+tp|hsdp``.

- **Mesh.** ``fsdp``: one dim of N ranks; ``tp``: one dim of N ranks; ``fsdp+tp`` and ``hsdp``: a
  2-D mesh of ``(N / inner, inner)`` ranks (``inner``: the TP degree, or HSDP's shard group size).
- **Plan.** Tensor parallelism splits each block's attention projections (q, k, v colwise, o
  rowwise, so each rank holds whole heads) and MLP (fc colwise, proj rowwise); embeddings, norms
  and the head stay whole. FSDP2 shards every block, then the root.
- **Data.** Ranks in one tensor-parallel group train the same micro-batch; each data-parallel
  coordinate its own shard (``shard(dp_rank, ...)``), so one data-parallel rank reproduces the
  single-process run's data order.
- **Clipping** is over the global gradient norm: squared local norms, a replicated shard counted
  once, gathered and summed in rank order (every rank clips by the same bits).
- **Run directory.** As :class:`~sdcscope.engine.ddp.DDPRun`; the final ``param_sha256`` is of the
  full parameters (gathered once at the end). Checkpoints (periodic ``checkpoints/step-N/`` and
  ``checkpoint/`` at the end of a session) are sharded, through ``torch.distributed.checkpoint``
  (:mod:`sdcscope.engine.shardckpt`); ``ParallelRun(..., resume=True)`` continues from the newest
  verified one on the same layout, bitwise as if uninterrupted.
"""

from __future__ import annotations

import hashlib
import math
import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdcscope.common.tensors import is_dtensor, local
from sdcscope.common.validate import check_choice, check_positive
from sdcscope.engine.ddp import DDPRun, DDPTrainer
from sdcscope.engine.dist import DistConfig, shard
from sdcscope.engine.rundir import (
    CHECKPOINT_DIR,
    LOG_FILES,
    CheckpointPolicy,
    JsonlWriter,
    as_written,
    check_new_run_dir,
    merge_injection_logs,
    periodic_dir,
    prune_checkpoints,
    read_json,
    remove_incomplete_checkpoints,
    write_json,
)
from sdcscope.engine.shardckpt import choose_sharded, layout_of, load_sharded, remove_sharded_temps, save_sharded
from sdcscope.engine.state import CheckpointError
from sdcscope.engine.trainer import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.workloads import Workload

PARALLEL = ("ddp", "fsdp", "tp", "fsdp+tp", "hsdp")
"""``--parallel`` choices: ``ddp`` is the DDP trainer (:mod:`sdcscope.engine.ddp`); the others shard."""
TP_PLAN = {"attn.q_proj": "col", "attn.k_proj": "col", "attn.v_proj": "col", "attn.o_proj": "row"}
TP_PLAN.update({"mlp.fc": "col", "mlp.proj": "row"})
"""The tensor-parallel plan of a GPT block: colwise then rowwise, one all-reduce per pair."""


@dataclass(kw_only=True)
class ParallelConfig:
    kind: str = "ddp"
    """``ddp``, ``fsdp``, ``tp``, ``fsdp+tp`` or ``hsdp``."""
    inner: int = 2
    """``fsdp+tp``: the tensor-parallel degree; ``hsdp``: the ranks that shard one replica."""

    def __post_init__(self) -> None:
        check_choice("parallel", self.kind, PARALLEL)
        check_positive("parallel inner", self.inner)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self, world: int, workload: Any) -> None:
        """Refuse (ValueError) a layout that does not fit ``world`` ranks and the workload config."""
        if self.kind == "ddp":
            return
        if workload.workload != "gpt":
            raise ValueError(f"--parallel {self.kind} is for the gpt workload, got {workload.workload!r}")
        if self.kind in ("fsdp+tp", "hsdp") and (world % self.inner or world // self.inner < 2 and world > 1):
            raise ValueError(
                f"--parallel {self.kind} needs --nproc a multiple of {self.inner} with at least 2 groups "
                f"(a {world // max(self.inner, 1)}×{self.inner} mesh), got --nproc {world}"
            )

    def tp_degree(self, world: int) -> int:
        return world if self.kind == "tp" else self.inner if self.kind == "fsdp+tp" else 1


def build_mesh(config: ParallelConfig, world: int, device_type: str):
    """The device mesh of ``config`` over ``world`` ranks (dim names: ``dp``, ``tp``,
    ``replicate``, ``shard``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if config.kind == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    if config.kind == "tp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    if config.kind == "fsdp+tp":
        return init_device_mesh(device_type, (world // config.inner, config.inner), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (world // config.inner, config.inner), mesh_dim_names=("replicate", "shard"))


def check_heads(model: nn.Module, tp: int) -> None:
    cfg = model.cfg
    if cfg.n_head % tp or (cfg.mlp_ratio * cfg.d_model) % tp:
        raise ValueError(f"tensor parallelism of degree {tp} needs n_head={cfg.n_head} divisible by {tp}")


def parallelize(model: nn.Module, config: ParallelConfig, mesh) -> nn.Module:
    """Apply the plan of ``config`` to the GPT ``model`` in place (TP first, then FSDP2)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if config.kind in ("tp", "fsdp+tp"):
        tp_mesh = mesh["tp"]
        check_heads(model, tp_mesh.size())
        styles = {"col": ColwiseParallel, "row": RowwiseParallel}
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {name: styles[s]() for name, s in TP_PLAN.items()})
    if config.kind in ("fsdp", "fsdp+tp", "hsdp"):
        dp = mesh["dp"] if config.kind == "fsdp+tp" else mesh
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def dp_coordinate(config: ParallelConfig, mesh, rank: int) -> tuple[int, int]:
    """``(this rank's data-parallel index, the data-parallel size)``: ranks of one TP group share data."""
    if config.kind == "tp":
        return 0, 1
    if config.kind == "fsdp+tp":
        return mesh.get_local_rank("dp"), mesh.size(0)
    return rank, mesh.size()


def replica_weights(params: Sequence[torch.Tensor], world: int) -> list[float]:
    """1 / (ranks holding the same values as this rank's part of each parameter)."""
    out = []
    for p in params:
        n = world
        if is_dtensor(p):
            n = world // p.device_mesh.size()
            for dim, placement in enumerate(p.placements):
                n *= p.device_mesh.size(dim) if placement.is_replicate() else 1
        out.append(1.0 / n)
    return out


def global_grad_norm(params: Sequence[torch.Tensor], world: int) -> float:
    """The 2-norm of all gradients over every shard, the same bits on every rank."""
    grads = [local(p.grad) for p in params]
    sq = 0.0
    if grads:
        norms = torch._foreach_norm(grads)
        w = torch.tensor(replica_weights(params, world), dtype=torch.float64)
        sq = float((torch.stack([n.double().cpu() for n in norms]).square() * w).sum())
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(world)]
    dist.all_gather(rows, torch.tensor([sq], dtype=torch.float64, device=dev))
    total = math.fsum(float(r) for r in rows)
    return math.sqrt(total) if math.isfinite(total) else math.inf


class ParallelTrainer(DDPTrainer):
    """The GPT trained sharded on every rank of an initialized world (see the module docstring).

    ``self.model`` is the sharded module itself (FSDP2 and TP keep the module's names); there is
    no DDP wrapper: FSDP2 reduces the gradients itself, and a TP group computes one replica."""

    def __init__(
        self,
        workload: Workload,
        config: TrainConfig | None = None,
        callbacks=(),
        *,
        parallel: ParallelConfig,
        dist_config: DistConfig | None = None,
        specs: Sequence[FaultSpec] = (),
        injection_log=None,
    ) -> None:
        Trainer.__init__(self, workload, config, callbacks)
        self.dist_config = dist_config or DistConfig()
        self.parallel = parallel
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from sdcscope.engine.dist import device_for

        self.device = device_for(self.dist_config)
        self.model.to(self.device)
        self.mesh = build_mesh(parallel, self.world, self.device.type)
        parallelize(self.model, parallel, self.mesh)
        self.optimizer = workload.build_optimizer(self.model)
        if parallel.kind == "tp":  # plain and DTensor parameters side by side: no fused multi-tensor step
            for group in self.optimizer.param_groups:
                group["foreach"] = False
        self.dp_rank, self.dp_size = dp_coordinate(parallel, self.mesh, self.rank)
        self.ddp = None
        self.hook = _NoHook()
        self.injector = None
        self.comm_injector = None
        if any(s.site == "comm" for s in specs):
            raise ValueError(f"faults of site 'comm' need --parallel ddp (the DDP bucket hook), not {parallel.kind}")
        self._attach_faults(list(specs), injection_log)

    def batch_for(self, data_pos: int, micro_batch: int, rank: int | None = None):
        """Micro-batch ``micro_batch`` of this rank's data-parallel shard."""
        dp = self.dp_rank if rank is None else rank
        batch = self.workload.batch(self.config.seed, data_pos, shard(dp, self.config.grad_accum, micro_batch))
        return tuple(t.to(self.device) for t in batch)

    def micro_step(self, micro_batch: int, accum: int):
        return Trainer.micro_step(self, micro_batch, accum)

    def local_gradients(self, *args, **kwargs):  # no rank replay of one rank's shard: the step is a collective
        raise NotImplementedError

    def clip_gradients(self, params: list[torch.Tensor], clip: float, ctx: Any) -> torch.Tensor:
        """Clip by the global norm over every shard (each rank scales its local shard alike)."""
        norm = global_grad_norm(params, self.world)
        if clip > 0 and math.isfinite(norm):
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_([local(p.grad) for p in params], coef)
        return torch.tensor(norm)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """A collective: every rank evaluates (FSDP2 gathers the weights, TP reduces the outputs)."""
        return Trainer.evaluate(self)


class _NoHook:
    excluded: frozenset[int] = frozenset()


def full_sha256(model: nn.Module) -> str:
    """sha256 of the full parameters in name order, as :func:`~sdcscope.engine.state.param_sha256`
    of the unsharded model (a collective: every rank gathers; each gets the same digest)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.full_tensor() if is_dtensor(p) else p
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ParallelRun(DDPRun):
    """A sharded run bound to a run directory (call inside an initialized process group).

    ``checkpoints``: the periodic checkpoint policy; ``resume``: continue the run in ``out`` (its
    config.json describes the same run) from its newest complete, certified checkpoint."""

    def __init__(
        self,
        out: str | Path,
        workload,
        train: TrainConfig,
        *,
        parallel: ParallelConfig,
        checkpoints: CheckpointPolicy | None = None,
        resume: bool = False,
        **kwargs,
    ) -> None:
        parallel.check(dist.get_world_size(), workload)
        self.checkpoints = checkpoints or CheckpointPolicy()
        self._resuming = resume
        self.resumed_from: Path | None = None
        self.skipped_checkpoints: list[tuple[Path, str]] = []
        self.certify: Any = None
        """A callable returning whether this rank's state is verified (a guard's ``state_verified``)
        for each checkpoint's certification; None: no guard watched."""
        self._target = 0
        self._session = False
        if train.eval_every:
            raise ValueError(
                f"--eval-every with --parallel {parallel.kind}: evaluation of a sharded model is a collective "
                "and runs once, at the end; drop --eval-every"
            )
        self.parallel = parallel
        self.guard_stop: Any = None
        """A callable returning why a guard stopped the run (the same on every rank), or None."""
        self.stopped: str | None = None
        extra = {**(kwargs.pop("extra_config", None) or {}), "parallel": parallel.to_dict()}
        super().__init__(out, workload, train, extra_config=extra, **kwargs)
        if resume:
            self._resume()

    @property
    def layout(self) -> dict[str, Any]:
        return layout_of(self.parallel.kind, self.parallel.inner, self.world)

    def _check_out(self) -> None:
        if not self._resuming:
            check_new_run_dir(self.out)
        elif not (self.out / "config.json").is_file():
            raise ValueError(f"--resume {str(self.out)!r} is not a run directory (no config.json)")

    def _resume(self) -> None:
        """Load the checkpoint rank 0 chose (every rank the same one); drop what the logs hold
        after it (those steps are trained again); take config.json's configuration."""
        from sdcscope.engine.run import _differences, _identity

        recorded = read_json(self.out / "config.json")
        choice: list[Any] = [None, None, None]
        if self.rank == 0:
            try:
                remove_sharded_temps(self.out)
                remove_incomplete_checkpoints(self.out)
                data = _differences(recorded.get("data"), as_written(self.workload.describe()))
                if "data" in recorded and data:
                    raise CheckpointError(
                        f"{str(self.out / 'config.json')!r} does not match the workload it describes: "
                        f"{', '.join(f'data.{k}' for k in data)} differ (a resumed run needs the same model and data)"
                    )
                path, manifest, skipped = choose_sharded(self.out, self.layout, _identity(recorded))
                choice = [str(path), manifest, [(str(p), why) for p, why in skipped]]
            except (CheckpointError, OSError) as exc:
                choice = [None, str(exc), None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            raise CheckpointError(choice[1])
        path, manifest = Path(choice[0]), choice[1]
        injector = self.trainer.injector
        if injector is not None:  # loading steps the optimizer once (lr 0) to build its state: no fault there
            injector.detach()
        load_sharded(self.trainer, path, manifest)
        if injector is not None:  # the permanent memory faults restored in place are not applied again
            injector.resumed_at = self.trainer.step
            injector.attach()
        self.resumed_from, self.skipped_checkpoints = path, [(Path(p), why) for p, why in choice[2]]
        step = self.trainer.step
        own = [f"injections.rank{self.rank}.jsonl", f"events.rank{self.rank}.jsonl"]
        for name in [*own, *(LOG_FILES if self.rank == 0 else ())]:
            JsonlWriter(self.out / name).truncate_after("step", step)
        if self.rank == 0:  # a summary of an earlier session: this one writes its own
            (self.out / "summary.json").unlink(missing_ok=True)
        self.config = {k: v for k, v in recorded.items() if k != "steps"}
        dist.barrier()

    def train(self, steps: int, **kwargs) -> dict[str, Any]:
        """As :meth:`DDPRun.train`; a resumed run records the session in config.json's ``resumes``."""
        if isinstance(steps, int) and steps < self.trainer.step:
            raise ValueError(f"steps={steps} is below the {self.trainer.step} steps this run already has")
        self._target = steps
        if self.resumed_from is not None and not self._session:
            self._session = True
            entry = {"from_step": self.trainer.step, "steps": steps}
            self.config["resumes"] = [*self.config.get("resumes", []), entry]
        return super().train(steps, **kwargs)

    def save_checkpoint(self, directory: str | Path) -> Path:
        """The sharded state now, to ``directory`` (a collective: every rank writes its shards)."""
        from sdcscope.engine.run import _identity

        verified = None if self.certify is None else self.certify()
        return save_sharded(self.trainer, directory, layout=self.layout, run=_identity(self.config), verified=verified)

    def make_trainer(self, train: TrainConfig, dist_config: DistConfig | None, specs, log) -> ParallelTrainer:
        return ParallelTrainer(
            self.workload, train, parallel=self.parallel, dist_config=dist_config, specs=specs, injection_log=log
        )

    def _step(self, metrics, stop=()) -> dict[str, Any]:
        m = super()._step(metrics, stop)
        reason = None if self.guard_stop is None else self.guard_stop()
        if reason and not self.stopped:  # every rank stops after this step, as on a signal
            self.stopped = reason
            self._stop_signal = int(signal.SIGTERM)
        step, every = self.trainer.step, self.checkpoints.every
        if every and step % every == 0 and step < self._target and not self._stop_signal and not m.get("stop"):
            self.save_checkpoint(periodic_dir(self.out, step))
            if self.rank == 0:
                prune_checkpoints(self.out, self.checkpoints.keep)
        return m

    def _finish(self, last: dict[str, Any], wall: float, *, interrupted: bool = False) -> None:
        self.save_checkpoint(self.out / CHECKPOINT_DIR)  # also when interrupted: the session resumes from it
        digest = full_sha256(self.trainer.model)
        hashes: list[str | None] = [None] * self.world
        dist.all_gather_object(hashes, digest)
        final = self.trainer.evaluate()
        if self.rank == 0:
            finite = math.isfinite(last.get("loss", 0.0))
            self.summary = {
                "outcome": "crash"
                if not finite
                else "stopped"
                if self.stopped
                else "interrupted"
                if interrupted
                else "completed",
                **({"stopped": self.stopped} if self.stopped else {}),
                "final_train_loss": last.get("loss"),
                "final_val_loss": final.get("val_loss"),
                **{f"final_{k}": v for k, v in final.items() if k not in ("val_loss", "step")},
                "param_sha256": digest,
                "replica_sha256": hashes,
                "replicas_identical": len(set(hashes)) == 1,
                "steps": self.trainer.step,
                "world_size": self.world,
                "parallel": self.parallel.kind,
                "wall_seconds": round(wall, 4),
            }
        dist.barrier()
        if self.rank == 0:
            merge_injection_logs(self.out, self.world)
            write_json(self.out / "summary.json", self.summary)


__all__ = ["PARALLEL", "ParallelConfig", "ParallelRun", "ParallelTrainer", "build_mesh", "full_sha256", "parallelize"]
