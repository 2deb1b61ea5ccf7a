"""Guarded campaigns: the spec's guard profile reaches every trial's Guard and is recorded; a fault
the guard must catch is stored as detected, by its detector, with its latency; detected /
recovered outcomes, false positives, the report's Guard section."""

import hashlib
import json
import sqlite3

import pytest

from helpers import campaign_db, ran_campaign
from sdcscope.study import write_report
from sdcscope.study.guarded import first_detection
from sdcscope.study.spec import CampaignSpec
from sdcscope.study.store import SCHEMA

SPEC = """
name: guarded
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 4
faults: {sites: [gemm.forward, gemm.grad_weight], targets: [blocks.0.mlp.fc], bits: [26, 30]}
baseline: {seeds: [5, 6]}
guard: GUARD
"""


def _campaign(root, guard: str, spec: str = SPEC):
    return ran_campaign(root, spec.replace("GUARD", guard))


_db = campaign_db


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Exponent flips in the forward product and the weight gradient of one layer, under the
    ``full`` profile: ABFT checks every GEMM every step, so each one must be caught in its step."""
    return _campaign(tmp_path_factory.mktemp("full"), "{profile: full}")


def test_guarded_campaign_records_detection(full):
    with _db(full) as db:
        rows, baselines = db.trials(), db.baselines()
    assert len(rows) == 4 and all(r["fired"] and r["activated"] for r in rows)
    for r in rows:
        assert (r["detected"], r["detector"], r["detect_step"], r["latency"]) == (1, "abft", 3, 0), r
        assert r["outcome"] in ("detected", "recovered") and r["guard_events"] >= 1
    assert [b["guard_events"] for b in baselines] == [0, 0]  # no false positive in a healthy run


def test_the_report_names_the_profile_measured_and_the_detectors(full):
    html, md = write_report(full)
    section = md.read_text().split("## Guard")[1].split("\n## ")[0]
    assert "| guard profile | full |" in section
    assert "| detection coverage (detected / activated) | 4/4 |" in section
    assert "| first detector (detected trials) | abft 4 |" in section
    assert "guard on, profile full" in html.read_text()
    with _db(full) as db:
        assert json.loads(db.meta()["spec"])["guard"] == {"profile": "full"}


def test_the_spec_profile_reaches_every_trials_guard(tmp_path):
    """``minimal`` has no ABFT: the faults ``full`` caught by checksum go unseen or are caught by
    another detector (a non-finite), and the stored spec says which profile was measured."""
    c = _campaign(tmp_path, "{profile: minimal}")
    with _db(c) as db:
        rows, meta = {(r["site"], r["bit"]): r for r in db.trials()}, db.meta()
    assert all(r["detector"] != "abft" for r in rows.values())
    assert rows["gemm.forward", 26]["detected"] == 0 and rows["gemm.forward", 26]["outcome"] != "detected"
    assert json.loads(meta["spec"])["guard"] == {"profile": "minimal"}
    assert "| guard profile | minimal |" in write_report(c)[1].read_text()


def test_a_schema_2_database_gets_the_detector_column(full, tmp_path):
    old = tmp_path / "c"
    old.mkdir()
    (old / "campaign.yaml").write_text((full / "campaign.yaml").read_text())
    src = sqlite3.connect(full / "results.sqlite")
    src.backup(dst := sqlite3.connect(old / "results.sqlite"))
    src.close()
    dst.execute("ALTER TABLE trials DROP COLUMN detector")  # as schema 2 wrote it
    dst.execute("UPDATE meta SET value='2' WHERE key='schema'")
    dst.commit()
    dst.close()
    with _db(old) as db:
        rows, meta = db.trials(), db.meta()
    assert meta["schema"] == str(SCHEMA) == "5"
    assert [r["detector"] for r in rows] == [None] * 4 and all(r["detected"] == 1 for r in rows)


def test_a_rollback_keeps_the_trials_loss_curve_aligned_with_the_golden_run(tmp_path):
    """The guard rolls a weight fault back and trains the steps again: the trial's curve keeps one
    loss per step (the last try), so a run that ends bitwise equal to golden has no loss excess."""
    spec = SPEC.replace("sites: [gemm.forward, gemm.grad_weight]", "sites: [weight]").replace("[26, 30]", "[30]")
    with _db(_campaign(tmp_path, "true", spec)) as db:
        (row,) = db.trials()
    assert row["guard_events"] and row["steps"] == 4
    assert row["masked"] == 1 and row["loss_excess"] == 0.0 and row["first_diff_step"] is None
    assert row["detected"] == 1 and row["detector"] == "state_checksum"


def test_detection_latency_counts_from_the_step_the_fault_first_fired():
    records = [{"step": 11, "when": None}, {"step": 13, "when": None}, {"step": 10, "when": "eval"}]
    events = [{"step": 9, "detector": "loss_spike"}, {"step": 11, "detector": "abft"}]
    assert first_detection(events, records) == (11, events[1])  # the step-9 event came before the fault
    assert first_detection(events[:1], records) == (11, None)
    assert first_detection(events, []) == (None, None)


# -- the spec's guard setting ------------------------------------------------------------------
BASE = {
    "workload": {"name": "gpt", "preset": "tiny"},
    "inject_steps": [2],
    "horizon": 2,
    "faults": {"sites": ["gemm.forward"], "targets": ["head"], "bits": [30]},
}


def spec(**kw) -> CampaignSpec:
    return CampaignSpec.from_dict({**BASE, **kw})


def test_the_guard_is_off_by_default_and_true_is_the_balanced_profile():
    off = spec()
    assert off.guard is False and off.guard_profile is None and off.guard_config() is None
    on = spec(guard=True)
    assert on.guard == {"profile": "balanced"} and on.guard_profile == "balanced"
    config = on.guard_config()
    assert config.profile == "balanced" and config.abft.layer_fraction == 0.05
    assert on.guard_config() is not config  # a fresh config per guarded run
    assert spec(guard={}).guard == spec(guard={"profile": "balanced"}).guard == on.guard


@pytest.mark.parametrize("profile", ["minimal", "balanced", "full"])
def test_a_campaign_chooses_its_profile(profile):
    s = spec(guard={"profile": profile})
    assert s.guard_profile == profile and s.guard_config().profile == profile
    assert CampaignSpec.from_dict(s.to_dict()) == s
    assert (s.guard_config().abft is None) == (profile == "minimal")


def test_a_campaign_guard_takes_the_whole_guard_mapping_with_the_profile_rule():
    s = spec(guard={"profile": "minimal", "abft": {"c": 9.0}, "replay": False})
    config = s.guard_config()
    assert config.profile == "minimal" and config.abft.c == 9.0 and config.abft.layer_fraction == 1.0
    assert config.replay is False
    assert s.to_dict()["guard"] == {"profile": "minimal", "abft": {"c": 9.0}, "replay": False}


def test_true_and_the_spelled_out_default_are_one_spec_with_the_hash_it_had_before_profiles():
    on = spec(guard=True)
    base = {k: on.to_dict()["baseline"][k] for k in ("seeds", "alpha")}  # as specs wrote it before twins
    before = json.dumps({**on.to_dict(), "guard": True, "baseline": base}, sort_keys=True, separators=(",", ":"))
    assert on.hash == hashlib.sha256(before.encode()).hexdigest()  # older results databases stay bound
    assert spec(guard={"profile": "balanced"}).hash == on.hash
    assert len({on.hash, spec(guard={"profile": "full"}).hash, spec().hash}) == 3


@pytest.mark.parametrize(
    "guard,error,needle",
    [
        ({"profile": "fast"}, ValueError, r"^guard: .*profile 'fast'.*minimal, balanced, full"),
        ("full", TypeError, r"guard must be true, false or a guard config mapping.*minimal, balanced, full.*'full'"),
        (None, TypeError, r"guard must be true, false or a guard config mapping.*got None"),
        (1, TypeError, r"guard must be true, false or a guard config mapping.*got 1"),
        ({"abtf": {}}, ValueError, r"^guard: .*'abtf'.*did you mean 'abft'"),
        ({"abft": {"c": -1}}, ValueError, r"^guard: guard abft: c=-1"),
        ({"metrics": {"path": "m.jsonl"}}, ValueError, r"guard.metrics.path='m.jsonl'.*parallel workers"),
        ({"invariants": "inv.yaml"}, ValueError, r"guard.invariants 'inv.yaml' must be an absolute path"),
    ],
)
def test_a_bad_campaign_guard_is_refused_naming_the_value_and_the_allowed_ones(guard, error, needle):
    with pytest.raises(error, match=needle):
        spec(guard=guard)


def test_a_run_report_names_the_guard_profile_the_run_recorded(tmp_path):
    from sdcscope.guard import GuardConfig
    from sdcscope.study.report import build_report

    config = {"workload": {"workload": "gpt", "preset": "tiny"}, "train": {"seed": 0}, "guard": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    assert "guard off" in build_report(tmp_path)["line"]
    recorded = {**config, "guard": GuardConfig(profile="minimal").to_dict()}  # as config.json records it
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    assert "guard on, profile minimal" in build_report(tmp_path)["line"]


def test_a_campaign_guard_from_read_only_mappings_is_stored_as_plain_json():
    from types import MappingProxyType as RO

    s = spec(guard=RO({"profile": "full", "abft": RO({"kinds": ("linear",)})}))
    assert s.guard == {"profile": "full", "abft": {"kinds": ["linear"]}}
    assert s.guard_config().abft.kinds == ("linear",) and json.loads(json.dumps(s.to_dict())) == s.to_dict()
