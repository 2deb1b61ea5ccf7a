"""Checkpoints of a distributed run -- sharded (FSDP2, tensor parallel, FSDP×TP, HSDP) or data
parallel (DDP) -- through ``torch.distributed.checkpoint`` (DCP), under the contract of every
other checkpoint (:mod:`sdcscope.engine.state`, :mod:`sdcscope.engine.rundir`).

- **Files.** DCP's ``.metadata`` and shard files (``__R_K.distcp``: each rank writes what it holds,
  from ``get_state_dict`` of the model and optimizer; nothing is gathered, and a tensor every
  rank holds alike, a DDP replica's, is written once), ``rank{r}.pt`` (rank
  r's RNG state and the run's step, data position and guard state: LR scale, skipped data) and
  ``manifest.json`` (format :data:`~sdcscope.engine.state.DCP_FORMAT`: the sha256 of every
  file, the step, ``verified``, the layout and the run's identity).
- **Atomic.** Everything is written into a temporary folder beside the target; each rank hashes
  its own files, and after they all have, rank 0 writes the manifest and renames the folder into
  place (an old one of the same name is moved aside first, then removed). A writer killed midway
  leaves a temporary folder, never a checkpoint; :func:`remove_sharded_temps` clears it.
- **Certified.** ``verified`` is every rank's guard verdict (``state_verified``) reduced with a
  logical and: a world fact.
- **Resume.** :func:`choose_sharded` takes the newest complete, certified checkpoint whose
  ``rank{r}.pt`` files load with ``weights_only=True`` (:func:`~sdcscope.engine.rundir.choose_checkpoint`:
  checked before any rank starts, so a bad one is a user error naming the file) and refuses, by
  name, one written by another layout (``--parallel``, ``--nproc``): a sharded state is not
  resharded here. :func:`load_sharded` loads it with ``dcp.load`` and ``set_state_dict``, once
  every rank has loaded its own ``rank{r}.pt``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import reprlib
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdcscope.common.storage import writing
from sdcscope.engine.rundir import PERIODIC_DIR, choose_checkpoint
from sdcscope.engine.state import DCP_FORMAT, MANIFEST_FILE, CheckpointError, _safe_load, _sha256

log = logging.getLogger("sdcscope.engine.shardckpt")

__all__ = ["choose_sharded", "layout_of", "load_sharded", "remove_sharded_temps", "save_sharded"]

RANK_FILE = "rank{}.pt"
_TEMP_SUFFIX, _OLD_SUFFIX = ".dcp-tmp", ".dcp-old"


def layout_of(kind: str, inner: int, world: int) -> dict[str, Any]:
    """What a sharded checkpoint's files depend on: the parallel plan and the number of ranks."""
    return {"parallel": kind, "inner": inner, "world_size": world}


def _describe(layout: dict[str, Any]) -> str:
    inner = f" (inner {layout.get('inner')})" if layout.get("parallel") in ("fsdp+tp", "hsdp", "fsdp+ep") else ""
    return f"--parallel {layout.get('parallel')}{inner} --nproc {layout.get('world_size')}"


