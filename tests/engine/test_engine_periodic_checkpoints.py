"""Periodic checkpoints: written every N steps, the newest K kept; a resume takes the newest one
that is complete and certified, says which newer ones it passed over and why, and removes what a
killed writer left; a checkpoint write the disk refuses keeps the old checkpoint whole. The memory
estimate refuses a batch that cannot fit, before any work."""

from __future__ import annotations

import errno
import json

import pytest

from sdcscope.common.storage import StorageError
from sdcscope.engine import Run, TrainConfig, load_checkpoint, save_checkpoint, verify_checkpoint
from sdcscope.engine.resources import check_memory, estimate_memory
from sdcscope.engine.rundir import CheckpointPolicy, choose_checkpoint, periodic_dir
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(batch_size=2, max_corpus_bytes=200_000)


def _run(out, every=2, keep=2, steps=7):
    run = Run(out, WORKLOAD, TrainConfig(), checkpoints=CheckpointPolicy(every=every, keep=keep))
    return run, run.train(steps)


def test_periodic_checkpoints_are_written_and_bounded(tmp_path):
    run, summary = _run(tmp_path / "r")
    periodic = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert periodic == ["step-00000004", "step-00000006"]  # every 2 steps, the 2 newest kept
    assert verify_checkpoint(periodic_dir(tmp_path / "r", 6))["verified"] is None  # no guard watched
    assert verify_checkpoint(tmp_path / "r" / "checkpoint")["step"] == 7


def test_resume_takes_the_newest_complete_certified_checkpoint(tmp_path):
    out = tmp_path / "r"
    _run(out, steps=7)
    final = out / "checkpoint"
    manifest = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**manifest, "verified": False}))  # written from tainted state
    newest = periodic_dir(out, 6)
    (newest / "manifest.json").unlink()  # a writer killed before its manifest
    (newest / ".state.pt.999999999.tmp").write_bytes(b"half")  # and its temporary file
    path, chosen, skipped = choose_checkpoint(out)
    assert path == periodic_dir(out, 4) and chosen["step"] == 4
    assert [(p.name, "verified: false" in why) for p, why in skipped] == [("checkpoint", True)]
    run = Run.resume(out)
    assert run.trainer.step == 4 and run.resumed_from == periodic_dir(out, 4)
    run.train(7)
    assert not list(out.rglob("*.tmp"))  # the dead writer's debris is gone
    assert verify_checkpoint(final)["step"] == 7


def test_a_refused_checkpoint_write_keeps_the_old_checkpoint_whole(tmp_path, monkeypatch):
    run, _ = _run(tmp_path / "r", every=0, steps=2)
    before = (tmp_path / "r" / "checkpoint" / "state.pt").read_bytes()
    import torch

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(StorageError, match="cannot write the checkpoint to .*state.pt.*No space left"):
        save_checkpoint(run.trainer.snapshot(), tmp_path / "r" / "checkpoint")
    monkeypatch.undo()
    assert (tmp_path / "r" / "checkpoint" / "state.pt").read_bytes() == before
    assert load_checkpoint(tmp_path / "r" / "checkpoint").step == 2
    assert not list((tmp_path / "r").rglob("*.tmp"))


def test_the_memory_estimate_scales_with_the_batch_and_refuses_what_cannot_fit():
    small = make_workload(WORKLOAD)
    large = make_workload(WorkloadConfig(batch_size=64, max_corpus_bytes=200_000))
    a, b = estimate_memory(small), estimate_memory(large)
    assert a.per_row == b.per_row > 0 and b.total - a.total == 2 * a.per_row * 62
    check_memory(large, available=b.total + 1)
    with pytest.raises(ValueError, match=r"--batch-size 64 needs about .* available: use --batch-size \d+ or less"):
        check_memory(large, available=b.total - 1)
    with pytest.raises(ValueError, match="on each of 4 ranks"):
        check_memory(large, processes=4, available=2 * b.total)
