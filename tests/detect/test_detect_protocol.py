"""The detector protocol: the built-ins are registered in the order the guard runs them, each
answers ``check(view)``, and a registration or a view is checked."""

import math
from dataclasses import fields

import pytest
import torch
from torch import nn

from sdcscope.detect import ABFTConfig, ABFTDetector, NonFiniteConfig, NonFiniteDetector, SpikeConfig, SpikeDetector
from sdcscope.detect.protocol import CheckView, Detector, Registration, register, registered, registration, unregister
from sdcscope.guard import GuardConfig

BUILT_INS = ["abft", "canary", "dispatch", "nonfinite", "loss_spike", "grad_spike", "collectives"]


def test_the_built_ins_are_registered_in_their_order():
    assert [r.name for r in registered()] == BUILT_INS
    flags = {r.name: (r.world_values, r.recheck, r.drain, r.rolls_back) for r in registered()}
    assert flags == {
        "abft": (False, True, True, False),  # hooks record the step: re-checked on a replay, drained on a void step
        "canary": (False, True, True, False),  # likewise (its section: detectors: {canary: ...})
        "dispatch": (False, True, True, False),  # likewise: MoE dispatch hooks
        "nonfinite": (True, True, False, False),
        "loss_spike": (True, False, False, True),  # windows of past values roll back with the model
        "grad_spike": (True, False, False, True),
        "collectives": (False, True, True, False),  # FSDP2 hooks record the step's collectives
    }
    config = GuardConfig(profile="full")
    sections = {f.name: getattr(config, f.name) for f in fields(config)}
    for reg in registered():  # each is configured by its own GuardConfig section (the canary: under detectors)
        if reg.name == "canary":
            assert config.detector_section(reg) is None and GuardConfig(detectors={"canary": {}}).detectors
            continue
        assert config.detector_section(reg) is sections[reg.name] and isinstance(sections[reg.name], reg.config)


def test_the_built_ins_are_detectors():
    model = nn.Linear(3, 2)
    config = GuardConfig(profile="full")
    built = {r.name: r.build(model, None, config.detector_section(r), 1) for r in registered()}
    assert all(isinstance(d, Detector) and d.rank == 1 for d in built.values())
    assert isinstance(built["abft"], ABFTDetector) and isinstance(built["nonfinite"], NonFiniteDetector)
    assert (built["loss_spike"].watch, built["grad_spike"].watch) == ("loss_value", "grad_norm")


def test_spike_check_view_reads_its_watched_value():
    legacy = SpikeDetector(SpikeConfig.grad_norm(warmup=3))
    viewed = SpikeDetector(SpikeConfig.grad_norm(warmup=3), watch="grad_norm")
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 50.0, 1.0]
    for step, v in enumerate(values):
        want = legacy.check(step, v)
        assert viewed.check(CheckView(step, loss_value=123.0, grad_norm=v)) == want
    assert want == [] and legacy.check(7, 60.0)[0].verdict == "spike"
    seen = viewed.seen
    assert viewed.check(CheckView(8, loss_value=1.0)) == [] and viewed.seen == seen  # no value: nothing learned
    with pytest.raises(ValueError, match=r"spike watch.*'loss'.*loss_value, grad_norm"):
        SpikeDetector(watch="loss")


def test_nonfinite_check_view_decides_from_the_world_values():
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    model.bias.grad[0] = math.nan
    det = NonFiniteDetector(model, NonFiniteConfig())
    finite = CheckView(4, torch.tensor(1.0), model, loss_value=1.0, grad_norm=2.0)
    assert det.check(finite) == []  # the prefilter: finite world values, no closer look
    (e,) = det.check(CheckView(4, torch.tensor(1.0), model, loss_value=1.0, grad_norm=math.nan))
    assert (e.step, e.module, e.evidence["params"]) == (4, "bias", ["bias"])
    (again,) = det.check(CheckView(4, torch.tensor(1.0), model, replay=True))  # a replay's re-check: in full
    assert again.to_dict() == e.to_dict()
    model.bias.grad.zero_()
    (e,) = det.check(CheckView(5, math.inf, model, loss_value=math.inf, grad_norm=2.0))
    assert e.evidence == {"what": "loss", "value": math.inf}


def test_nonfinite_names_finite_gradients_whose_norm_overflows():
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    det = NonFiniteDetector(model, NonFiniteConfig())
    sq = torch.tensor([1.0, math.inf], dtype=torch.float64)
    view = CheckView(2, 1.0, model, 1.0, math.inf, sq, ("weight", "bias"), own_overflow=True)
    (e,) = det.check(view)
    assert (e.module, e.evidence["what"], e.evidence["params"]) == (None, "grad_norm", ["bias"])
    assert det.check(CheckView(2, 1.0, model, 1.0, math.inf, sq, ("weight", "bias"))) == []  # another rank names them


def test_abft_check_view_reads_the_step():
    model = nn.Sequential(nn.Linear(4, 4))
    det = ABFTDetector(model, ABFTConfig()).attach()
    for step in range(2):
        det.begin_step(step)
        model(torch.randn(2, 4)).sum().backward()
        assert det.check(CheckView(step)) == []
    assert det.checks_run == 4  # forward and dW of both steps (the input needs no dX)
    det.detach()


def test_registrations_are_checked():
    with pytest.raises(ValueError, match=r"a detector 'abft' is registered already"):
        register(registration("abft"))
    with pytest.raises(
        ValueError, match=r"unknown detector 'nonfinit' \(did you mean 'nonfinite'\?\); registered: abft"
    ):
        unregister("nonfinit")
    with pytest.raises(ValueError, match=r"must be an identifier"):
        Registration("my detector", NonFiniteConfig, lambda *a: None)
    with pytest.raises(TypeError, match=r"config must be a dataclass type"):
        Registration("mine", dict, lambda *a: None)
    with pytest.raises(TypeError, match=r"build must be callable"):
        Registration("mine", NonFiniteConfig, None)
    with pytest.raises(TypeError, match=r"recheck=1 must be a boolean"):
        Registration("mine", NonFiniteConfig, lambda *a: None, recheck=1)
    with pytest.raises(TypeError, match=r"register takes a Registration"):
        register("mine")


def test_a_registration_named_after_another_guard_setting_is_refused():
    reg = register(Registration("metrics", NonFiniteConfig, lambda *a: None))
    try:
        with pytest.raises(ValueError, match=r"'metrics' is registered with NonFiniteConfig, but guard metrics"):
            GuardConfig().detector_section(reg)
    finally:
        unregister("metrics")
