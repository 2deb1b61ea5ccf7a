"""Drift against the exact golden twin: a fault that moves the weights while the loss stays in the
healthy band is ``sdc:drift`` by the twin measure -- beyond the perturbation twins' envelope (not
by the re-seed spread); a fault that leaves only a rounding-level trace is not; both distances over
time are in the rows and the report, with the twins, their envelope and their false-drift rate; a
results database of an older schema is migrated when opened (the fixed bound until the next
``campaign run`` adds the twins and relabels the stored trials without running them again), and
one that cannot be written still reports."""

import os
import shutil
import sqlite3

import pytest

from helpers import campaign_db, ran_campaign
from sdcscope.study import run_campaign, write_report
from sdcscope.study.drift import drift_section
from sdcscope.study.outcomes import TWIN_BOUND
from sdcscope.study.store import SCHEMA

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
    return ran_campaign(tmp_path_factory.mktemp("drift"), SPEC)


_db = campaign_db


def test_a_weight_move_with_a_normal_loss_is_drift_by_the_twin(campaign):
    with _db(campaign) as db:
        rows, th = {r["bit"]: r for r in db.trials()}, db.thresholds()[3]
    moved, trace = rows[24], rows[0]
    # the loss stays within the healthy band on both loss measures ...
    assert moved["loss_excess"] <= th["loss_excess"] and moved["val_delta"] <= th["val_delta"]
    # ... the weights are beyond the perturbation twins' envelope, yet within the re-seeds' spread
    assert th["dist_twin"] < moved["dist_golden"] <= th["dist_golden"]
    assert (moved["outcome"], moved["sdc_kind"], moved["drift_twin"], moved["drift_spread"]) == ("sdc", "drift", 1, 0)
    # one ulp of a whole row is a rounding-level trace: inside the envelope
    assert trace["outcome"] in ("benign", "masked") and trace["drift_twin"] == 0
    assert trace["dist_golden"] < th["dist_twin"] < TWIN_BOUND
    for r in (moved, trace):  # both measures over time, one value per drift step
        assert len(r["drift"]) == len(r["disagree"]) == 8 and r["drift"][-1] == r["dist_golden"]
        assert all(0 <= d <= 1 for d in r["disagree"]) and r["disagree_final"] == r["disagree"][-1]
    assert all(d > TWIN_BOUND for d in moved["drift"])


def test_report_states_twin_and_spread_drift(campaign):
    write_report(campaign)
    md = (campaign / "report.md").read_text()
    section = md.split("## Drift against the exact golden twin")[1].split("\n## ")[0]
    assert "envelope of the perturbation twins" in section
    assert "| sdc:drift | 1 | 1 | 0 |" in section
    # 4 twins, none beyond the others' envelope nor the re-seed spread; both re-seeds beyond the
    # chaos envelope (another data order), their leave-one-out spread not measurable with 2
    assert "| perturbation twins | 4 | 0 | 0 |" in section and "| healthy re-seeded | 2 | 2 | – |" in section
    assert "False-drift rate of the perturbation twins 0/4 = 0.0%" in section
    assert "dist_twin (the chaos envelope" in md.split("## Healthy-spread thresholds")[1].split("\n## ")[0]
    assert "drift against the exact twin" in (campaign / "report.html").read_text()


def _as_before_twins(campaign, old, schema: int):
    """A copy of ``campaign`` (golden snapshots included) whose database is as ``schema`` wrote
    it: no twins table, no envelope, no baseline labels; trials labelled against the fixed bound."""
    old.mkdir()
    shutil.copytree(campaign / "golden", old / "golden")
    (old / "campaign.yaml").write_text((campaign / "campaign.yaml").read_text())
    src = sqlite3.connect(campaign / "results.sqlite")
    src.backup(dst := sqlite3.connect(old / "results.sqlite"))
    src.close()
    dst.execute("DROP TABLE twins")
    dst.execute("DELETE FROM thresholds WHERE measure='dist_twin'")
    for col in ("drift_twin", "drift_spread"):
        dst.execute(f"ALTER TABLE baseline DROP COLUMN {col}")
    dst.execute("UPDATE meta SET value=? WHERE key='schema'", (str(schema),))
    dst.commit()
    return dst


def test_a_schema_1_database_is_migrated_and_reclassified(campaign, tmp_path):
    dst = _as_before_twins(campaign, old := tmp_path / "c", 1)
    for col in ("disagree", "disagree_final", "drift_twin", "drift_spread"):  # as schema 1 wrote it
        dst.execute(f"ALTER TABLE trials DROP COLUMN {col}")
    dst.execute("ALTER TABLE baseline DROP COLUMN disagree")
    dst.execute("UPDATE trials SET effect='benign', sdc_kind=NULL, outcome='benign'")  # schema 1's verdict
    dst.commit()
    dst.close()
    with _db(old) as db:
        rows, meta, twins = {r["bit"]: r for r in db.trials()}, db.meta(), db.twins()
    assert meta["schema"] == str(SCHEMA) and twins == []  # the fixed bound until the twins are run
    assert (rows[24]["outcome"], rows[24]["sdc_kind"], rows[24]["drift_twin"]) == ("sdc", "drift", 1)
    assert rows[24]["disagree"] is None and rows[0]["drift_twin"] == 0  # not measured then


def test_a_campaign_finished_before_twins_gains_them_without_running_its_trials(campaign, tmp_path):
    dst = _as_before_twins(campaign, old := tmp_path / "c", 3)
    dst.execute("UPDATE trials SET effect='sdc', sdc_kind='drift', outcome='sdc', drift_twin=1")  # a stale label
    dst.commit()
    dst.close()
    summary = run_campaign(old, workers=0)
    assert summary["ran"] == 0  # no trial ran again: the labels come from the stored measures
    with _db(campaign) as fresh, _db(old) as db:
        keys = ("outcome", "sdc_kind", "drift_twin", "drift_spread")
        assert [[r[k] for k in keys] for r in db.trials()] == [[r[k] for k in keys] for r in fresh.trials()]
        assert db.thresholds() == fresh.thresholds()  # the same twins (seeded), the same envelope
        assert [t["drift"] for t in db.twins()] == [t["drift"] for t in fresh.twins()]
        assert [b["drift_twin"] for b in db.baselines()] == [1, 1]


def test_a_database_before_twins_that_cannot_be_written_still_reports(campaign, tmp_path, monkeypatch):
    _as_before_twins(campaign, old := tmp_path / "c", 3).close()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(old)) else real(p, mode))
    with _db(old) as db:
        assert db.readonly
        _, _, rows, note = drift_section(db.trials(), db.baselines(), db.twins())
    assert f"the fixed twin bound ({TWIN_BOUND:g}; this database has no perturbation twins)" in note
    assert rows[-1][:4] == ["healthy re-seeded", 2, None, None]  # no labels in that schema
    assert ["sdc:drift", 1, 1, 0] in [r[:4] for r in rows]  # by the fixed bound
    with sqlite3.connect(old / "results.sqlite") as conn:  # nothing was written
        assert conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone() == ("3",)
