"""Perturbation twins, the chaos floor of ``sdc:drift``: the twin perturbation is one ulp of a
seeded random half of the weights; the envelope is the healthy-spread rule on log distances times
the margin; twins and re-seeds are tested leave-one-out; the spec knobs are validated and, at their
defaults, leave the spec hash as it was; and on a chaotic run, where a one-ulp change of one weight
outgrows the old fixed bound within the horizon, that trial stays inside the envelope at every
drift offset while the twins themselves are not called drift."""

import math

import pytest
import torch

from sdcscope.study import init_campaign, run_campaign
from sdcscope.study.outcomes import TWIN_BOUND
from sdcscope.study.spec import CampaignSpec, load_campaign
from sdcscope.study.stats import prediction_bound
from sdcscope.study.store import ResultsDB
from sdcscope.study.twins import envelope_bound, envelope_curve, perturb_twin, spread_flags, twin_flags


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))


def test_a_twin_changes_one_ulp_of_a_seeded_random_half_of_the_weights():
    base = _model()
    before = [p.detach().clone() for p in base.parameters()]
    changed = perturb_twin(base, 5, 0)
    total = sum(p.numel() for p in base.parameters())
    steps = torch.cat(
        [(p.detach().view(torch.int32) - b.view(torch.int32)).reshape(-1) for p, b in zip(base.parameters(), before)]
    )
    assert set(steps.abs().unique().tolist()) == {0, 1}  # one ulp or nothing, in the stored word
    assert int((steps != 0).sum()) == changed and 0.4 * total < changed < 0.6 * total
    again, other = _model(), _model()
    perturb_twin(again, 5, 0)
    perturb_twin(other, 5, 1)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), base.parameters()))  # seeded
    assert not all(torch.equal(a, b) for a, b in zip(other.parameters(), base.parameters()))  # per twin


def test_the_envelope_is_the_spread_rule_on_log_distances_times_the_margin():
    d = [1e-4, 2e-4, 4e-4, 3e-4]
    row = envelope_bound(d, 0.01, 2.0)
    logs = prediction_bound([math.log(x) for x in d], 0.01)
    assert row["bound"] == pytest.approx(2.0 * math.exp(logs["bound"]))
    assert row["bound"] > 2.0 * max(d) and row["n"] == 4 and row["max"] == max(d)
    assert row["mean"] == pytest.approx(math.exp(sum(map(math.log, d)) / 4))  # geometric
    assert envelope_bound([1e-4, 0.0, None], 0.01, 2.0) is None  # fewer than 2 positive distances
    curve = envelope_curve([{"drift": [x if x == d[0] else 0.0, x]} for x in d], 0.01, 2.0)
    assert curve[1] == pytest.approx(row["bound"]) and curve[0] is None  # offset 0: one positive distance


def test_twins_and_reseeds_are_each_tested_against_the_others():
    twins = [{"dist_golden": x} for x in (1e-4, 1.2e-4, 0.9e-4, 1e-2)]
    assert twin_flags(twins, 0.01, 2.0) == [0, 0, 0, 1]  # the outlier, left out, is beyond
    assert spread_flags([0.1, 0.11, 0.5], 0.01) == [0, 0, 1]
    assert spread_flags([0.1, 0.5], 0.01) == [None, None]  # one other: no spread to test against


SPEC = {
    "workload": {"name": "gpt", "preset": "tiny"},
    "inject_steps": [3],
    "horizon": 4,
    "faults": {"sites": ["weight"], "targets": ["head"], "bits": [0]},
}


@pytest.mark.parametrize(
    "baseline, message",
    [
        ({"twins": 2}, "baseline.twins must be in 3..64"),
        ({"twins": True}, "baseline.twins must be an int"),
        ({"twin_margin": 0.5}, "twin_margin must be a finite number >= 1"),
        ({"twin_margin": float("inf")}, "twin_margin must be a finite number >= 1"),
        ({"twin_margin": "2"}, "twin_margin must be a finite number >= 1"),
    ],
)
def test_bad_twin_knobs_are_refused(baseline, message):
    with pytest.raises((TypeError, ValueError), match=message):
        CampaignSpec.from_dict({**SPEC, "baseline": baseline})


def test_twin_knobs_at_their_defaults_keep_the_spec_hash():
    plain = CampaignSpec.from_dict(SPEC)
    spelled = CampaignSpec.from_dict({**SPEC, "baseline": {"twins": 4, "twin_margin": 2}})
    assert spelled.hash == plain.hash and spelled.space_hash == plain.space_hash
    assert CampaignSpec.from_dict({**SPEC, "baseline": {"twins": 5}}).hash != plain.hash
    assert CampaignSpec.from_dict({**SPEC, "baseline": {"twin_margin": 3}}).hash != plain.hash


# A chaotic run (learning rate 3e-2): one ulp of one weight of the MLP, followed for 32 steps,
# ends far beyond the old fixed bound of 0.01 -- and must not be sdc:drift at any offset.
CHAOTIC = """
name: chaos
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1, lr: 0.03}
inject_steps: [3]
horizon: 32
faults:
  sites: [weight]
  targets: [blocks.0.mlp.fc]
  models: [bitflip]
  bits: [0]
  patterns: [{kind: element}]
  schedules: [{kind: transient}]
baseline: {seeds: [7, 8]}
"""


def test_a_one_ulp_change_is_never_drift_at_any_horizon_on_a_chaotic_run(tmp_path):
    (tmp_path / "spec.yaml").write_text(CHAOTIC)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    spec = load_campaign(tmp_path / "c" / "campaign.yaml")
    with ResultsDB(tmp_path / "c" / "results.sqlite", spec) as db:
        trials, twins, th = db.trials(), db.twins(), db.thresholds()[3]
    envelope = envelope_curve(twins, spec.baseline.alpha, spec.baseline.twin_margin)
    assert len(trials) == 1 and len(twins) == 4 and envelope[-1] == pytest.approx(th["dist_twin"])
    for r in trials:
        assert r["activated"] and r["dist_golden"] > TWIN_BOUND  # the old bound called this drift
        assert all(d <= e for d, e in zip(r["drift"], envelope, strict=True))  # inside at every offset
        assert (r["outcome"], r["drift_twin"]) == ("benign", 0)
    assert [t["drift_twin"] for t in twins] == [0, 0, 0, 0]  # no false drift among the twins
