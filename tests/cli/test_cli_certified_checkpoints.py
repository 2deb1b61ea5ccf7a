"""Checkpoint certification: a guarded run's checkpoints record whether the state was verified (no
unresolved finding since the last verified snapshot); ``--resume`` after a fault-tainted
checkpoint picks the newest verified one and names the newer ones it skipped and why."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.engine.rundir import periodic_dir

FAULT = """
- site: gemm.forward
  target: blocks.0.attn.q_proj
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: 5}
  schedule: {kind: transient, step: 3}
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _verified(path) -> bool | None:
    return json.loads((path / "manifest.json").read_text())["verified"]


def test_resume_after_a_tainted_checkpoint_picks_the_last_verified_one(tmp_path):
    (tmp_path / "faults.yaml").write_text(FAULT)
    (tmp_path / "guard.yaml").write_text(
        "profile: full\npolicy: {defaults: false}\n"
    )  # findings reported, never repaired
    run = tmp_path / "run"
    args = ["--batch-size", "2", "--checkpoint-every", "2", "--keep-checkpoints", "3"]
    trained = invoke(
        "train", "--steps", "8", *args, "--faults", tmp_path / "faults.yaml", "--guard-config", tmp_path / "guard.yaml",
        "--out", run,
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    # the flip at step 3 was found and only reported: every checkpoint after it is tainted
    assert [_verified(periodic_dir(run, s)) for s in (2, 4, 6)] == [True, False, False]
    assert _verified(run / "checkpoint") is False
    resumed = invoke("train", "--resume", run, "--steps", "8")
    assert resumed.exit_code == 0, resumed.output
    text = " ".join(resumed.output.split())
    for skipped in (run / "checkpoint", periodic_dir(run, 6), periodic_dir(run, 4)):
        assert f"skipped checkpoint {skipped}: written from state with an unresolved guard finding" in text, text
    assert f"resuming from {periodic_dir(run, 2)} (step 2)" in text


def test_newer_tainted_checkpoints_never_prune_away_the_last_verified_one(tmp_path):
    (tmp_path / "faults.yaml").write_text(FAULT)
    (tmp_path / "guard.yaml").write_text(
        "profile: full\npolicy: {defaults: false}\n"
    )  # findings reported, never repaired
    run = tmp_path / "run"
    args = ["--batch-size", "2", "--checkpoint-every", "2", "--keep-checkpoints", "2"]
    trained = invoke(
        "train", "--steps", "8", *args, "--faults", tmp_path / "faults.yaml", "--guard-config", tmp_path / "guard.yaml",
        "--out", run,
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    # the two newest (tainted) are kept, and the verified step 2 beside them; nothing else
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [periodic_dir(run, s).name for s in (2, 4, 6)]
    resumed = invoke("train", "--resume", run, "--steps", "8")
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming from {periodic_dir(run, 2)} (step 2)" in " ".join(resumed.output.split())
