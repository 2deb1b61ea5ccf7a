"""Campaign specs: parsing, normalization, hashing, refusals, fault-space expansion and sampling."""

import json

import pytest

from sdcscope.study import CampaignSpec, init_campaign, load_campaign, plan_campaign
from sdcscope.study.spec import FaultSpace

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
    ('bits: ["0-3", 30]', "bits: [40]", ["bit 40", "0..31"]),
    (
        'bits: ["0-3", 30]',
        "bits: [30]\n  patterns: [{kind: element, index: 5}]\n  repeats: 3",
        ["faults.repeats=3", "identical runs", "'random'"],
    ),
    ('bits: ["0-3", 30]', "bits: []", ["faults.bits", "empty"]),
    ("sites: [gemm.forward, gemm.grad_weight]", "sites: [gemm.fwd]", ["gemm.fwd", "gemm.forward"]),
    ("sites: [gemm.forward, gemm.grad_weight]", "sites: []", ["fault space would be empty"]),
    ("seeds: [11, 12]", "seeds: [11]", ["at least 2"]),
    ("horizon: 3", "horizon: 3\ngolden_steps: 5", ["golden_steps=5", ">= max(inject_steps) + horizon = 7"]),
    ("kind: exhaustive", "kind: everything", ["everything", "exhaustive"]),
    ("kind: exhaustive", "kind: stratified, n: 3", ["stratified", "by"]),
    ("name: gpt", "name: gtp", ["gtp", "gpt"]),
    ("inject_steps: [4]", "inject_steps: [4, 4]", ["distinct"]),
    (
        'bits: ["0-3", 30]',
        "bits: [1]\n  swizzle: true",
        ["faults.swizzle True", "pattern option", "kind: mac_cell, swizzle: per_step"],
    ),
    (
        'bits: ["0-3", 30]',
        "bits: [1]\n  patterns: [{kind: mac_cell, swizzle: yes}]",
        ["faults.patterns entry", "swizzle", "'none', 'per_step'"],
    ),
    ('"blocks.0.attn.*_proj", head', "[]", ["faults.targets entries", "[]"]),
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
    text = BASE.replace(
        'bits: ["0-3", 30]', "bits: [1]\n  schedules: [{kind: permanent}, {kind: intermittent, p: 1e-1, duration: 5}]"
    )
    plan = plan_campaign(load_campaign(text))
    kinds = {t.fault_spec().schedule.kind: t.fault_spec().schedule for t in plan}
    assert kinds["permanent"].start == 4
    assert (kinds["intermittent"].start, kinds["intermittent"].stop, kinds["intermittent"].p) == (4, 9, 0.1)


def test_a_target_group_is_one_trial_hitting_every_module_it_matches():
    spec = load_campaign(
        BASE.replace('targets: ["blocks.0.attn.*_proj", head]', 'targets: [["blocks.0.attn.*_proj", head], head]')
    )
    assert spec.faults.targets == (("blocks.0.attn.*_proj", "head"), "head")
    assert CampaignSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).hash == spec.hash
    plan = plan_campaign(spec)
    group = ",".join([f"blocks.0.attn.{x}_proj" for x in "qkvo"] + ["head"])
    assert len(plan) == 2 * 2 * 5 and {t.target for t in plan} == {group, "head"}
    t = next(t for t in plan if t.target == group)
    assert t.fault_spec().target == tuple(group.split(","))
    seeds = {(t.site, t.target): t.fault_seed for t in plan}
    assert seeds[("gemm.forward", group)] != seeds[("gemm.forward", "head")]


@pytest.mark.parametrize("text", ["", "null\n", "[]\n", "- a\n", "5\n", "hello\n"], ids=repr)
def test_load_campaign_refuses_a_document_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "campaign.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"campaign\.yaml must hold a mapping \(a campaign spec\)"):
        load_campaign(path)


