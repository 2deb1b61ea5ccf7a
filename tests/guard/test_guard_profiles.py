"""Guard profiles: what each sets, the balanced profile's rotation (every layer within its stated
bound, a function of seed and step), and escalation to full coverage after a finding."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.detect.abft.hooks import keep_last
from sdcscope.guard import GuardConfig
from sdcscope.guard.config import NOT_GIVEN, PROFILES
from sdcscope.workloads import WorkloadConfig, make_workload


def gpt():
    torch.manual_seed(0)
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2)).build_model()


def test_profiles_set_the_sections_left_unset_and_a_given_section_is_yours():
    assert GuardConfig(profile="minimal").abft is None
    bal = GuardConfig(profile="balanced").abft
    assert (bal.order, bal.layer_fraction, bal.escalate_steps) == ("rotation", 0.05, 10)
    full = GuardConfig(profile="full").abft
    assert full == ABFTConfig() and full.layer_fraction == 1.0
    mine = GuardConfig.from_dict({"profile": "balanced", "abft": {"c": 9.0}}).abft
    assert mine == ABFTConfig(c=9.0) and mine.layer_fraction == 1.0  # the section's defaults, not the preset's
    assert GuardConfig.from_dict({"profile": "minimal", "abft": {"every": 2}}).abft.every == 2
    again = GuardConfig.from_dict(GuardConfig(profile="balanced").to_dict())
    assert again.abft == bal and again.profile == "balanced"
    assert set(PROFILES) == {"minimal", "balanced", "full"}
    with pytest.raises(ValueError, match="profile 'fast'.*minimal, balanced, full"):
        GuardConfig(profile="fast")


@pytest.mark.parametrize("profile", ["minimal", "balanced", "full"])
def test_a_section_given_as_an_object_is_kept_even_when_it_equals_the_default(profile):
    """``ABFTConfig()`` given is not "left unset": every profile keeps it (full coverage), where
    the profile's preset would have switched ABFT off (minimal) or sampled 5 % (balanced)."""
    assert GuardConfig(profile=profile, abft=ABFTConfig()).abft == ABFTConfig()
    mine = GuardConfig(profile=profile, abft=ABFTConfig(c=9.0)).abft
    assert mine == ABFTConfig(c=9.0) and mine.layer_fraction == 1.0  # an object is complete
    assert GuardConfig(profile=profile, abft=None).abft is None


@pytest.mark.parametrize("profile", ["minimal", "balanced", "full"])
def test_a_section_given_as_a_mapping_means_what_the_same_object_means(profile):
    """``abft: {c: 9}`` and ``abft=ABFTConfig(c=9)`` are one config in every profile (the issue's
    complaint: the mapping took the profile's 5 % coverage, the object kept 1.0)."""
    assert GuardConfig.from_dict({"profile": profile, "abft": {}}).abft == ABFTConfig()
    mine = GuardConfig.from_dict({"profile": profile, "abft": {"c": 9.0}}).abft
    assert mine == GuardConfig(profile=profile, abft=ABFTConfig(c=9.0)).abft == ABFTConfig(c=9.0)
    assert GuardConfig(profile=profile, abft={"c": 9.0}).abft == mine  # the same mapping in Python
    assert GuardConfig.from_dict({"profile": profile, "abft": None}).abft is None


@pytest.mark.parametrize(
    "config",
    [
        GuardConfig(),
        GuardConfig(profile="minimal"),
        GuardConfig(profile="full"),
        GuardConfig(profile="minimal", abft=ABFTConfig()),
        GuardConfig(profile="balanced", abft=ABFTConfig(c=9.0, kinds=("linear",))),
        GuardConfig(profile="full", abft=None),
        GuardConfig.from_dict({"profile": "minimal", "abft": {"every": 2}}),
    ],
    ids=lambda c: f"{c.profile}-{None if c.abft is None else (c.abft.layer_fraction, c.abft.c)}",
)
def test_a_resolved_config_survives_config_json_and_replace(config):
    """What config.json records (``to_dict`` as JSON) loads back, as ``--resume`` does, to the
    same resolved config; ``dataclasses.replace`` keeps every section too."""
    recorded = json.loads(json.dumps(config.to_dict()))
    assert recorded["profile"] == config.profile
    assert GuardConfig.from_dict(recorded) == config
    assert dataclasses.replace(config) == config
    assert NOT_GIVEN not in vars(config).values()


def test_the_default_is_the_affordable_balanced_profile():
    """A guard built without a profile samples its GEMMs (the default a user leaves switched on);
    every GEMM every step is asked for by name."""
    default = GuardConfig()
    assert default.profile == "balanced"
    assert default.abft == GuardConfig(profile="balanced").abft and default.abft.layer_fraction == 0.05
    assert GuardConfig.from_dict(None).abft.layer_fraction == 0.05


