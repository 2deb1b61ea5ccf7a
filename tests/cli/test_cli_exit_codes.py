"""Exit codes a scheduler can use and plain progress lines without a terminal: a crashed run exits
CRASHED; a log gets periodic lines with step, loss, steps/s and ETA. (``sdcscope checkpoint verify``
on good, tampered and unsafe checkpoints: tests/reliability/test_bad_checkpoints.py.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.common.exitcodes import DESCRIPTIONS, ExitCode


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
