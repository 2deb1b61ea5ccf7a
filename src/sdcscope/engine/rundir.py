"""The run directory contract (docs/architecture.md): config.json, metrics.jsonl, injections.jsonl,
events.jsonl, summary.json, ``checkpoint/`` (the state at the end of a session) and
``checkpoints/step-NNNNNNNN/`` (periodic checkpoints, the newest few kept) for resuming.

A resume takes the newest checkpoint that is complete (its manifest, written last, verifies its
files) and certified (not written from state a guard still held a finding against); the newer
ones it passes over are listed with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sdcscope.common.io import JsonlWriter, as_written, dumps, file_in_the_way, read_json, read_jsonl, write_json
from sdcscope.common.validate import build_config, check_non_negative, check_positive
from sdcscope.engine.state import MANIFEST_FILE, CheckpointError, TrainState, check_loadable, verify_checkpoint

__all__ = [
    "RUN_FILES",
    "LOG_FILES",
    "CHECKPOINT_DIR",
    "JsonlWriter",
    "as_written",
    "dumps",
    "read_json",
    "read_jsonl",
    "write_json",
    "check_new_run_dir",
    "has_checkpoint",
    "CheckpointPolicy",
    "checkpoint_candidates",
    "choose_checkpoint",
    "pick_checkpoint",
    "periodic_dir",
    "prune_checkpoints",
    "remove_incomplete_checkpoints",
    "remove_stale_temps",
]

RUN_FILES = ("config.json", "metrics.jsonl", "injections.jsonl", "events.jsonl", "summary.json")
LOG_FILES = ("metrics.jsonl", "injections.jsonl", "events.jsonl")
CHECKPOINT_DIR = "checkpoint"
PERIODIC_DIR = "checkpoints"
_STEP_DIR = re.compile(r"step-(\d+)")
UNCERTIFIED = "written from state with an unresolved guard finding (verified: false)"
_TEMP = re.compile(r"\..+\.(\d+)\.tmp")  # what common.io.atomic_path leaves when its process is killed


@dataclass(kw_only=True)
class CheckpointPolicy:
    """Periodic checkpoints of a run (``--checkpoint-every``, ``--keep-checkpoints``), recorded in
    its config.json and kept by a resume unless the resume gives another."""

    every: int = 100
    """Write ``checkpoints/step-N/`` every N optimizer steps (0: only at the end of a session)."""
    keep: int = 2
    """The newest complete periodic checkpoints kept (older ones are removed)."""

    def __post_init__(self) -> None:
        check_non_negative("checkpoint_every", self.every)
        check_positive("keep_checkpoints", self.keep)

    def to_dict(self) -> dict[str, int]:
        """As config.json records it (``checkpoints``), so that a resume keeps it."""
        return {"every": self.every, "keep": self.keep}

    @classmethod
    def recorded(cls, config: dict) -> CheckpointPolicy | None:
        """The policy a run's config.json records (None: a run from before it was recorded)."""
        data = config.get("checkpoints")
        return None if data is None else build_config(cls, data, "checkpoints")


def periodic_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / PERIODIC_DIR / f"step-{step:08d}"