def _agree(error: Exception | None) -> None:
    """Every rank learns whether any rank failed its part and raises (no rank hangs in the next
    collective waiting for one that gave up): its own error as it was (a refused write stays a
    :class:`~sdcscope.common.storage.StorageError`), else a :class:`CheckpointError` naming the rank."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError("the checkpoint was not written: " + "; ".join(f"rank {r}: {e}" for r, e in failed))


def _attempt(fn, *args) -> Exception | None:
    """Run ``fn``; the error it raised (None: it succeeded)."""
    try:
        fn(*args)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        return exc
    return None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _verified_world(verified: bool | None, device: torch.device) -> bool | None:
    """Every rank's ``verified`` and-ed together (None: no guard watched; alike on every rank)."""
    if verified is None:
        return None
    flag = torch.tensor([int(bool(verified))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _rank_state(trainer) -> dict[str, Any]:
    """This rank's part of the run state beside the shards (what ``snapshot()`` carries beyond
    the model and optimizer)."""
    state = {
        "step": trainer.step,
        "data_pos": trainer.data_pos,
        "lr_scale": trainer.lr_scale,
        "skip_data": sorted(trainer.skip_data),
        "rng": torch.get_rng_state(),
        "optimizer_state": bool(trainer.optimizer.state),
    }
    if trainer.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(trainer.device)
    return state


def _options(trainer):
    """How the optimizer's state is keyed. In a pipeline, flattened: every state entry and group
    option under its parameter's name. Unflattened, a param group is saved under its index
    (``param_groups.0.params``), one key every rank writes, which DCP keeps once: a stage resumed
    with another stage's group loses the group's options. (Expert-parallel ranks' groups differ
    only in their experts' names, which the state entries carry, so their checkpoints keep the
    unflattened form they were written in.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=trainer.world.pipeline)


def _state_dict(trainer, optimizer: bool) -> dict[str, Any]:
    """The sharded model (and optimizer) state of ``trainer``, as DCP saves and loads it. An
    optimizer that has not stepped yet has no state and is left out: ``get_state_dict`` would
    build its state with a step (lr 0) that counts, and a resume would not be bitwise."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optimizer:
        return {"model": get_model_state_dict(trainer.model)}
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    return {"model": model_sd, "optim": optim_sd}


def _prepare(tmp: Path, old: Path) -> None:
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)


def _write_rank(trainer, tmp: Path, rank: int, digests: dict[str, str]) -> None:
    """``rank{r}.pt`` (fsynced), then the sha256 of it and of this rank's DCP shard files."""
    path = tmp / RANK_FILE.format(rank)
    with writing("the checkpoint's rank state", path), open(path, "wb") as fh:
        torch.save(_rank_state(trainer), fh)
        fh.flush()
        os.fsync(fh.fileno())
    for p in [*sorted(tmp.glob(f"__{rank}_*.distcp")), path]:
        digests[p.name] = _sha256(p)


def _publish(tmp: Path, target: Path, old: Path, manifest: dict[str, Any], hashed: dict[str, str]) -> None:
    """Rank 0: hash what no rank claimed (DCP's ``.metadata``), write the manifest last, rename."""
    files = dict(hashed)
    for p in sorted(tmp.iterdir()):
        if p.name not in files and p.is_file():
            files[p.name] = _sha256(p)
    if ".metadata" not in files:
        raise CheckpointError(f"torch.distributed.checkpoint wrote no .metadata in {str(tmp)!r}")
    manifest["files"] = {".metadata": files.pop(".metadata"), **dict(sorted(files.items()))}
    path = tmp / MANIFEST_FILE
    with writing("the checkpoint manifest", path), open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(manifest, indent=2, default=str))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    with writing("the checkpoint", target):
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_sharded(
    trainer,
    directory: str | Path,
    *,
    layout: dict[str, Any],
    run: dict[str, Any] | None = None,
    verified: bool | None = None,
) -> Path:
    """Write the state of ``trainer`` (a :class:`~sdcscope.engine.distributed.DistTrainer`, sharded or DDP)
    to ``directory`` on every rank (a collective; see the module docstring). ``verified``: this
    rank's guard verdict (None: no guard); ``run``: the run's identity, checked on resume."""
    import torch.distributed.checkpoint as dcp

    target = Path(directory)
    tmp = target.with_name(f".{target.name}{_TEMP_SUFFIX}")
    old = target.with_name(f".{target.name}{_OLD_SUFFIX}")
    rank = dist.get_rank()
    verified = _verified_world(verified, trainer.device)
    _agree(_attempt(_prepare, tmp, old) if rank == 0 else None)
    dcp.save(
        _state_dict(trainer, bool(trainer.optimizer.state)), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True)
    )
    digests: dict[str, str] = {}  # of the files this rank wrote
    _agree(_attempt(_write_rank, trainer, tmp, rank, digests))
    hashed: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hashed, digests)
    error = None
    if rank == 0:
        manifest = {
            "format": DCP_FORMAT,
            "files": {},
            "step": trainer.step,
            "verified": verified,
            "layout": layout,
            **({} if run is None else {"run": run}),
        }
        error = _attempt(_publish, tmp, target, old, manifest, {k: v for h in hashed for k, v in (h or {}).items()})
    _agree(error)
    return target


