"""The torchrun job: one distributed run (DDP or sharded, as its topology says) with faults and a
guard, run alike by every rank.

The launcher (:func:`sdcscope.jobs.launcher.launch`, behind ``sdcscope train --nproc N``) validates
a :class:`Job` (its topology against the workload's model too) and saves it as a job file holding
the resolved configs; every rank reads it::

    torchrun --nproc-per-node N -m sdcscope.jobs.torchrun JOB.json

With a guard config every rank is watched by the Guard; without one, in a data-parallel world,
the rank guard alone (:mod:`sdcscope.mitigate.quarantine`) runs, unless ``crossrank`` is off.
Each rank logs (the guard's events among its lines) on stderr at the launcher's verbosity, every
line naming the rank, and tells the launcher its exit code (:mod:`sdcscope.jobs.ranklife`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdcscope.common.exitcodes import ExitCode
from sdcscope.common.world import unsupported
from sdcscope.engine import TrainConfig, check_new_run_dir
from sdcscope.engine.dist import DistConfig, DistributedError, init_distributed, leave_world
from sdcscope.engine.distrun import DistRun, failure, is_comm_error
from sdcscope.engine.run import Interrupted, stop_requests
from sdcscope.engine.rundir import CheckpointPolicy, read_json, write_json
from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec
from sdcscope.faults.vocab import COLLECTIVE_SITES
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.world import fit_config
from sdcscope.inject.p2p import check_p2p_link, check_p2p_spec
from sdcscope.jobs.assemble import check_faults, guard_trainer
from sdcscope.jobs.ranklife import LAUNCHER_ENV, configure_logging, tell_launcher, watch_launcher
from sdcscope.workloads import WorkloadConfig, make_workload

__all__ = [
    "Job",
    "make_job",
    "resume_job",
    "save_job",
    "load_job",
    "check_job",
    "run_job",
    "main",
]


@dataclass
class Job:
    """A validated distributed job (what every rank runs)."""

    out: Path
    nproc: int
    """The number of ranks the job was validated for."""
    steps: int
    workload: WorkloadConfig
    train: TrainConfig
    dist: DistConfig
    specs: list[FaultSpec] = field(default_factory=list)
    crossrank: bool = True
    hash_every: int | None = None
    ledger: Path | None = None
    guard: GuardConfig | None = None
    parallel: Topology = field(default_factory=Topology)
    """How the run is laid over its ranks (:mod:`sdcscope.engine.topology`; default: DDP)."""
    log_level: str = "WARNING"
    """The ranks' logging level: the launcher's verbosity (``-v``, ``-q``)."""
    checkpoints: CheckpointPolicy | None = None
    """The run's periodic checkpoints (None: the policy's defaults)."""
    resume: bool = False
    """Continue the run in ``out`` from its newest verified checkpoint (:func:`resume_job`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "nproc": self.nproc,
            "steps": self.steps,
            "workload": self.workload.to_dict(),
            "train": self.train.to_dict(),
            "dist": {
                "backend": self.dist.backend,
                "timeout_s": self.dist.timeout_s,
                "bucket_cap_mb": self.dist.bucket_cap_mb,
            },
            "faults": [s.to_dict() for s in self.specs],
            "crossrank": self.crossrank,
            "hash_every": self.hash_every,
            "ledger": None if self.ledger is None else str(self.ledger),
            "guard": None if self.guard is None else self.guard.to_dict(),
            "parallel": self.parallel.to_dict(),
            "log_level": self.log_level,
            "checkpoints": None if self.checkpoints is None else asdict(self.checkpoints),
            "resume": self.resume,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(
            out=Path(d["out"]),
            nproc=d["nproc"],
            steps=d["steps"],
            workload=WorkloadConfig(**d["workload"]),
            train=TrainConfig(**d["train"]),
            dist=DistConfig(**d["dist"]),
            specs=[FaultSpec.from_dict(s) for s in d["faults"]],
            crossrank=d["crossrank"],
            hash_every=d["hash_every"],
            ledger=None if d["ledger"] is None else Path(d["ledger"]),
            guard=None if d["guard"] is None else GuardConfig.from_dict(d["guard"]),
            parallel=Topology(**d["parallel"]) if d.get("parallel") else Topology(),
            log_level=d.get("log_level", "WARNING"),
            checkpoints=None if d.get("checkpoints") is None else CheckpointPolicy(**d["checkpoints"]),
            resume=bool(d.get("resume", False)),
        )


def _launcher_level() -> str:
    """The verbosity the launcher logs at (its ``sdcscope`` logger's level), for the ranks."""
    return logging.getLevelName(logging.getLogger("sdcscope").getEffectiveLevel())


def _check_ranks(specs: Sequence[FaultSpec], world_size: int) -> None:
    for i, s in enumerate(specs):
        for what, r in (("rank", s.rank), ("source", s.source)):
            if r is not None and r >= world_size:
                raise ValueError(f"fault spec #{i}: {what} {r} does not exist; allowed: 0..{world_size - 1}")


def make_job(
    out: str | Path,
    nproc: int,
    *,
    steps: int = 200,
    workload: WorkloadConfig | None = None,
    train: TrainConfig | None = None,
    dist_config: DistConfig | None = None,
    specs: Sequence[FaultSpec] = (),
    guard: GuardConfig | None = None,
    crossrank: bool = True,
    hash_every: int | None = None,
    ledger: str | Path | None = None,
    parallel: Topology | None = None,
    checkpoints: CheckpointPolicy | None = None,
    log_level: str | None = None,
) -> Job:
    """A validated :class:`Job` for ``nproc`` ranks; raises ValueError before anything is started.

    ``parallel``: the topology (None: DDP), checked against ``nproc`` here and against the
    workload's model by :func:`check_job`; ``hash_every``: the replica hash check every N steps
    (0: off; None: the rank guard's default); ``ledger``: a device ledger shared across jobs
    (default: ``out/ledger.json``); ``checkpoints``: the run's periodic checkpoints (every world
    writes them through torch.distributed.checkpoint); ``log_level``: the ranks' (None: this
    process's verbosity)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be an integer >= 1")
    if steps < 0:
        raise ValueError(f"--steps {steps} must be >= 0")
    if hash_every is not None and hash_every < 0:
        raise ValueError(f"hash_every={hash_every} must be >= 0")
    topology = parallel or Topology()
    topology.check(nproc)
    topology.check_micro_batches(nproc, (train or TrainConfig()).grad_accum)
    sharded = topology.sharded
    kind = topology.world_kind
    if train is not None and train.eval_every and (why := unsupported("train.eval_every", kind)):
        raise ValueError(f"--eval-every with --parallel {topology.kind}: {why}; drop --eval-every")
    if any(s.site == "comm" for s in specs) and (why := unsupported("fault.comm", kind)):
        raise ValueError(f"faults of site 'comm' under --parallel {topology.kind}: {why}")
    for s in specs:
        if s.site in COLLECTIVE_SITES and s.site.split(".")[1] not in topology.collectives:
            feature = {"comm.all_to_all": "fault.all_to_all", "comm.p2p": "fault.p2p"}.get(s.site, "fault.collectives")
            why = unsupported(feature, kind) or f"--parallel {topology.kind} runs no {s.site.split('.')[1]}"
            raise ValueError(f"faults of site {s.site!r} under --parallel {topology.kind}: {why}")
        if s.site == "comm.p2p":
            degrees = topology.degrees(nproc)
            check_p2p_link(s, degrees["pp"], degrees.get("dp", 1))
    if guard is not None and sharded:
        guard = fit_config(guard, kind)
    elif guard is not None:
        if not crossrank:
            raise ValueError(
                "a guard needs the cross-rank checks (every rank must take the same decision); drop crossrank=False"
            )
        guard = copy.deepcopy(fit_config(guard, "ddp"))
        if hash_every is not None:
            guard.ranks.hash_every = hash_every
    specs = list(specs)
    _check_ranks(specs, nproc)
    out = Path(out)
    check_new_run_dir(out)
    return Job(
        out=out,
        nproc=nproc,
        steps=steps,
        workload=workload or WorkloadConfig(),
        train=train or TrainConfig(),
        dist=dist_config or DistConfig(),
        specs=specs,
        crossrank=crossrank,
        hash_every=hash_every,
        ledger=None if ledger is None else Path(ledger),
        guard=guard,
        parallel=topology,
        log_level=log_level or _launcher_level(),
        checkpoints=checkpoints,
    )


def resume_job(
    out: str | Path,
    steps: int | None = None,
    *,
    nproc: int | None = None,
    parallel: str | None = None,
    dist_config: DistConfig | None = None,
    checkpoints: CheckpointPolicy | None = None,
) -> tuple[Job, Path, list[tuple[Path, str]]]:
    """The job that continues the distributed run (DDP or sharded) in ``out`` to ``steps`` steps
    (None: the target its config.json records), with the workload, faults, guard and checkpoint
    policy (``checkpoints``: None) config.json records: ``(job, the checkpoint it starts from,
    the newer ones passed over and why)``. ``nproc`` and ``parallel`` (None: as recorded) must be
    the run's: a checkpoint is not resharded. Raises ValueError (CheckpointError) before any rank
    starts."""
    from sdcscope.engine.run import _identity
    from sdcscope.engine.shardckpt import choose_sharded, layout_of

    out = Path(out)
    path = out / "config.json"
    if not path.is_file():
        raise ValueError(f"--resume {str(out)!r} is not a run directory (no config.json)")
    config = read_json(path)
    world = config.get("world_size", 1)
    if world == 1:
        raise ValueError(
            f"--resume {str(out)!r}: the run was trained in one process (its config.json records no "
            "world_size); it resumes in one: sdcscope train --resume without --nproc, or Run.resume"
        )
    try:
        pcfg = Topology(**(config.get("parallel") or {}))
        wcfg, tcfg = WorkloadConfig(**config["workload"]), TrainConfig(**config["train"])
        specs = [FaultSpec.from_dict(d) for d in config.get("faults") or []]
        guard = GuardConfig.from_dict(config["guard"]) if config.get("guard") else None
        checkpoints = checkpoints or CheckpointPolicy.recorded(config)
        steps = config.get("steps") if steps is None else steps
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{str(path)!r}: {exc}") from None
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"{str(path)!r} records no steps target (steps: {steps!r}); give steps (--steps N)")
    for flag, given, was in (("--nproc", nproc, world), ("--parallel", parallel, pcfg.kind)):
        if given is not None and given != was:
            raise ValueError(
                f"--resume {str(out)!r} with {flag} {given}: the run and its checkpoints are {flag} {was} "
                f"(--parallel {pcfg.kind}, --nproc {world}); a checkpoint is not resharded: "
                f"drop {flag} or give {flag} {was}"
            )
    checkpoint, manifest, skipped = choose_sharded(out, layout_of(pcfg.kind, pcfg.inner, world), _identity(config))
    if steps < manifest["step"]:
        raise ValueError(f"--steps {steps} is below the {manifest['step']} steps of checkpoint {str(checkpoint)!r}")
    job = Job(
        out=out,
        nproc=world,
        steps=steps,
        workload=wcfg,
        train=tcfg,
        dist=dist_config or DistConfig(backend=config.get("backend")),
        specs=specs,
        crossrank=config.get("crossrank", True),
        hash_every=config.get("hash_every"),
        guard=guard,
        parallel=pcfg,
        log_level=_launcher_level(),
        checkpoints=checkpoints,
        resume=True,
    )
    return job, checkpoint, skipped


def save_job(job: Job, path: str | Path) -> Path:
    """Write ``job`` as the job file every rank reads (:func:`load_job`)."""
    path = Path(path)
    write_json(path, job.to_dict())
    return path


def load_job(path: str | Path, world_size: int) -> Job:
    """The job in the job file ``path``, checked against a world of ``world_size`` ranks."""
    job = Job.from_dict(read_json(path))
    _check_ranks(job.specs, world_size)
    return job


def check_job(job: Job) -> None:
    """Validate the topology (the workload's parallelize plan and shapes: heads and MLP width
    divisible by the tensor-parallel degree), the fault specs and the guard's target patterns
    (ABFT, metrics) against the model, as every rank will (without a world), so a mistake is
    refused before any rank starts."""
    workload = make_workload(job.workload)
    job.parallel.check(job.nproc, workload)
    torch.manual_seed(job.train.seed)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    check_faults(
        workload, model, optimizer, job.specs, train=job.train, steps=job.steps, world_size=job.nproc, distributed=True
    )
    p2p = [(i, s) for i, s in enumerate(job.specs) if s.site == "comm.p2p"]
    if p2p:  # make_job refused them outside a pipeline
        degrees = job.parallel.degrees(job.nproc)
        boundaries, _ = workload.split_stage(copy.deepcopy(model).to("meta"), 0, degrees["pp"])
        for i, spec in p2p:
            try:
                check_p2p_spec(spec, boundaries, degrees["pp"], degrees.get("dp", 1))
            except ValueError as exc:
                raise ValueError(f"fault spec #{i} ({spec.site}): {exc}") from None
    from sdcscope.engine.resources import check_memory

    check_memory(workload, processes=job.nproc, model=model)
    if job.guard is not None:  # built, never attached: no hooks; no metrics file (path dropped)
        metrics = job.guard.metrics and replace(job.guard.metrics, path=None, prometheus_port=None)  # no server
        Guard(model, optimizer, replace(job.guard, metrics=metrics)).close()


def run_job(job: Job, stop: list[int] | None = None) -> dict[str, Any]:
    """Run ``job`` on this rank (the process group must be initialized); ``stop``: see
    :meth:`DistRun.train`. Returns the run's summary on rank 0 (``{}`` elsewhere); a guard that
    stopped the run ends it on every rank after the same step, with outcome ``stopped``."""
    extra = {
        "crossrank": job.crossrank,
        "hash_every": job.hash_every,
        "guard": None if job.guard is None else job.guard.to_dict(),
    }
    run = DistRun(
        job.out,
        job.workload,
        job.train,
        topology=job.parallel,
        specs=job.specs,
        dist_config=job.dist,
        extra_config=extra,
        checkpoints=job.checkpoints,
        resume=job.resume,
    )
    watch: Any = None
    if job.guard is not None:
        guard = guard_trainer(run.trainer, job.guard, ddp=run.trainer.ddp, run_dir=job.out, ledger=job.ledger)
        run.certify = lambda: bool(guard.state_verified)
        watch, callback = guard, guard.callback(run.trainer)
    elif job.crossrank and run.trainer.world.data_parallel:  # the rank guard alone: DDP's bucket hook
        from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig

        config = RankGuardConfig() if job.hash_every is None else RankGuardConfig(hash_every=job.hash_every)
        watch = callback = RankGuard(
            run.trainer.ddp, run.trainer.optimizer, run_dir=job.out, ledger=job.ledger, config=config
        )
    try:
        return run.train(job.steps, callbacks=[] if watch is None else [callback], stop=stop)
    finally:
        if watch is not None:
            watch.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sdcscope.jobs.torchrun JOB.json`` on every rank; exit code 0 (trained: the
    outcome, ``stopped`` by the guard among them, is in summary.json), 2 (a job or spec this rank
    refuses), 5 (:data:`ExitCode.INFRASTRUCTURE`: the world could not form or was lost), 6 (a write
    the storage refused), 1 (a bug: its traceback is printed). The code is also written under
    :data:`~sdcscope.jobs.ranklife.EXIT_CODES_ENV` when the launcher names a folder there.

    SIGINT or SIGTERM stops every rank after the same step (summary outcome ``interrupted``); the
    ranks then exit 0 without a word (the launcher reports it); a second signal acts at once.
    A guard's stop ends every rank after the same step too, cleanly. A rank whose launcher dies
    stops too (:func:`~sdcscope.jobs.ranklife.watch_launcher`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    code: int = ExitCode.INTERNAL  # what escapes below is a bug
    try:
        with stop_requests() as stop:  # from here on, also while the world forms
            if LAUNCHER_ENV in os.environ:
                grace = 5.0
                with contextlib.suppress(Exception):
                    grace = min(grace, float(read_json(argv[0])["dist"]["timeout_s"]) / 2)
                watch_launcher(grace)
            code = _main(argv, stop)
    finally:
        tell_launcher(code)
    return code


def _loss(value: Any) -> str:
    return format(value, ".4f") if isinstance(value, float) else str(value)


def _main(argv: list[str], stop: list[int]) -> int:
    try:
        if len(argv) != 1:
            raise ValueError(f"usage: python -m sdcscope.jobs.torchrun JOB.json (got {' '.join(argv) or 'nothing'})")
        job = load_job(argv[0], int(os.environ.get("WORLD_SIZE", "1")))
        configure_logging(job.log_level, os.environ.get("RANK", "0"))
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USER_ERROR
    try:
        rank, _ = init_distributed(job.dist)
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.INFRASTRUCTURE
    except KeyboardInterrupt:  # a second signal before the world formed
        return 128 + signal.SIGINT
    try:
        try:
            summary = run_job(job, stop)
        except Interrupted:  # every rank stopped after the same step; rank 0 saved the summary
            dist.barrier()
            return 0
        dist.barrier()  # leave together (see sdcscope.engine.dist.spawn)
        if rank == 0:
            print(
                f"{summary['outcome']} after {summary['steps']} steps on {summary['world_size']} ranks: "
                f"train loss {_loss(summary['final_train_loss'])}, val loss {_loss(summary['final_val_loss'])}, "
                f"replicas identical: {summary['replicas_identical']}; run directory: {job.out}"
                + (f"; stopped by the guard: {summary['stop_reason']}" if summary.get("stop_reason") else "")
            )
        return 0
    except (ValueError, TypeError) as exc:  # a spec that does not fit the model: same on every rank
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USER_ERROR
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.INFRASTRUCTURE
    except RuntimeError as exc:  # a collective failed outside the training loop (the final barrier)
        if not is_comm_error(exc):
            raise
        print(f"error: {failure(job.out, rank, -1, exc)}", file=sys.stderr)
        return ExitCode.INFRASTRUCTURE
    except OSError as exc:  # a write the storage refused: the same one line as a single run's
        from sdcscope.common.storage import storage_cause

        if storage_cause(exc) is None:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.STORAGE
    except KeyboardInterrupt:  # a second SIGINT: stop at once, quietly
        return 128 + signal.SIGINT
    finally:
        leave_world()


if __name__ == "__main__":
    from sdcscope.jobs import torchrun as _module  # run the importable copy: one set of classes, not two

    code = _module.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter shutdown: no gloo thread can meet a half-finalized interpreter
