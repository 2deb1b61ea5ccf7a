"""Sharded checkpoints (torch.distributed.checkpoint) of FSDP2, tensor-parallel and pipeline runs on
two gloo ranks: a run stopped after step k and resumed ends bitwise where the uninterrupted run ends; a
fault-tainted newer checkpoint is passed over for the verified one. (A tampered shard, another
layout and a rank file that fails the safe load: tests/reliability/test_bad_checkpoints.py.)"""

from __future__ import annotations

import json

import pytest

from helpers import sharded_resume
from sdcscope.engine.rundir import periodic_dir


def _summary(path) -> dict:
    return json.loads((path / "summary.json").read_text())


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_fsdp_run_resumed_from_its_periodic_checkpoint_ends_bitwise_as_uninterrupted(sharded_runs):
    # every rank wrote its own shard file; the manifest lists every file with its sha256
    manifest = _manifest(periodic_dir(sharded_runs["pristine"], 2))
    assert manifest["format"] == "sdcscope-dcp-checkpoint/1" and manifest["step"] == 2
    assert manifest["layout"] == {"parallel": "fsdp", "inner": 2, "world_size": 2}
    assert {"__0_0.distcp", "__1_0.distcp", "rank0.pt", "rank1.pt", ".metadata"} == set(manifest["files"])
    assert manifest["verified"] is None  # no guard watched
    assert _manifest(sharded_runs["pristine"] / "checkpoint")["step"] == 4

    killed = sharded_runs["killed"]
    assert sharded_runs["chosen"]["killed"] == periodic_dir(killed, 2)
    summary = _summary(killed)
    assert (summary["outcome"], summary["steps"]) == ("completed", 4)
    assert summary["param_sha256"] == sharded_runs["reference"]
    config = json.loads((killed / "config.json").read_text())
    assert config["resumes"] == [{"from_step": 2, "steps": 4}]
    metrics = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # the steps trained again replace their rows
    assert _manifest(killed / "checkpoint")["step"] == 4


@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_a_run_resumed_from_its_final_checkpoint_ends_bitwise_as_uninterrupted(sharded_runs, kind):
    """Tensor parallel, and a pipeline, whose stages hold different parameters: each stage gets its
    own optimizer groups back (a stage given another's loses their options)."""
    stopped = sharded_runs[f"{kind}_stopped"]
    assert sharded_runs["chosen"][f"{kind}_stopped"] == stopped / "checkpoint"
    assert _summary(stopped)["steps"] == 3
    assert _summary(stopped)["param_sha256"] == _summary(sharded_runs[f"{kind}_whole"])["param_sha256"]


def test_fault_tainted_newer_checkpoint_is_passed_over_for_the_verified_one(sharded_runs):
    tainted = sharded_runs["tainted"]
    # step 2 was verified by every rank's guard; the checkpoint after the reported fault was not
    assert _manifest(periodic_dir(tainted, 2))["verified"] is True
    assert _manifest(tainted / "checkpoint")["verified"] is False
    _, chosen, skipped = sharded_resume(tainted, 4)
    assert chosen == periodic_dir(tainted, 2)
    assert [p for p, _ in skipped] == [tainted / "checkpoint"] and "unresolved guard finding" in skipped[0][1]