def remove_sharded_temps(run_dir: str | Path) -> list[Path]:
    """Remove the temporary folders a killed sharded writer left (rank 0 of a resumed run, before
    it writes: no other writer is alive); the removed paths."""
    run_dir = Path(run_dir)
    folders = [run_dir, run_dir / PERIODIC_DIR]
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.is_dir() and p.name.startswith(".") and p.name.endswith((_TEMP_SUFFIX, _OLD_SUFFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    if removed:
        log.info("removed what a killed checkpoint writer left: %s", ", ".join(map(str, removed)))
    return removed


def choose_sharded(
    run_dir: str | Path, layout: dict[str, Any], identity: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """The checkpoint a distributed resume continues from (:func:`choose_checkpoint`), its manifest
    and the newer ones passed over; refused (:class:`CheckpointError`) when its ranks did not
    write it, was written by another layout, or by another configuration (``identity``)."""
    from sdcscope.engine.run import _differences

    path, manifest, skipped = choose_checkpoint(run_dir)
    if manifest.get("format") != DCP_FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was not written by the ranks of a distributed run (format "
            f"{manifest.get('format')!r}, expected {DCP_FORMAT!r}); a distributed run resumes from the "
            "checkpoints its own ranks wrote"
        )
    written = manifest.get("layout") or {}
    if written != layout:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by {_describe(written)} and this resume runs "
            f"{_describe(layout)}: a sharded checkpoint is not resharded here; resume with {_describe(written)}"
        )
    diff = {} if identity is None or manifest.get("run") is None else _differences(identity, manifest["run"])
    if diff:
        raise CheckpointError(
            f"the run's config.json does not match checkpoint {str(path)!r}: "
            + "; ".join(
                f"{k} is {reprlib.repr(a)} but the checkpoint has {reprlib.repr(b)}" for k, (a, b) in diff.items()
            )
        )
    return path, manifest, skipped


def load_sharded(trainer, directory: str | Path, manifest: dict[str, Any]) -> None:
    """Load the checkpoint in ``directory`` (verified by the caller against ``manifest``) into
    ``trainer`` on every rank (a collective): shards through DCP, then this rank's own state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    directory = Path(directory)
    path = directory / RANK_FILE.format(dist.get_rank())
    loaded: dict[str, Any] = {}

    def load_rank_state() -> None:
        state = loaded["state"] = _safe_load(path)
        if not isinstance(state, dict) or state.get("step") != manifest["step"]:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} does not hold the state of step {manifest['step']} its manifest names"
            )

    _agree(_attempt(load_rank_state))  # every rank's own file first: none waits in DCP for one that gave up
    rank_state = loaded["state"]
    with_optimizer = rank_state.get("optimizer_state", True)
    state = _state_dict(trainer, with_optimizer)  # the templates DCP loads into
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    if with_optimizer:
        set_state_dict(
            trainer.model,
            trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_options(trainer),
        )
    else:
        set_model_state_dict(trainer.model, state["model"])
    trainer.step, trainer.data_pos = rank_state["step"], rank_state["data_pos"]
    trainer.lr_scale, trainer.skip_data = rank_state["lr_scale"], set(rank_state["skip_data"])
    torch.set_rng_state(rank_state["rng"])
    if "cuda_rng" in rank_state and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(rank_state["cuda_rng"], trainer.device)
