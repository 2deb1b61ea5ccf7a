"""Node profiles (``faults: {profiles: …}``): named fault spaces, one per unhealthy machine, whose
union a campaign samples; each trial tagged with its profile, the spec's errors naming the profile,
a spec of one fault space keeping its trial keys, and the report's three levels per profile."""

import pytest
import yaml

from helpers import campaign_db, ran_campaign
from sdcscope.study import write_report
from sdcscope.study.nodes import profile_levels
from sdcscope.study.plan import build_plan
from sdcscope.study.spec import CampaignSpec
from sdcscope.workloads import make_workload

SPEC = """
name: nodes
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 3
analysis: full
faults:
  profiles:
    lane:
      sites: [gemm.forward]
      targets: [["blocks.*.attn.*_proj"]]
      models: [bitflip]
      bits: [26]
      patterns: [{kind: mac_cell, array: [8, 8]}]
      schedules: [{kind: permanent}]
      repeats: 2
    idle:
      sites: [gemm.forward]
      targets: [head]
      models: [bitflip]
      bits: [10]
      schedules: [{kind: intermittent, p: 0.001}]
      repeats: 2
baseline: {seeds: [7, 8], twins: 3}
"""


def _spec(text: str = SPEC, **faults) -> CampaignSpec:
    data = yaml.safe_load(text)
    if faults:
        data["faults"] = faults
    return CampaignSpec.from_dict(data)


def _plan(spec: CampaignSpec):
    return build_plan(spec, make_workload(spec.workload_config()).build_model())


def test_each_trial_carries_its_profile_and_a_single_space_keeps_its_keys():
    plan = _plan(_spec())
    assert [t.profile for t in plan] == ["lane", "lane", "idle", "idle"]
    assert all(t.key.endswith(f"|profile={t.profile}") for t in plan)
    lane = _spec()
    one = _spec(**yaml.safe_load(SPEC)["faults"]["profiles"]["lane"])  # the lane alone, as one space
    plain = _plan(one)
    assert [t.profile for t in plain] == ["", ""] and all("profile" not in t.key for t in plain)
    assert [t.fault_seed for t in plain] == [t.fault_seed for t in _plan(lane)[:2]]  # the same draws
    assert "profiles" not in one.to_dict()["faults"]  # its hash and stored spec are as before


def test_sampling_stratified_by_profile_draws_from_every_profile():
    data = yaml.safe_load(SPEC)
    data["sampling"] = {"kind": "stratified", "by": "profile", "n": 2, "seed": 3}
    plan = _plan(CampaignSpec.from_dict(data))
    assert sorted(t.profile for t in plan) == ["idle", "lane"]


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"profiles": {}}, "must name at least one profile"),
        ({"profiles": {"a b": {"sites": ["gemm.forward"], "targets": ["head"], "bits": [1]}}}, "'a b' must be"),
        (
            {"profiles": {"n1": {"sites": ["gemm.forwrd"], "targets": ["head"]}}},
            "faults.profiles.n1: unknown faults.site 'gemm.forwrd'",
        ),
        ({"profiles": {"n1": {"sites": ["comm"], "targets": ["head"]}}}, "faults.profiles.n1: faults.sites"),
        ({"profiles": ["n1"]}, "must map profile names to fault spaces"),
        ({"profiles": {"n1": {}}, "sites": ["gemm.forward"]}, "each profile holds its own sites"),
    ],
)
def test_a_bad_profile_is_refused_naming_it(faults, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(")):
        _spec(**faults)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("targets", ["no_such_layer"], "faults.targets 'no_such_layer' for site"),
        ("schedules", [{"kind": "intermittent", "p": 0.0}], "fault space point gemm.forward on head .*never fires"),
    ],
)
def test_a_point_of_one_profile_that_cannot_run_is_refused_at_planning_naming_the_profile(key, value, message):
    data = yaml.safe_load(SPEC)
    data["faults"]["profiles"]["idle"][key] = value
    with pytest.raises(ValueError, match=f"^faults.profiles.idle: {message}"):
        _plan(CampaignSpec.from_dict(data))


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    return ran_campaign(tmp_path_factory.mktemp("nodes"), SPEC)


def test_the_three_levels_are_measured_and_reported_per_profile(campaign):
    with campaign_db(campaign) as db:
        rows, bounds = db.trials(), db.thresholds()
    assert [r["profile"] for r in rows] == ["lane", "lane", "idle", "idle"]
    lane, idle = profile_levels(rows, bounds)
    assert (lane["profile"], lane["trials"], lane["activated"]) == ("lane", 2, 2)
    assert lane["a_in_unit"] == 2 and min(lane["a_frequency"]) > 0  # the lane's unit diverges first
    assert min(lane["b_nsr_max"]) > 0 and lane["b_step_share"] == [1.0, 1.0]  # every step, permanently
    assert (idle["activated"], idle["a_in_unit"], idle["b_nsr_max"], idle["c_drift"]) == (0, 0, [0.0, 0.0], 0)
    assert lane["c_drift"] == sum(bool(r["drift_twin"]) for r in rows[:2])
    md = write_report(campaign)[1].read_text()
    section = md.split("## Node profiles: the three levels")[1].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| lane") or line.startswith("| idle")]
    assert len(lines) == 2 and lines[0].startswith("| lane | 2 | 2 | 2/2 |") and lines[1].startswith("| idle | 2 | 0 |")


def test_profile_levels_count_drift_with_a_healthy_looking_loss():
    base = dict.fromkeys(
        ("lockstep", "first_divergence", "nsr", "nsr_max", "sdc_kind", "effect", "dist_golden", "activated")
    )
    rows = [
        {
            **base,
            "profile": "p",
            "target": "fc",
            "inject_step": 5,
            "drift_twin": 1,
            "loss_excess": 0.1,
            "val_delta": 0.01,
            "nsr": ["inf", 0.0],
            "nsr_max": "inf",
        },
        {
            **base,
            "profile": "p",
            "target": "fc",
            "inject_step": 5,
            "drift_twin": 1,
            "loss_excess": 0.9,
            "val_delta": 0.01,
            "nsr": [0.0, 0.0],
            "nsr_max": 0.0,
        },
        {
            **base,
            "profile": "p",
            "target": "fc",
            "inject_step": 5,
            "drift_twin": 0,
            "loss_excess": 0.0,
            "val_delta": 0.0,
            "lockstep": {"fc": {"forward": {"frequency": 0.5, "severity": 2.0}}},
        },
    ]
    (s,) = profile_levels(rows, {5: {"loss_excess": 0.5, "val_delta": 0.02}})
    assert (s["c_drift"], s["c_drift_quiet_loss"]) == (2, 1)  # the second one's loss left the healthy spread
    assert s["b_step_share"] == [0.5, 0.0] and s["a_frequency"] == [0.5] and s["a_severity"] == [2.0]