def test_campaign_refuses_a_pattern_that_one_of_its_sites_would_ignore():
    space = {
        "sites": ["gemm.forward", "activation"],
        "targets": ["*"],
        "models": ["zero"],
        "patterns": [{"kind": "mac_cell", "input_channel": 1, "output_channel": 2}],
    }
    with pytest.raises(
        ValueError,
        match=r"faults.patterns entry .* with faults.sites 'activation': pattern mac_cell "
        r"input_channel 1 has no meaning on site 'activation'",
    ):
        FaultSpace.from_dict(space)
    FaultSpace.from_dict({**space, "sites": ["gemm.forward", "weight"]})


@pytest.mark.parametrize(
    "site,pattern",
    [
        ("activation", {"kind": "mac_cell", "output_channel": 2}),  # input_channel 'random': unused
        ("gemm.grad_input", {"kind": "mac_cell", "input_channel": 2}),  # output_channel 'random': unused
        ("gemm.forward", {"kind": "mac_cell", "array": [4, 4], "input_channel": 1, "output_channel": 2}),
    ],
    ids=str,
)
def test_campaign_repeats_of_a_fault_that_draws_nothing_are_refused(site, pattern):
    space = {
        "sites": [site],
        "targets": ["*"],
        "models": ["bitflip"],
        "bits": [30],
        "patterns": [pattern],
        "repeats": 3,
    }
    with pytest.raises(ValueError, match=r"faults.repeats=3: every point of this fault space is one fixed fault"):
        FaultSpace.from_dict(space)


@pytest.mark.parametrize(
    "site,pattern",
    [
        ("activation", {"kind": "mac_cell"}),
        ("activation", {"kind": "mac_cell", "array": [4, 4]}),
        ("gemm.grad_input", {"kind": "mac_cell", "output_channel": "random"}),
        ("gemm.forward", {"kind": "mac_cell", "array": [4, 4], "input_channel": 1}),
    ],
    ids=str,
)
def test_campaign_repeats_of_a_fault_that_draws_are_accepted(site, pattern):
    FaultSpace.from_dict(
        {"sites": [site], "targets": ["*"], "models": ["bitflip"], "bits": [30], "patterns": [pattern], "repeats": 3}
    )


def test_two_spellings_of_one_pattern_or_schedule_are_one_fault_space_point():
    spec = load_campaign(
        BASE.replace(
            'bits: ["0-3", 30]',
            "bits: [30]\n  patterns: [{kind: element}, {kind: element, index: random}]\n"
            "  schedules: [{kind: transient}, {kind: transient}]",
        )
    )
    assert len(spec.faults.patterns) == 1 and len(spec.faults.schedules) == 1
    plan = plan_campaign(spec)
    assert len({t.key for t in plan}) == len(plan)  # every trial can be stored under its own key


def test_planning_errors_name_the_spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE.replace('targets: ["blocks.0.attn.*_proj", head]', "targets: [blocks.9.nothing]"))
    with pytest.raises(ValueError, match=rf"{path.name}'.*blocks.9.nothing"):
        init_campaign(tmp_path / "c", path)
    assert not (tmp_path / "c").exists()


def test_a_campaign_drops_and_duplicates_tokens_of_moe_dispatches_only():
    text = BASE.replace("name: gpt", "name: moe").replace(
        """  sites: [gemm.forward, gemm.grad_weight]
  targets: ["blocks.0.attn.*_proj", head]
  bits: ["0-3", 30]""",
        """  sites: [dispatch]
  targets: ["blocks.*.moe.dispatch"]
  models: [drop, duplicate]
  patterns: [{kind: row}]""",
    )
    plan = plan_campaign(load_campaign(text))
    assert sorted((t.target, t.model) for t in plan) == [
        (f"blocks.{b}.moe.dispatch", m) for b in (0, 1) for m in ("drop", "duplicate")
    ]
    assert plan[0].fault_spec().pattern.kind == "row"
    space = {"sites": ["dispatch"], "targets": ["*"], "models": ["drop"]}
    with pytest.raises(ValueError, match=r"hit one whole token slot: faults.patterns \[\{kind: row\}\]"):
        FaultSpace.from_dict(space)
    with pytest.raises(ValueError, match=r"need faults.sites \[dispatch\]"):
        FaultSpace.from_dict({**space, "sites": ["dispatch", "activation"], "patterns": [{"kind": "row"}]})
