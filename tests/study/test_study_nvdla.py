"""The NVDLA MAC-cell study: one cell of an array serving every layer, permanent, evaluated with
the fault present and removed; channel swizzling as a pattern option, paired with the plain cell."""

import json

import pytest
import torch

from sdcscope.study import init_campaign, plan_campaign, run_campaign
from sdcscope.study.spec import load_campaign
from sdcscope.study.store import ResultsDB

CAMPAIGN = """
name: nvdla-tiny
workload: {name: cnn, preset: tiny}
inject_steps: [2]
horizon: 6
faults:
  sites: [gemm.forward]
  targets: [[conv2, "fc*"]]
  models: [stuck_at_0]
  bits: [28]
  patterns: [{kind: mac_cell, array: [4, 4], input_channel: 3, output_channel: 0},
             {kind: mac_cell, array: [4, 4], input_channel: 3, output_channel: 0, swizzle: per_step}]
  schedules: [{kind: permanent}]
baseline: {seeds: [1, 2]}
"""


def test_permanent_fault_campaign_evaluates_with_fault_present_and_removed(tmp_path):
    (tmp_path / "spec.yaml").write_text(CAMPAIGN)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        plain, swizzled = db.trials()
    assert (plain["swizzle"], swizzled["swizzle"]) == (0, 1)
    assert plain["target"] == swizzled["target"] == "conv2,fc1,fc2,fc3"  # one unit runs every GEMM
    assert plain["fault_seed"] == swizzled["fault_seed"]  # paired: the same physical cell
    assert "swizzle=per_step" in swizzled["pattern"] and "swizzle" not in plain["pattern"]
    for r in (plain, swizzled):
        # 4 modules x (6 training steps + the evaluation with the fault present)
        assert r["injections"] == 4 * 7
        assert r["val_acc_fault"] is not None and r["val_acc"] is not None
        assert r["val_loss_fault"] != r["val_loss"]  # the fault acts on evaluation when present
    assert plain["val_loss"] != swizzled["val_loss"]
    assert torch.isfinite(torch.tensor(plain["val_loss"]))


RANDOM_CELLS = """
name: nvdla-random
workload: {name: cnn, preset: tiny}
inject_steps: [0]
horizon: 2
faults:
  sites: [gemm.forward]
  targets: [[conv2, "fc*"]]
  models: [stuck_at_0]
  bits: [28]
  patterns: [PATTERN]
  schedules: [{kind: permanent}]
  repeats: 3
baseline: {seeds: [1, 2]}
"""


def test_plain_and_swizzled_campaigns_draw_the_same_random_cells():
    plain = RANDOM_CELLS.replace("PATTERN", "{kind: mac_cell, array: [4, 4]}")
    swizzled = RANDOM_CELLS.replace("PATTERN", "{kind: mac_cell, array: [4, 4], swizzle: per_step, swizzle_seed: 2}")
    a, b = (plan_campaign(load_campaign(text)) for text in (plain, swizzled))
    assert [t.fault_seed for t in a] == [t.fault_seed for t in b] and len({t.fault_seed for t in a}) == 3
    assert [t.swizzle for t in a] == [False] * 3 and [t.swizzle for t in b] == [True] * 3
    assert json.loads(b[0].pattern) == {
        "kind": "mac_cell",
        "array": [4, 4],
        "input_channel": "random",
        "output_channel": "random",
        "swizzle": "per_step",
        "swizzle_seed": 2,
    }
    assert b[0].fault_spec().target == ("conv2", "fc1", "fc2", "fc3")


def test_the_old_swizzle_dimension_points_to_the_pattern_option():
    text = CAMPAIGN.replace("  schedules:", "  swizzle: [false, true]\n  schedules:")
    with pytest.raises(ValueError, match=r"faults.swizzle \[False, True\] is a pattern option now.*per_step"):
        load_campaign(text)


PERMANENT_ROW = """
name: eval-rows
workload: {name: cnn, preset: tiny, batch_size: 512}
inject_steps: [0]
horizon: 1
faults:
  sites: [gemm.forward]
  targets: [fc3]
  models: [bitflip]
  bits: [30]
  patterns: [{kind: row, index: 400}]
  schedules: [SCHEDULE]
"""


def test_planning_checks_permanent_module_faults_against_the_evaluation_batches(tmp_path):
    """A trial evaluates with a permanent fault present, on validation batches of fewer rows than a
    training batch of 512: a row they lack is refused when the campaign is planned, before any
    trial runs -- a transient fault acts in training only and is fine."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(PERMANENT_ROW.replace("SCHEDULE", "{kind: permanent}"))
    with pytest.raises(ValueError, match="pattern row index 400 is out of range"):
        init_campaign(tmp_path / "perm", spec)
    assert not (tmp_path / "perm").exists()
    spec.write_text(PERMANENT_ROW.replace("SCHEDULE", "{kind: transient}"))
    init_campaign(tmp_path / "once", spec)