def sixty(seed: int = 0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(60)])
    return model, ABFTDetector(model, dataclasses.replace(GuardConfig(profile="balanced").abft, seed=seed)).attach()


def test_balanced_checks_every_layer_within_its_stated_bound_and_a_replay_checks_the_same():
    """60 layers in B = ⌈1 / 0.05⌉ = 20 slots: 3 a step, each layer once in every 20 consecutive
    steps (a transient fault is checked in its step with probability 1/20, a persistent one within 20)."""
    model, det = sixty()
    assert det.coverage_bound() == (3, 20)
    assert det.coverage() == "ABFT checks every GEMM layer within 20 steps (3 of 60 a step)"
    chosen = []
    x = torch.randn(2, 4)
    for step in range(100):
        det.begin_step(step)
        chosen.append(det.active_layers)
        model(x)  # the forward alone: the checks of Y
        assert det.check(step) == []
        if step == 50:
            det.begin_step(step)  # a replay of the step just judged
            assert det.active_layers == chosen[-1]
            det.check(step)
    assert {len(c) for c in chosen} == {3}
    every = {x.name for x in det.layers}
    for start in range(100 - 20 + 1):  # any 20 consecutive steps check each layer exactly once
        window = [name for c in chosen[start : start + 20] for name in c]
        assert sorted(window) == sorted(every), start
    assert chosen[20:40] == chosen[:20]  # a fixed cycle of 20 steps
    _, fresh = sixty()
    for step in (73, 5, 99):  # a function of (seed, step, layers): out of order, a resumed run
        fresh.begin_step(step)
        assert fresh.active_layers == chosen[step]
    _, other = sixty(seed=1)
    other.begin_step(0)
    assert other.active_layers != chosen[0]  # another seed starts elsewhere in the rotation


def test_the_bound_is_logged_once_at_attach(caplog):
    with caplog.at_level(logging.INFO, logger="sdcscope.detect.abft"):
        _, det = sixty()
        det.detach()
        det.attach()
    said = [r.getMessage() for r in caplog.records if r.name == "sdcscope.detect.abft"]
    assert said == ["ABFT checks every GEMM layer within 20 steps (3 of 60 a step)"]


def test_a_layer_leaving_the_rotation_moves_no_other_layers_turn():
    """A layer found unreached is left out of its slot; every other layer keeps its turn, so the
    bound still holds for each (a rotation over the reached layers alone would shift them)."""
    model, det = sixty()
    turns = []
    for step in range(40):
        det.begin_step(step)
        turns.append(det.active_layers)
        det.check(step)
    gone = sorted(turns[10])[0]
    det.unreached.add(gone)
    for step in range(40):
        det.begin_step(step)
        assert det.active_layers == turns[step] - {gone}, step
        det.check(step)
    assert det.coverage_bound() == (3, 20)


def chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])


def test_escalation_checks_every_layer_on_the_replay_and_the_next_steps_then_samples_again():
    model, x = chain(), torch.randn(2, 4)
    det = ABFTDetector(model, ABFTConfig(layer_fraction=0.05, escalate_steps=3)).attach()
    every = frozenset(x.name for x in det.layers)

    def run(step):
        det.begin_step(step)
        armed = det.active_layers
        model(x).sum().backward()
        assert det.check(step) == []
        return armed

    run(10)
    det.escalate(3)  # what the guard calls on a spike or non-finite finding, before its replay
    assert det.active_layers == every  # step 11, armed: re-armed in full
    assert run(10) == every  # the replay of step 10
    assert [run(s) == every for s in (11, 12, 13, 14)] == [True, True, True, False]


def test_a_checksum_mismatch_in_a_sampled_step_escalates_by_itself():
    model = gpt()
    det = ABFTDetector(model, ABFTConfig(layer_fraction=0.05, escalate_steps=2)).attach()
    every = frozenset(x.name for x in det.layers)
    w = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))
    step = next(s for s in range(200) if (det.begin_step(s) or det.active_layers) and det.check(s) == [])
    det.begin_step(step)
    name = sorted(det.active_layers)[0]
    module = model.get_submodule(name)
    hook = module.register_forward_hook(lambda m, a, out: out * 1.5)  # every output of one sampled layer
    keep_last(next(x for x in det.layers if x.name == name))
    w.loss(model, w.batch(0, step)).backward()
    hook.remove()
    assert any(e.module == name for e in det.check(step))
    det.begin_step(step)  # its replay
    assert det.active_layers == every
