"""Exit codes a scheduler can use, plain progress lines without a terminal, and ``sdcscope checkpoint
verify``: a crashed run exits CRASHED; a log gets periodic lines with step, loss, steps/s and ETA;
a checkpoint's files and certification are checked on demand."""

from __future__ import annotations

import datetime
import hashlib
import json

import torch
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.common.exitcodes import DESCRIPTIONS, ExitCode
from sdcscope.engine.rundir import periodic_dir


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_exit_codes_are_distinct_and_described():
    assert len({int(c) for c in ExitCode}) == len(ExitCode) and set(DESCRIPTIONS) == set(ExitCode)


def test_a_crashed_run_exits_crashed(tmp_path):
    result = invoke("train", "--steps", "6", "--batch-size", "2", "--lr", "1e30", "--out", tmp_path / "r")
    assert result.exit_code == ExitCode.CRASHED, result.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["outcome"] == "crash"
    assert "crash after" in result.output


def test_progress_without_a_terminal_prints_plain_lines(tmp_path):
    args = ["train", "--steps", "5", "--batch-size", "2", "--out", tmp_path / "r"]
    result = invoke(*args, env={"SDCSCOPE_PROGRESS_SECONDS": "0"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("training: step ")]
    assert [line.split(",")[0] for line in lines] == [f"training: step {k}/5" for k in range(1, 6)]
    assert all("loss " in line and "steps/s" in line and "ETA" in line for line in lines), lines


def _reseal(checkpoint) -> None:
    """The manifest's sha256 of ``state.pt`` made to match the file again (a tamper that covers its tracks)."""
    manifest = checkpoint / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["state.pt"] = hashlib.sha256((checkpoint / "state.pt").read_bytes()).hexdigest()
    manifest.write_text(json.dumps(data))


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
    _reseal(run / "checkpoint")
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
