"""Tampered and unsafe checkpoints: a file changed on disk, a file rewritten with its sha256 resealed
that does not load as a resume loads it (``weights_only=True``), a sharded ``rank0.pt`` of that
kind, a resume on another layout than the checkpoint's. ``sdcscope checkpoint verify`` checks what
a resume checks and fails (exit 2) naming any bad checkpoint; a resume passes over a bad newer
checkpoint for the newest good one, and a sharded one it cannot take is refused by name (exit 2,
a user error) before any rank starts, no rank blamed."""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from helpers import sharded_dist, sharded_resume
from sdcscope.cli import app
from sdcscope.common.exitcodes import ExitCode
from sdcscope.engine.rundir import periodic_dir
from sdcscope.engine.state import CheckpointError


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _reseal(checkpoint, name: str) -> None:
    """The manifest's sha256 of ``name`` made to match the file again (a tamper that covers its tracks)."""
    data = _manifest(checkpoint)
    data["files"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(data))


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_checkpoint_verify_checks_what_a_resume_checks_and_fails_on_any_bad_one(tmp_path):
    run = tmp_path / "r"
    assert invoke("train", "--steps", "4", "--batch-size", "2", "--checkpoint-every", "2", "--out", run).exit_code == 0
    result = invoke("checkpoint", "verify", run)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "step 4, 1 file(s) match their sha256 and load (weights_only), no guard" in text and "step 2," in text
    assert f"continues from {run / 'checkpoint'}" in text
    # sha256 right, but the file does not load as a resume loads it (weights_only=True): bad
    state = run / "checkpoint" / "state.pt"
    torch.save({"step": 4, "when": datetime.date(2026, 1, 1)}, state)
    _reseal(run / "checkpoint", "state.pt")
    for given in (run / "checkpoint", run):  # the checkpoint itself, and the run naming it
        bad = invoke("checkpoint", "verify", given)
        text = " ".join(bad.output.split())
        assert bad.exit_code == ExitCode.USER_ERROR, bad.output
        assert f"{state}' does not load with weights_only=True" in text, text
    assert f"1 of 2 checkpoints of '{run}' are bad: {run / 'checkpoint'}" in text, text
    assert f"continues from {periodic_dir(run, 2)}" in text  # what the resume below takes
    # a tampered file: named, and the command fails
    state.write_bytes(state.read_bytes()[:-4] + b"oops")
    bad = invoke("checkpoint", "verify", run)
    assert bad.exit_code == ExitCode.USER_ERROR and "does not match its manifest" in bad.output
    resumed = invoke("train", "--resume", run, "--steps", "4")  # the newest is tampered: the periodic one is taken
    assert resumed.exit_code == 0, resumed.output
    text = " ".join(resumed.output.split())
    assert f"skipped checkpoint {run / 'checkpoint'}" in text and "resuming from" in text and "(step 2)" in text


def _resume_with(out, **given):
    from sdcscope.jobs.torchrun import resume_job

    return resume_job(out, 4, dist_config=sharded_dist(), **given)


def test_tampered_shard_and_another_layout_are_refused_by_name(sharded_runs, tmp_path):
    """On a copy of the FSDP2 run of tests/sharded (two gloo ranks, 4 steps)."""
    run = tmp_path / "run"
    shutil.copytree(sharded_runs["pristine"], run)
    shutil.rmtree(run / "checkpoints")  # the final checkpoint is the only one

    # another layout than the checkpoint's: refused by name before any rank starts
    with pytest.raises(ValueError, match=r"--nproc 4: the run and its checkpoints are --nproc 2"):
        _resume_with(run, nproc=4)
    with pytest.raises(ValueError, match=r"--parallel tp: the run and its checkpoints are --parallel fsdp"):
        _resume_with(run, parallel="tp")
    edited = tmp_path / "edited"
    shutil.copytree(run, edited)
    config = json.loads((edited / "config.json").read_text())
    config["parallel"]["kind"] = "hsdp"
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"written by --parallel fsdp --nproc 2 .* not resharded"):
        sharded_resume(edited, 4)

    # one shard file changed on disk: verify and resume name it
    shard = run / "checkpoint" / "__1_0.distcp"
    _flip_a_byte(shard)
    with pytest.raises(CheckpointError, match=f"{shard}.*does not match its manifest"):
        sharded_resume(run, 4)
    got = invoke("checkpoint", "verify", run / "checkpoint")
    text = " ".join(got.output.split())
    assert got.exit_code == 2 and f"{shard}' does not match its manifest" in text, text
    _flip_a_byte(shard)  # restored: it verifies again, as a sharded checkpoint
    got = invoke("checkpoint", "verify", run)
    assert got.exit_code == 0, got.output
    text = " ".join(got.output.split())
    assert "5 file(s) match their sha256 and load (weights_only), sharded (torch.distributed.checkpoint, " in text
    assert "--parallel fsdp on 2 ranks)" in text
    assert f"train --resume {run} continues from {run / 'checkpoint'}" in text

    # rank0.pt rewritten with its sha256 resealed: it matches, but does not load with weights_only=True,
    # so the resume refuses it as a bad checkpoint (exit 2, the file named) before any rank starts
    rank0 = run / "checkpoint" / "rank0.pt"
    torch.save({"step": 4, "when": datetime.date(2026, 1, 1)}, rank0)
    _reseal(run / "checkpoint", "rank0.pt")
    with pytest.raises(CheckpointError, match=f"{rank0}' does not load with weights_only=True"):
        sharded_resume(run, 4)
    for args in (["train", "--resume", run, "--timeout", "20"], ["checkpoint", "verify", run]):
        got = invoke(*args)
        text = " ".join(got.output.split())
        assert got.exit_code == 2 and f"{rank0}' does not load with weights_only=True" in text, text
        assert "lost the world" not in text and "Traceback" not in text, text  # no rank started, none blamed
