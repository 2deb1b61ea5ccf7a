"""The NVDLA MAC-cell study: permanent faults evaluated with the fault present and removed; swizzling."""

import pytest
import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.study import SwizzledFault, init_campaign, run_campaign
from sdcscope.study.spec import load_campaign
from sdcscope.study.store import ResultsDB
from sdcscope.workloads import WorkloadConfig, make_workload

SPEC = FaultSpec(site="gemm.forward", target="conv2", model="stuck_at_1", bits=[28],
                 pattern={"kind": "mac_cell", "input_channel": 1, "output_channel": 3},
                 schedule={"kind": "permanent", "start": 0}, seed=4)


def test_swizzle_remaps_the_faulty_cell_every_step():
    trainer = Trainer(make_workload(WorkloadConfig(workload="cnn", preset="tiny")), TrainConfig())
    fault = SwizzledFault(trainer.model, SPEC, trainer.optimizer)
    cells = [fault.channels(s) for s in range(20)]
    assert cells == [fault.channels(s) for s in range(20)]  # deterministic
    assert len(set(cells)) > 5 and all(0 <= a < 8 and 0 <= b < 16 for a, b in cells)
    trainer.add_callback(fault)
    for _ in range(3):
        trainer.train_step()
    fault.close()
    w = trainer.model.conv2.weight
    for step, rec in zip(range(3), fault.records):  # each step's record hits W[b_t, a_t, :, :]
        a, b = fault.channels(step)
        assert rec["step"] == step and rec["count"] == 9
        assert {i // 9 for i in rec["index"]} == {b * w.shape[1] + a}
    with pytest.raises(ValueError, match="mac_cell"):
        SwizzledFault(trainer.model, FaultSpec(site="gemm.forward", target="conv2", model="zero",
                                               schedule={"kind": "permanent"}), trainer.optimizer)


CAMPAIGN = """
name: nvdla-tiny
workload: {name: cnn, preset: tiny}
inject_steps: [2]
horizon: 6
faults:
  sites: [gemm.forward]
  targets: [conv2]
  models: [stuck_at_0]
  bits: [28]
  patterns: [{kind: mac_cell, input_channel: 3, output_channel: 0}]
  schedules: [{kind: permanent}]
  swizzle: [false, true]
baseline: {seeds: [1, 2]}
"""


def test_permanent_fault_campaign_evaluates_with_fault_present_and_removed(tmp_path):
    (tmp_path / "spec.yaml").write_text(CAMPAIGN)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        plain, swizzled = db.trials()
    assert (plain["swizzle"], swizzled["swizzle"]) == (0, 1)
    for r in (plain, swizzled):
        assert r["injections"] >= 7  # every training step and the evaluation with the fault present
        assert r["val_acc_fault"] is not None and r["val_acc"] is not None
        assert r["val_loss_fault"] != r["val_loss"]  # the fault acts on evaluation when present
    assert plain["val_loss"] != swizzled["val_loss"]
    assert torch.isfinite(torch.tensor(plain["val_loss"]))
