"""Drift against the exact golden twin: a fault that moves the weights while the loss stays in the
healthy band is ``sdc:drift`` by the twin measure (not by the re-seed spread); a fault that leaves
only a rounding-level trace is not; both distances over time are in the rows and the report, and a
results database of the previous schema is migrated when opened."""

import sqlite3

import pytest

from sdcscope.study import init_campaign, run_campaign, write_report
from sdcscope.study.outcomes import TWIN_BOUND
from sdcscope.study.spec import load_campaign
from sdcscope.study.store import SCHEMA, ResultsDB

# A weight fault in a layer that learns: one row of the MLP's first Linear has exponent bit 24
# flipped (each element x4 or /4, by its exponent) -- a mid-exponent flip that scales a whole row;
# bit 0 of the same row (the last mantissa bit) is the control.
SPEC = """
name: drift
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 8
faults:
  sites: [weight]
  targets: [blocks.0.mlp.fc]
  models: [bitflip]
  bits: [0, 24]
  patterns: [{kind: row}]
  schedules: [{kind: transient}]
baseline: {seeds: [7, 8]}
"""


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    (root / "spec.yaml").write_text(SPEC)
    init_campaign(root / "c", root / "spec.yaml")
    run_campaign(root / "c", workers=0)
    return root / "c"


def _db(directory):
    return ResultsDB(directory / "results.sqlite", load_campaign(directory / "campaign.yaml"))


def test_a_weight_move_with_a_normal_loss_is_drift_by_the_twin(campaign):
    with _db(campaign) as db:
        rows, th = {r["bit"]: r for r in db.trials()}, db.thresholds()[3]
    moved, trace = rows[24], rows[0]
    # the loss stays within the healthy band on both loss measures ...
    assert moved["loss_excess"] <= th["loss_excess"] and moved["val_delta"] <= th["val_delta"]
    # ... the weights are farther from the twin than the bound, yet within the re-seeds' spread
    assert TWIN_BOUND < moved["dist_golden"] <= th["dist_golden"]
    assert (moved["outcome"], moved["sdc_kind"], moved["drift_twin"], moved["drift_spread"]) == ("sdc", "drift", 1, 0)
    assert trace["outcome"] in ("benign", "masked") and trace["drift_twin"] == 0
    assert trace["dist_golden"] < TWIN_BOUND
    for r in (moved, trace):  # both measures over time, one value per drift step
        assert len(r["drift"]) == len(r["disagree"]) == 8 and r["drift"][-1] == r["dist_golden"]
        assert all(0 <= d <= 1 for d in r["disagree"]) and r["disagree_final"] == r["disagree"][-1]
    assert all(d > TWIN_BOUND for d in moved["drift"])


def test_report_states_twin_and_spread_drift(campaign):
    write_report(campaign)
    md = (campaign / "report.md").read_text()
    section = md.split("## Drift against the exact golden twin")[1].split("\n## ")[0]
    assert f"twin bound ({TWIN_BOUND:g})" in section
    assert "| sdc:drift | 1 | 1 | 0 |" in section and "| healthy re-seeded | 2 |" in section
    assert "drift against the exact twin" in (campaign / "report.html").read_text()


def test_a_schema_1_database_is_migrated_and_reclassified(campaign, tmp_path):
    old = tmp_path / "c"
    old.mkdir()
    (old / "campaign.yaml").write_text((campaign / "campaign.yaml").read_text())
    src = sqlite3.connect(campaign / "results.sqlite")
    src.backup(dst := sqlite3.connect(old / "results.sqlite"))
    src.close()
    for col in ("disagree", "disagree_final", "drift_twin", "drift_spread"):  # as schema 1 wrote it
        dst.execute(f"ALTER TABLE trials DROP COLUMN {col}")
    dst.execute("ALTER TABLE baseline DROP COLUMN disagree")
    dst.execute("UPDATE trials SET effect='benign', sdc_kind=NULL, outcome='benign'")  # schema 1's verdict
    dst.execute("UPDATE meta SET value='1' WHERE key='schema'")
    dst.commit()
    dst.close()
    with _db(old) as db:
        rows, meta = {r["bit"]: r for r in db.trials()}, db.meta()
    assert meta["schema"] == str(SCHEMA)
    assert (rows[24]["outcome"], rows[24]["sdc_kind"], rows[24]["drift_twin"]) == ("sdc", "drift", 1)
    assert rows[24]["disagree"] is None and rows[0]["drift_twin"] == 0  # not measured then
