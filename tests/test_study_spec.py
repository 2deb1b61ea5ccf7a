"""Campaign specs: parsing, normalization, hashing, refusals, fault-space expansion and sampling."""

import json

import pytest

from sdcscope.study import CampaignSpec, init_campaign, load_campaign, plan_campaign

BASE = """
name: t
workload: {name: gpt, preset: tiny, eval_batches: 1}
inject_steps: [4]
horizon: 3
faults:
  sites: [gemm.forward, gemm.grad_weight]
  targets: ["blocks.0.attn.*_proj", head]
  bits: ["0-3", 30]
sampling: {kind: exhaustive}
baseline: {seeds: [11, 12]}
"""


def test_defaults_and_hash_stability():
    spec = load_campaign(BASE)
    assert spec.golden_steps == 7 and spec.faults.bits == (0, 1, 2, 3, 30)
    assert spec.faults.models == ("bitflip",) and spec.analysis == "basic" and not spec.guard
    reordered = "# a comment\n" + BASE.replace("inject_steps: [4]\nhorizon: 3", "horizon: 3\ninject_steps: [4]")
    assert load_campaign(reordered).hash == spec.hash
    explicit = BASE.replace("horizon: 3", "horizon: 3\ngolden_steps: 7\nanalysis: basic")
    assert load_campaign(explicit).hash == spec.hash
    assert load_campaign(BASE.replace("horizon: 3", "horizon: 4")).hash != spec.hash
    assert CampaignSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).hash == spec.hash


BAD = [
    ("horizon: 3", "horizn: 3", ["horizn", "horizon"]),
    ("bits: [\"0-3\", 30]", "bits: [40]", ["bit 40", "0..31"]),
    ("bits: [\"0-3\", 30]", "bits: [30]\n  patterns: [{kind: element, index: 5}]\n  repeats: 3",
     ["faults.repeats=3", "identical runs", "'random'"]),
    ("bits: [\"0-3\", 30]", "bits: []", ["faults.bits", "empty"]),
    ("sites: [gemm.forward, gemm.grad_weight]", "sites: [gemm.fwd]", ["gemm.fwd", "gemm.forward"]),
    ("sites: [gemm.forward, gemm.grad_weight]", "sites: []", ["fault space would be empty"]),
    ("seeds: [11, 12]", "seeds: [11]", ["at least 2"]),
    ("horizon: 3", "horizon: 3\ngolden_steps: 5", ["golden_steps=5", ">= max(inject_steps) + horizon = 7"]),
    ("kind: exhaustive", "kind: everything", ["everything", "exhaustive"]),
    ("kind: exhaustive", "kind: stratified, n: 3", ["stratified", "by"]),
    ("name: gpt", "name: gtp", ["gtp", "gpt"]),
    ("inject_steps: [4]", "inject_steps: [4, 4]", ["distinct"]),
    ("bits: [\"0-3\", 30]", "bits: [1]\n  swizzle: true", ["faults.swizzle True", "pattern option",
                                                          "kind: mac_cell, swizzle: per_step"]),
    ("bits: [\"0-3\", 30]", "bits: [1]\n  patterns: [{kind: mac_cell, swizzle: yes}]",
     ["faults.patterns entry", "swizzle", "'none', 'per_step'"]),
    ("\"blocks.0.attn.*_proj\", head", "[]", ["faults.targets entries", "[]"]),
    ("name: t", "name: t\nworkload: [", ["malformed YAML"]),
]


@pytest.mark.parametrize("old,new,words", BAD)
def test_malformed_specs_are_refused(old, new, words):
    assert old in BASE
    with pytest.raises((ValueError, TypeError)) as err:
        load_campaign(BASE.replace(old, new))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_targets_matching_nothing_and_oversampling_are_refused(tmp_path):
    with pytest.raises(ValueError, match="blocks.7.attn.q_proj"):
        plan_campaign(load_campaign(BASE.replace('"blocks.0.attn.*_proj", head', "blocks.7.attn.q_proj")))
    with pytest.raises(ValueError, match="exceeds the 50 points"):
        plan_campaign(load_campaign(BASE.replace("kind: exhaustive", "kind: random, n: 51")))
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("head", "nothing_here"))
    with pytest.raises(ValueError, match="nothing_here"):
        init_campaign(tmp_path / "camp", bad)
    assert not (tmp_path / "camp").exists()  # nothing written on a refusal


def test_exhaustive_plan_expands_targets_and_pairs_seeds():
    plan = plan_campaign(load_campaign(BASE))
    assert len(plan) == 2 * 5 * 5  # sites x (q, k, v, o, head) x bits
    assert [t.trial_id for t in plan] == list(range(50))
    assert {t.target for t in plan} == {f"blocks.0.attn.{x}_proj" for x in "qkvo"} | {"head"}
    seeds = {}
    for t in plan:  # every bit of one (site, target) hits the same element
        seeds.setdefault((t.site, t.target), set()).add(t.fault_seed)
    assert all(len(s) == 1 for s in seeds.values()) and len(set().union(*seeds.values())) == 10
    spec = plan[0].fault_spec()
    assert spec.schedule.step == 4 and spec.bits == (plan[0].bit,)


def test_random_and_stratified_sampling_are_deterministic():
    rnd = BASE.replace("kind: exhaustive", "kind: random, n: 7, seed: 3")
    a, b = plan_campaign(load_campaign(rnd)), plan_campaign(load_campaign(rnd))
    assert len(a) == 7 and a == b
    assert plan_campaign(load_campaign(rnd.replace("seed: 3", "seed: 4"))) != a
    strat = plan_campaign(load_campaign(BASE.replace("kind: exhaustive", "kind: stratified, n: 10, by: [bit]")))
    assert sorted(t.bit for t in strat) == sorted([0, 1, 2, 3, 30] * 2)


def test_schedule_templates_anchor_at_the_injection_step():
    text = BASE.replace("bits: [\"0-3\", 30]", "bits: [1]\n  schedules: [{kind: permanent}, "
                                                 "{kind: intermittent, p: 1e-1, duration: 5}]")
    plan = plan_campaign(load_campaign(text))
    kinds = {t.fault_spec().schedule.kind: t.fault_spec().schedule for t in plan}
    assert kinds["permanent"].start == 4
    assert (kinds["intermittent"].start, kinds["intermittent"].stop, kinds["intermittent"].p) == (4, 9, 0.1)


def test_a_target_group_is_one_trial_hitting_every_module_it_matches():
    spec = load_campaign(BASE.replace('targets: ["blocks.0.attn.*_proj", head]',
                                      'targets: [["blocks.0.attn.*_proj", head], head]'))
    assert spec.faults.targets == (("blocks.0.attn.*_proj", "head"), "head")
    assert CampaignSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).hash == spec.hash
    plan = plan_campaign(spec)
    group = ",".join([f"blocks.0.attn.{x}_proj" for x in "qkvo"] + ["head"])
    assert len(plan) == 2 * 2 * 5 and {t.target for t in plan} == {group, "head"}
    t = next(t for t in plan if t.target == group)
    assert t.fault_spec().target == tuple(group.split(","))
    seeds = {(t.site, t.target): t.fault_seed for t in plan}
    assert seeds[("gemm.forward", group)] != seeds[("gemm.forward", "head")]
