"""A campaign run's timing: the trials' efficiency against golden step time x steps run, and the
fixed costs apart; a run that trains no golden run (a resume) claims no efficiency."""

import pytest

from sdcscope.study import ResultsDB, init_campaign, load_campaign, run_campaign

SPEC = """
name: timing
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 3
faults: {sites: [gemm.forward], targets: [head], bits: [30, 2]}
sampling: {kind: random, n: 2, seed: 0}
baseline: {seeds: [101, 102]}
"""


def test_trial_efficiency_is_golden_step_times_steps_over_trial_time(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC)
    init_campaign(tmp_path / "c", tmp_path / "c.yaml")
    t = run_campaign(tmp_path / "c", workers=0)["timing"]
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        rows = db.trials()
    assert set(t["phases"]) == {"startup", "golden", "baseline", "twins", "trials"} and t["size"] == 1
    (w,) = t["workers"].values()  # one in-process worker ran every trial
    assert w["trials"] == 2 and w["steps"] == sum(r["steps"] for r in rows) == 6
    assert w["busy_s"] == pytest.approx(sum(r["wall_s"] for r in rows), abs=1e-3)
    g = t["golden"]
    assert 0 < g["step_s"] < g["wall_s"] and g["step_cpu_s"] > 0
    assert t["trials"]["efficiency"] == pytest.approx(g["step_s"] * 6 / w["busy_s"])
    assert t["trials"]["cpu_efficiency"] == pytest.approx(g["step_cpu_s"] * 6 / w["cpu_s"])
    assert 0 < t["busy_share"] <= 1
    again = run_campaign(tmp_path / "c", workers=0)["timing"]  # nothing left to run
    assert again["trials"]["efficiency"] is None and again["workers"] == {}
