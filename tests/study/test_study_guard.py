"""guard: true campaigns: detected / recovered outcomes, latency, false positives (needs sdcscope.guard)."""

import pytest

from sdcscope.study import init_campaign, run_campaign, write_report
from sdcscope.study.guarded import first_detection
from sdcscope.study.spec import load_campaign
from sdcscope.study.store import ResultsDB

SPEC = """
name: guarded
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 4
faults: {sites: [gemm.forward, gemm.grad_weight], targets: [blocks.0.mlp.fc], bits: [30]}
baseline: {seeds: [5, 6]}
guard: true
"""


def _guard_available() -> bool:
    try:
        from sdcscope.guard import Guard, GuardConfig  # noqa: F401
    except ImportError:
        return False
    return True


def test_guard_campaign_without_guard_room_is_refused_clearly(tmp_path):
    if _guard_available():
        pytest.skip("sdcscope.guard is available")
    (tmp_path / "spec.yaml").write_text(SPEC)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    with pytest.raises(ValueError, match="sdcscope.guard is not available"):
        run_campaign(tmp_path / "c", workers=0)


def test_guarded_campaign_records_detection(tmp_path):
    if not _guard_available():
        pytest.skip("sdcscope.guard (Guard, GuardConfig) is not available yet")
    (tmp_path / "spec.yaml").write_text(SPEC)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        rows, baselines = db.trials(), db.baselines()
    assert all(r["detected"] in (0, 1) and r["guard_events"] is not None for r in rows)
    assert all(b["guard_events"] is not None for b in baselines)
    for r in rows:
        if r["detected"]:
            assert r["outcome"] in ("detected", "recovered") and r["latency"] == r["detect_step"] - 3 >= 0
    assert "## Guard" in write_report(tmp_path / "c")[1].read_text()


def test_a_rollback_keeps_the_trials_loss_curve_aligned_with_the_golden_run(tmp_path):
    """The guard rolls a weight fault back and trains the steps again: the trial's curve keeps one
    loss per step (the last try), so a run that ends bitwise equal to golden has no loss excess."""
    if not _guard_available():
        pytest.skip("sdcscope.guard is not available")
    (tmp_path / "spec.yaml").write_text(SPEC.replace("sites: [gemm.forward, gemm.grad_weight]", "sites: [weight]"))
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        (row,) = db.trials()
    assert row["guard_events"] and row["steps"] == 4
    assert row["masked"] == 1 and row["loss_excess"] == 0.0 and row["first_diff_step"] is None


def test_detection_latency_counts_from_the_step_the_fault_first_fired():
    records = [{"step": 11, "when": None}, {"step": 13, "when": None}, {"step": 10, "when": "eval"}]
    events = [{"step": 9, "detector": "loss_spike"}, {"step": 11, "detector": "abft"}]
    assert first_detection(events, records) == (11, events[1])  # the step-9 event came before the fault
    assert first_detection(events[:1], records) == (11, None)
    assert first_detection(events, []) == (None, None)
