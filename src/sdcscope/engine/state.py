"""Full training state: in-memory snapshots and sha256-verified on-disk checkpoints."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import reprlib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.io import read_json

CHECKPOINT_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_KEYS = ("format", "files", "step")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match its manifest."""


@dataclass
class TrainState:
    """Everything needed to continue a run bitwise: model, optimizer, RNG, step, data position."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    step: int
    data_pos: int
    lr_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "rng": self.rng,
            "step": self.step,
            "data_pos": self.data_pos,
            "lr_scale": self.lr_scale,
            "extra": self.extra,
        }


def clone_tree(obj: Any) -> Any:
    """A deep copy of nested dicts, lists and tuples whose tensors are cloned (detached): what
    ``copy.deepcopy`` gives for a state dict, without its per-tensor bookkeeping (a snapshot of
    the tiny GPT's Adam state: 0.3 ms instead of 8 ms)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def capture(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_pos: int,
    lr_scale: float = 1.0,
    extra: dict | None = None,
) -> TrainState:
    """Deep-copy the live training state (tensors cloned, so later updates don't leak in)."""
    return TrainState(
        model={k: v.detach().clone() for k, v in model.state_dict().items()},
        optimizer=clone_tree(optimizer.state_dict()),
        rng=torch.get_rng_state(),
        step=step,
        data_pos=data_pos,
        lr_scale=lr_scale,
        extra=copy.deepcopy(extra or {}),
    )


def apply(state: TrainState, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a state into live objects in place (parameters keep their identity, so hooks stay).
    The optimizer gets a copy: ``load_state_dict`` keeps tensors it need not convert, and the
    snapshot must stay as taken for the next restore."""
    with torch.no_grad():
        model.load_state_dict(state.model)
    optimizer.load_state_dict(clone_tree(state.optimizer))
    torch.set_rng_state(state.rng)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(state: TrainState, directory: str | Path, *, run: dict[str, Any] | None = None) -> Path:
    """Write ``state.pt`` and a ``manifest.json`` holding its sha256; atomic per file. ``run``: the
    configuration the state was trained with (JSON), kept in the manifest to check a resume against."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CHECKPOINT_FILE
    tmp = target.with_suffix(".tmp")
    torch.save(state.to_dict(), tmp)
    os.replace(tmp, target)
    manifest = {
        "format": "sdcscope-checkpoint/1",
        "files": {CHECKPOINT_FILE: _sha256(target)},
        "step": state.step,
        **({} if run is None else {"run": run}),
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, directory / MANIFEST_FILE)
    return directory


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's ``manifest.json``: refused when missing or malformed, or when it lacks a
    key or the sha256 of ``state.pt``."""
    manifest_path = Path(directory) / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"no checkpoint manifest at {str(manifest_path)!r}")
    try:
        manifest = read_json(manifest_path)
    except ValueError as exc:
        raise CheckpointError(f"corrupt checkpoint manifest: {exc}") from None
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    files, step = manifest.get("files"), manifest.get("step")
    bad_step = not isinstance(step, int) or isinstance(step, bool) or step < 0
    if missing or not isinstance(files, dict) or not isinstance(files.get(CHECKPOINT_FILE), str) or bad_step:
        problem = (
            f"it lacks {', '.join(map(repr, missing))}"
            if missing
            else f"its 'step' must be a non-negative integer, got {step!r}"
            if bad_step
            else f"its 'files' must map {CHECKPOINT_FILE!r} to its sha256, got {reprlib.repr(files)}"
        )
        raise CheckpointError(
            f"corrupt checkpoint manifest {str(manifest_path)!r}: {problem} (keys: "
            f"{', '.join(MANIFEST_KEYS)}); refusing a checkpoint that cannot be verified"
        )
    return manifest


def verify_checkpoint(directory: str | Path) -> None:
    """Refuse a checkpoint whose files are missing or whose sha256 differs from the manifest."""
    directory = Path(directory)
    for name, expected in read_manifest(directory)["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
        actual = _sha256(path)
        if actual != expected:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} does not match its manifest "
                f"(sha256 {actual[:12]}… != {str(expected)[:12]}…): refusing to load a tampered checkpoint"
            )


def load_checkpoint(directory: str | Path) -> TrainState:
    """Verify the manifest, then load with ``weights_only=True``."""
    verify_checkpoint(directory)
    path = Path(directory) / CHECKPOINT_FILE
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} does not load "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    keys = {f.name for f in fields(TrainState)}
    required = {f.name for f in fields(TrainState) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict) or not required <= data.keys() <= keys:
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(
            f"checkpoint file {str(path)!r} holds {got}, not a training state (keys: "
            f"{', '.join(sorted(required))}; optional: {', '.join(sorted(keys - required))})"
        )
    state = TrainState(**data)
    recorded = read_manifest(directory)["step"]
    if state.step != recorded:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} holds step {state.step}, its manifest says step "
            f"{recorded}: refusing a checkpoint that does not match its manifest"
        )
    return state


def param_sha256(model: nn.Module) -> str:
    """sha256 of the parameters' bytes in name order (names included)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
