"""A guarded run the guard cannot repair (a stuck bit in the weights from step 12): it rolls back to
a recent verified snapshot, its stop line says why as the ledger has it and which state the run
ends on, and its progress lines follow the rollback instead of counting past it."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app

STUCK = """\
- site: weight
  target: blocks.1.mlp.fc.weight
  model: stuck_at_1
  bits: [30]
  pattern: {kind: element, index: 1234}
  schedule: {kind: permanent, start: 12}
  seed: 2
"""


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The run (14 steps, default snapshots; the device ledger calls the device faulty at its
    second suspicion, before the site has its 3 strikes): (exit code, output, run directory)."""
    tmp = tmp_path_factory.mktemp("guard_stops")
    (tmp / "stuck.yaml").write_text(STUCK)
    (tmp / "guard.yaml").write_text("ledger: {max_suspicions: 2}\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("SDCSCOPE_PROGRESS_SECONDS", "0")  # a progress line after every step
    try:
        args = ["train", "--steps", "14", "--batch-size", "4", "--faults", tmp / "stuck.yaml"]
        args += ["--guard-config", tmp / "guard.yaml", "--out", tmp / "run"]
        result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        mp.undo()
    return result.exit_code, result.output, tmp / "run"


def test_a_stop_says_why_as_the_ledger_has_it_and_which_state_the_run_ends_on(stopped):
    code, output, run = stopped
    assert code == 4, output  # ExitCode.GUARD_STOPPED
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_9 = [r for r in rows if r["step"] == 9 and not r["skipped"]][-1]
    # rolled back to the snapshot of step 10 (snapshots every 10 steps), not to the initial model
    assert (summary["steps"], summary["stopped_at_step"], summary["state_verified"]) == (10, 12, True), summary
    assert summary["final_train_loss"] == step_9["loss"]  # the state's loss, not the rolled-back step's nan
    ledger = json.loads((run / "ledger.json").read_text())
    (device,) = ledger["devices"].values()
    (site,) = device["sites"].values()
    assert device["faulty"] and not site["persistent"]  # faulty by its suspicions, not by a persistent site
    reason = summary["stop_reason"]
    assert "persistent fault at" not in reason and "is faulty (2 suspicions within" in reason, reason
    line = " ".join(output.split())
    assert f"error: the guard stopped the run at step 12: {reason}" in line, line
    assert "the run ends on the verified snapshot of step 10 (train loss " in line, line
    assert "stalled after 10 steps" in line


def test_progress_follows_a_rollback_and_never_overshoots(stopped):
    _, output, _ = stopped
    lines = [line for line in output.splitlines() if line.startswith("training: step ")]
    steps = [re.match(r"training: step (\d+)/(\d+),", line).groups() for line in lines]
    shown = [int(n) for n, _ in steps]
    assert {total for _, total in steps} == {"14"} and max(shown) <= 14, lines
    assert shown[:12] == list(range(1, 13)) and shown[12] == 10, shown  # the rollback of step 12: back to 10
    assert not any("ETA -" in line for line in lines), lines