def checkpoint_candidates(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint directory of the run with a manifest, ``(step, path)``, newest first; the
    step is the manifest's (a manifest that does not read sorts first: it is reported, not skipped)."""
    run_dir = Path(run_dir)
    dirs = [run_dir / CHECKPOINT_DIR]
    periodic = run_dir / PERIODIC_DIR
    if periodic.is_dir():
        dirs += [p for p in periodic.iterdir() if _STEP_DIR.fullmatch(p.name)]
    found = []
    for d in dirs:
        if not (d / MANIFEST_FILE).is_file():
            continue
        try:
            step = read_json(d / MANIFEST_FILE).get("step")
        except (OSError, ValueError):
            step = None
        found.append((step if isinstance(step, int) and not isinstance(step, bool) else 1 << 62, d))
    return sorted(found, key=lambda sp: (sp[0], sp[1].name == CHECKPOINT_DIR), reverse=True)


def choose_checkpoint(run_dir: str | Path) -> tuple[Path, dict, list[tuple[Path, str]]]:
    """The checkpoint a resume continues from (:func:`pick_checkpoint`), its manifest and the
    newer ones passed over with the reason."""
    path, manifest, skipped, _ = pick_checkpoint(run_dir)
    return path, manifest, skipped


def pick_checkpoint(run_dir: str | Path) -> tuple[Path, dict, list[tuple[Path, str]], TrainState | None]:
    """The newest checkpoint that is complete (its files match their manifest), certified and
    loads as a resume loads it (:func:`~sdcscope.engine.state.check_loadable`), its manifest,
    the newer ones passed over with the reason, and its state as loaded (None for a sharded
    one). When none qualifies, the newest one's own error is raised (a single tampered
    checkpoint is refused, not skipped)."""
    skipped: list[tuple[Path, str]] = []
    first_error: CheckpointError | None = None
    for _, path in checkpoint_candidates(run_dir):
        try:
            manifest = verify_checkpoint(path)
            if manifest.get("verified") is False:
                first_error = first_error or CheckpointError(f"checkpoint {str(path)!r} was {UNCERTIFIED}")
                skipped.append((path, UNCERTIFIED))
                continue
            return path, manifest, skipped, check_loadable(path, manifest)
        except CheckpointError as exc:
            first_error = first_error or exc
            skipped.append((path, str(exc)))
    if first_error is not None:
        if len(skipped) > 1:
            raise CheckpointError(
                f"no usable checkpoint in {str(run_dir)!r}: "
                + "; ".join(f"{p.relative_to(run_dir)}: {why}" for p, why in skipped)
            )
        raise first_error
    raise CheckpointError(f"no checkpoint in {str(run_dir)!r}")


def _certified(path: Path) -> bool:
    """A complete checkpoint a resume may take: its manifest reads and is not ``verified: false``."""
    try:
        return read_json(path / MANIFEST_FILE).get("verified") is not False
    except (OSError, ValueError):
        return False


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove periodic checkpoints beyond the ``keep`` newest complete ones -- except the newest
    certified one, which newer uncertified ones never push out (it is what a resume takes) -- and
    incomplete ones (no manifest: a writer was killed) older than the newest complete one; the
    removed paths."""
    periodic = Path(run_dir) / PERIODIC_DIR
    if not periodic.is_dir():
        return []
    dirs = sorted((int(m.group(1)), p) for p in periodic.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())
    complete = [(s, p) for s, p in dirs if (p / MANIFEST_FILE).is_file()]
    if not complete:
        return []
    kept = {p for _, p in complete[-keep:]}
    kept.update(next(([p] for _, p in reversed(complete) if _certified(p)), []))
    newest = complete[-1][0]
    removed = [p for s, p in dirs if p not in kept and s <= newest]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def remove_incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Remove periodic checkpoint folders without a manifest (their writer was killed); only for
    a run being resumed, whose own writer is this process. The removed paths."""
    periodic = Path(run_dir) / PERIODIC_DIR
    if not periodic.is_dir():
        return []
    removed = [p for p in periodic.iterdir() if _STEP_DIR.fullmatch(p.name) and not (p / MANIFEST_FILE).is_file()]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Remove the temporary files an atomic write of a killed process left in the run directory
    and its checkpoint directories (never one of a live process)."""
    run_dir = Path(run_dir)
    folders = [run_dir, run_dir / CHECKPOINT_DIR]
    if (run_dir / PERIODIC_DIR).is_dir():
        folders += [p for p in (run_dir / PERIODIC_DIR).iterdir() if p.is_dir()]
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            m = _TEMP.fullmatch(p.name)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process holds no temp across calls: one with its pid is a dead namesake's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` saved a checkpoint it can be resumed from (one with a manifest)."""
    return bool(checkpoint_candidates(run_dir))


def rank_injections_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a multi-process run logs its fired faults (merged by
    :func:`merge_injection_logs`)."""
    return Path(run_dir) / f"injections.rank{rank}.jsonl"


def merge_injection_logs(run_dir: str | Path, world_size: int) -> None:
    """Rebuild ``injections.jsonl`` whole from every rank's log, ordered by step, micro-batch and
    rank (call on one rank, once every rank's log is complete)."""
    records = [r for k in range(world_size) for r in read_jsonl(rank_injections_file(run_dir, k))]
    records.sort(key=lambda r: (r["step"], r["micro_batch"] or 0, r["rank"]))
    writer = JsonlWriter(Path(run_dir) / "injections.jsonl", append=False)
    writer.touch()
    for record in records:
        writer.write(record)
    writer.close()


def check_writable(path: Path, flag: str = "--out") -> None:
    """Refuse, before any work, an output ``path`` (a folder, or a file's path) that cannot be
    written (a read-only mount, a parent without write permission, /proc): tried with a probe
    folder made and removed at once in ``path``, or in its nearest existing parent."""
    anchor = path if path.is_dir() else next(p for p in path.absolute().parents if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sdcscope-probe-", dir=anchor))
    except OSError as exc:
        raise ValueError(
            f"{flag} {str(path)!r} cannot be written: {str(anchor)!r} refuses new files ({exc.strerror or exc})"
        ) from None


def check_new_run_dir(path: str | Path) -> Path:
    """A run may be written to a missing or empty folder only: never over another run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a file, not a folder")
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise ValueError(f"--out {str(path)!r} cannot be created: {str(blocker)!r} is a file, not a folder")
    check_writable(path)
    if path.is_dir() and any(path.iterdir()):
        if not (path / "config.json").exists():
            raise ValueError(f"--out {str(path)!r} already holds other files; give a new or empty folder")
        if has_checkpoint(path):
            raise ValueError(
                f"--out {str(path)!r} already holds another run; give a new or empty folder "
                f"(or continue that run: sdcscope train --resume {path} --steps N)"
            )
        raise ValueError(
            f"--out {str(path)!r} already holds another run, which saved no checkpoint and cannot "
            "be resumed; give a new or empty folder (or delete it)"
        )
    return path
