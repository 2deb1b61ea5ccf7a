"""Fault specs are validated before any work: shapes and formats (with a probe forward pass for
module sites), schedules that can never fire, optimizer state the optimizer never creates;
a spec error is never a crash; a fault that never fired is ``not_fired``, not ``masked``; the
checkpoint site decides firing in one place; YAML errors keep their position."""

import json
import warnings

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from helpers import cli_invoke, random_flip
from sdcscope.cli import app
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec, FaultSpecError, apply_spec, check_spec, load_specs
from sdcscope.inject import Injector, validate_specs
from sdcscope.inject.checkpoint import checkpoint_faults
from sdcscope.inject.probe import probe_model
from sdcscope.study import classify, init_campaign, load_campaign, plan_campaign, run_campaign
from sdcscope.study.experiment import Experiment
from sdcscope.study.store import ResultsDB
from sdcscope.workloads import WorkloadConfig, make_workload


def spec(site, target, pattern=None, schedule=None, **kw):
    return FaultSpec.from_dict(
        {
            "site": site,
            "target": target,
            "model": kw.pop("model", "bitflip"),
            "bits": kw.pop("bits", [3]),
            "pattern": pattern or {"kind": "element"},
            "schedule": schedule or {"kind": "transient", "step": 2},
            **kw,
        }
    )


class Setup:
    def __init__(self, name):
        self.workload = make_workload(WorkloadConfig(workload=name, preset="tiny", batch_size=2))
        self.trainer = Trainer(self.workload, TrainConfig(seed=0))
        batch = self.workload.batch(0, 0, 0)
        self.probe = probe_model(self.trainer.model, lambda m: self.workload.loss(m, batch))

    def validate(self, *specs, probe=True, **kw):
        return validate_specs(
            self.trainer.model, list(specs), self.trainer.optimizer, probe=self.probe if probe else None, **kw
        )


@pytest.fixture(scope="module")
def gpt():
    return Setup("gpt")


@pytest.fixture(scope="module")
def cnn():
    return Setup("cnn")


# ------------------------------------------------------------- 1. shapes and formats up front


@pytest.mark.parametrize(
    "site,target,pattern,words",
    [
        (
            "gemm.forward",
            "blocks.0.attn.q_proj",
            {"kind": "element", "index": 99999999},
            ["99999999", "[2, 64, 64]", "0..8191"],
        ),
        (
            "gemm.forward",
            "blocks.0.attn.q_proj",
            {"kind": "element", "index": [1, 2, 3, 4, 5]},
            ["5 dims", "[2, 64, 64]"],
        ),
        ("gemm.forward", "blocks.0.attn.q_proj", {"kind": "row", "index": 99999999}, ["row index 99999999", "0..127"]),
        ("gemm.grad_input", "blocks.0.mlp.fc", {"kind": "column", "index": 64}, ["column index 64", "0..63"]),
        ("activation", "blocks.0.attn.score", {"kind": "element", "index": [0, 0, 0]}, ["3 dims", "[2, 2, 64, 64]"]),
    ],
)
def test_module_site_shapes_are_checked_against_the_probe(gpt, site, target, pattern, words):
    bad = spec(site, target, pattern)
    gpt.validate(bad, probe=False)  # the shapes of a module site are not known statically
    with pytest.raises(FaultSpecError) as err:
        gpt.validate(bad)
    assert "fault spec #0" in str(err.value) and target in str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize(
    "setup,site,target,pattern,extra,words",
    [
        ("gpt", "weight", "head", None, {"format": "int8"}, ["int8", "fp32", "two float formats"]),
        ("gpt", "weight", "head", None, {"format": "int32"}, ["int32", "fp32"]),
        ("gpt", "gemm.forward", "blocks.0.attn.q_proj", None, {"format": "int8"}, ["int8", "fp32"]),
        ("cnn", "weight", "conv2", {"kind": "element", "index": [0, 9, 1, 1]}, {}, ["index[1] 9", "0..7"]),
        ("cnn", "weight", "conv2.bias", {"kind": "mac_cell"}, {}, [">= 2 dims", "[16]"]),
        ("cnn", "weight", "conv1", {"kind": "mac_cell", "input_channel": 3}, {}, ["input_channel 3", "0..0"]),
        (
            "cnn",
            "gemm.forward",
            "conv2",
            {"kind": "mac_cell", "input_channel": 8, "output_channel": 0},
            {},
            ["input_channel 8", "0..7"],
        ),
        (
            "cnn",
            "optimizer_state",
            "fc3",
            {"kind": "row", "index": 10},
            {"schedule": {"kind": "permanent"}},
            ["row index 10", "0..9"],
        ),
    ],
)
def test_known_shapes_and_dtypes_are_checked_without_a_probe(request, setup, site, target, pattern, extra, words):
    bad = spec(site, target, pattern, **extra)
    with pytest.raises(ValueError) as err:
        request.getfixturevalue(setup).validate(bad, probe=False)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_check_spec_is_the_check_apply_spec_makes():
    s = spec("weight", "w", {"kind": "element", "index": [1, 5]})
    check_spec(s, torch.float32, (2, 6))
    with pytest.raises(FaultSpecError, match="index\\[1\\] 5 is out of range"):
        check_spec(s, torch.float32, (2, 5))
    x = torch.ones(2, 5)
    with pytest.raises(FaultSpecError, match="index\\[1\\] 5 is out of range"):
        apply_spec(s, x, torch.Generator())
    assert torch.equal(x, torch.ones(2, 5))  # nothing changed
    with pytest.raises(FaultSpecError, match="bit 20 is out of range for bf16"):
        check_spec(spec("weight", "w", bits=[20]), torch.bfloat16)


def test_probe_leaves_the_model_and_rng_untouched(cnn):
    before = {k: v.clone() for k, v in cnn.trainer.model.state_dict().items()}
    rng = torch.get_rng_state()
    batch = cnn.workload.batch(0, 0, 0)
    calls = probe_model(cnn.trainer.model, lambda m: cnn.workload.loss(m, batch).backward())
    assert calls["conv2"][0].output.shape == (2, 16, 4, 4) and calls["conv1"][0].inputs[0].requires_grad is False
    assert all(torch.equal(v, before[k]) for k, v in cnn.trainer.model.state_dict().items())
    assert all(p.grad is None for p in cnn.trainer.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def _inject(tmp_path, text, *extra):
    (tmp_path / "faults.yaml").write_text(text)
    return CliRunner().invoke(
        app,
        [
            "inject",
            "--spec",
            str(tmp_path / "faults.yaml"),
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--out",
            str(tmp_path / "exp"),
            *extra,
        ],
    )


def test_inject_refuses_a_bad_pattern_before_any_output(tmp_path):
    result = _inject(
        tmp_path,
        "- {site: gemm.forward, target: blocks.0.attn.q_proj, model: bitflip, bits: [3],\n"
        "   pattern: {kind: element, index: 99999999}, schedule: {kind: transient, step: 2}}\n",
    )
    assert result.exit_code == 2, result.output
    assert "99999999" in result.output and "0..8191" in result.output
    assert not (tmp_path / "exp").exists()


def test_campaign_init_refuses_a_pattern_that_fits_no_tensor_and_writes_nothing(tmp_path):
    (tmp_path / "c.yaml").write_text(
        CAMPAIGN.replace("patterns: [{kind: element}]", "patterns: [{kind: element, index: 100}]")
    )
    with pytest.raises(FaultSpecError, match="fault space point weight on conv1 .*'conv1.weight'.*index 100.*0..71"):
        init_campaign(tmp_path / "c", tmp_path / "c.yaml")
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------- 2. a spec error is never a crash

CAMPAIGN = """
name: v
workload: {name: cnn, preset: tiny, eval_batches: 1}
inject_steps: [1]
horizon: 1
faults:
  sites: [weight]
  targets: [conv1]
  bits: [30]
  patterns: [{kind: element}]
baseline: {seeds: [11, 12]}
"""


def test_a_spec_error_in_a_trial_stops_the_campaign_instead_of_a_crash_row(tmp_path, monkeypatch):
    # A spec that slipped past planning (here: planning's checks switched off) fails when it fires.
    monkeypatch.setattr("sdcscope.study.plan.validate_spec", lambda *a, **k: [])
    text = (
        CAMPAIGN.replace("sites: [weight]", "sites: [gemm.forward]")
        .replace("targets: [conv1]", "targets: [fc3]")
        .replace("{kind: element}", "{kind: element, index: 999}")
    )
    (tmp_path / "c.yaml").write_text(text)
    init_campaign(tmp_path / "c", tmp_path / "c.yaml")
    with pytest.raises(FaultSpecError, match="trial 0 \\(gemm.forward on fc3.*index 999.*never recorded as a crash"):
        run_campaign(tmp_path / "c", workers=0)
    with ResultsDB(tmp_path / "c" / "results.sqlite", load_campaign(tmp_path / "c" / "campaign.yaml")) as db:
        assert db.trials() == []


# ------------------------------------------------------------- 3. faults that can never fire


@pytest.mark.parametrize(
    "site,schedule,kw,words",
    [
        ("gemm.forward", {"kind": "transient", "step": 500}, {"steps": 6}, ["step': 500", "steps 0..5", "6-step run"]),
        ("gemm.forward", {"kind": "permanent", "start": 6}, {"steps": 6}, ["start': 6", "steps 0..5"]),
        ("gemm.forward", {"kind": "intermittent", "p": 0.0}, {}, ["p 0 never fires", "(0, 1]"]),
        (
            "gemm.forward",
            {"kind": "transient", "step": 3, "micro_batch": 1},
            {"grad_accum": 1},
            ["micro_batch 1", "grad_accum=1", "0..0"],
        ),
        ("checkpoint", {"kind": "transient", "step": 0}, {}, ["step': 0", "steps >= 1", "written after a step"]),
        ("checkpoint", {"kind": "transient", "step": 7}, {"steps": 6}, ["steps 1..6"]),
        (
            "optimizer_state",
            {"kind": "intermittent", "p": 0.5, "start": 0, "stop": 1},
            {},
            ["steps >= 1", "after the first update"],
        ),
    ],
)
def test_schedules_that_never_fire_in_the_run_are_refused(gpt, site, schedule, kw, words):
    target = "head" if site in ("checkpoint", "optimizer_state") else "blocks.0.attn.q_proj"
    with pytest.raises(ValueError) as err:
        gpt.validate(spec(site, target, schedule=schedule), **kw)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    gpt.validate(spec(site, target, schedule={"kind": "transient", "step": 1}), steps=6, grad_accum=2)


def test_optimizer_state_keys_come_from_the_optimizer_configuration(gpt):
    model = gpt.trainer.model
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    wanted = spec("optimizer_state", "head", state_key="max_exp_avg_sq")
    with pytest.raises(
        ValueError, match="'max_exp_avg_sq' is never created by AdamW for 'head.weight'.*allowed: exp_avg, exp_avg_sq"
    ):
        gpt.validate(wanted)
    validate_specs(model, [wanted], amsgrad)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="SGD keeps no state tensor for 'head.weight'"):
        validate_specs(model, [spec("optimizer_state", "head")], sgd)
    validate_specs(
        model,
        [spec("optimizer_state", "head", state_key="momentum_buffer")],
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    )
    assert not amsgrad.state and not sgd.state  # the dry step ran on a twin optimizer


def test_the_probe_warns_about_targets_it_never_reached(gpt, cnn):
    with pytest.warns(UserWarning, match="activation on 'blocks'.*never called"):
        gpt.validate(spec("activation", "blocks"))
    with pytest.warns(UserWarning, match="gemm.grad_input on 'conv1'.*no input gradient dX"):
        cnn.validate(spec("gemm.grad_input", "conv*"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnn.validate(spec("gemm.grad_input", "conv2"))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch's: conv1's input needs no gradient
def test_an_experiment_whose_fault_never_fired_is_not_fired_not_masked(tmp_path):
    wcfg = WorkloadConfig(workload="cnn", preset="tiny", batch_size=4, eval_batches=1)
    with pytest.warns(UserWarning, match="conv1.*computed no input gradient dX"):
        experiment = Experiment(tmp_path / "e", wcfg, TrainConfig(seed=0), [spec("gemm.grad_input", "conv1")], steps=4)
    with pytest.warns(UserWarning, match="no fault fired"):
        comparison = experiment.run(4)
    assert comparison["outcome"] == "not_fired" and comparison["fired"] is False
    assert json.loads((tmp_path / "e" / "comparison.json").read_text())["outcome"] == "not_fired"


def test_run_checks_its_steps_before_writing_anything(tmp_path):
    wcfg = WorkloadConfig(workload="cnn", preset="tiny", batch_size=4, eval_batches=1)
    experiment = Experiment(tmp_path / "e", wcfg, TrainConfig(seed=0), [spec("weight", "fc1")])
    with pytest.raises(ValueError, match="step': 2.*steps 0..1 of this 2-step run"):
        experiment.run(2)
    assert not (tmp_path / "e").exists()


def test_a_trial_that_never_fired_is_not_fired_and_no_part_of_masking():
    thresholds = {"val_delta": 0.1, "loss_excess": 0.5, "dist_golden": 0.01}
    m = {
        "fired": 0,
        "crash": False,
        "masked": False,
        "loss_excess": 0.0,
        "val_delta": 0.0,
        "dist_golden": 0.0,
        "detected": 1,
    }
    assert classify(m, thresholds, guard=True) == {"effect": "not_fired", "sdc_kind": None, "outcome": "not_fired"}
    assert classify({**m, "fired": 1, "masked": True}, thresholds, guard=False)["effect"] == "masked"


@pytest.mark.parametrize(
    "old,new,words",
    [
        (
            "sites: [weight]",
            "sites: [checkpoint]",
            ["site 'checkpoint' is not supported in a campaign", "sdcscope inject"],
        ),
        ("sites: [weight]", "sites: [comm]", ["site 'comm' is not supported in a campaign"]),
    ],
)
def test_campaigns_refuse_sites_a_trial_cannot_inject(old, new, words):
    with pytest.raises(ValueError) as err:
        load_campaign(CAMPAIGN.replace(old, new))
    for word in words:
        assert word in str(err.value)


def test_campaign_plan_refuses_a_micro_batch_beyond_grad_accum():
    text = CAMPAIGN.replace(
        "patterns: [{kind: element}]", "patterns: [{kind: element}]\n  schedules: [{kind: transient, micro_batch: 1}]"
    )
    with pytest.raises(ValueError, match="micro_batch 1 never fires.*grad_accum=1"):
        plan_campaign(load_campaign(text))
    assert len(plan_campaign(load_campaign(text + "grad_accum: 2\n"))) == 1


# ------------------------------------------------------------- 4. checkpoint faults: one decision


def test_checkpoint_events_match_the_faults_that_fired(tmp_path):
    ck = {
        "site": "checkpoint",
        "target": "fc3.b*",
        "model": "bitflip",
        "bits": [30],
        "schedule": {"kind": "intermittent", "p": 0.5, "start": 1, "stop": 7},
    }
    wcfg = WorkloadConfig(workload="cnn", preset="tiny", batch_size=4, eval_batches=1)
    Experiment(tmp_path / "e", wcfg, TrainConfig(seed=0), [FaultSpec.from_dict(ck)], steps=6).run(6)
    faulty = tmp_path / "e" / "faulty"
    injected = [json.loads(x) for x in (faulty / "injections.jsonl").read_text().splitlines()]
    events = [json.loads(x)["step"] for x in (faulty / "events.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in injected]
    assert 0 < len(steps) < 6 and events == steps and {r["module"] for r in injected} == {"fc3.bias"}
    assert sorted(p.name for p in faulty.glob("checkpoint-*")) == sorted(f"checkpoint-{s}" for s in steps)
    # the decision is keyed on the tensor's name, never on the target pattern
    assert [s for s in range(1, 7) if checkpoint_faults([FaultSpec.from_dict(ck)], ["fc3.bias"], s)] == steps


# ------------------------------------------------------------- 5. YAML errors keep their position


def test_yaml_errors_name_the_problem_and_its_position(tmp_path):
    with pytest.raises(ValueError) as err:
        load_campaign("name: [x\nhorizon: 3\n")
    message = str(err.value)
    assert "malformed YAML in <text>" in message and "expected ',' or ']'" in message
    assert "line 1, column 7" in message and "\n" not in message
    (tmp_path / "f.yaml").write_text("- site: weight\n  target: [unbalanced\n")
    with pytest.raises(
        ValueError,
        match="f.yaml: expected ',' or ']'.* at line 3, column 1 "
        "\\(while parsing a flow sequence at line 2, column 11\\)",
    ):
        load_specs(tmp_path / "f.yaml")


def test_a_grad_weight_fault_is_checked_against_the_dtype_the_gemm_computes_in():
    """Under autocast the dW the fault lands on is bf16 (the call's own node, before the cast
    back to the fp32 weight): bit 29 does not exist there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().sum()

    probe = probe_model(model, loss)
    ok = spec("gemm.grad_weight", "2", {"kind": "element", "index": 3}, bits=[14])
    validate_specs(model, [ok], opt, steps=6, probe=probe)
    with pytest.raises(FaultSpecError, match="bit 29 is out of range for bf16"):
        validate_specs(
            model,
            [spec("gemm.grad_weight", "2", {"kind": "element", "index": 3}, bits=[29])],
            opt,
            steps=6,
            probe=probe,
        )


@pytest.mark.parametrize("site, target", [("param_grad", "0.weight"), ("gemm.grad_weight", "0")])
def test_a_gradient_fault_on_a_frozen_parameter_is_refused_up_front(site, target):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    spec = FaultSpec.from_dict(
        {"site": site, "target": target, "model": "bitflip", "bits": [30], "schedule": {"kind": "transient", "step": 0}}
    )
    with pytest.raises(ValueError, match=r"'0(\.weight)?' is frozen \(requires_grad=False\)"):
        Injector(model, [spec], torch.optim.SGD(model.parameters(), 0.1))


def test_module_site_faults_that_never_fire_are_named_at_detach():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            return self.attn(h, h, h)[0]

    model = M()
    specs = [
        random_flip("gemm.forward", "attn.out_proj", 1),
        random_flip("gemm.grad_input", "inp", 1),
        random_flip("gemm.forward", "inp", 1),
        random_flip("gemm.forward", "inp", 9),
    ]  # fires; not reached
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Injector(model, specs) as inj:
            for step in range(3):
                inj.set_position(step)
                model(torch.randn(2, 5, 8)).sum().backward()
    msgs = [str(w.message) for w in seen if "never fired" in str(w.message)]
    assert [r["spec"] for r in inj.records] == [2]
    assert len(msgs) == 2
    assert (
        msgs[0].startswith(
            "fault spec #0 (gemm.forward on 'attn.out_proj') never fired, though its schedule "
            "covered step 1 on: the module was never called"
        )
        and "F.linear" in msgs[0]
    )
    assert msgs[1].startswith("fault spec #1 (gemm.grad_input on 'inp') never fired") and "first layer" in msgs[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a campaign reports such a trial as not_fired instead
        with Injector(model, specs[:1], warn_unfired=False) as inj:
            inj.set_position(1)
            model(torch.randn(2, 5, 8))


runner = CliRunner()


def _spec(site, target, bits=(20,), pattern=None, step=1):
    return FaultSpec.from_dict(
        {
            "site": site,
            "target": target,
            "model": "bitflip",
            "bits": list(bits),
            "pattern": pattern or {"kind": "element"},
            "schedule": {"kind": "transient", "step": step},
        }
    )


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _autocast_forward(model):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(torch.randn(5, 8)).float().pow(2).mean()


@pytest.mark.parametrize(
    "site,target", [("activation", "0"), ("gemm.forward", "0"), ("gemm.grad_input", "2"), ("gemm.grad_weight", "0")]
)
def test_runtime_misfit_names_spec_module_and_dtype(site, target):
    """Bit 20 fits the fp32 model but not the bf16 tensors autocast computes: without a probe this is
    only known when the fault fires; the error then says which spec, site, module, dtype and step."""
    model = _model()
    inj = Injector(model, [_spec(site, target)])  # fp32 parameters: accepted
    with inj, pytest.raises(FaultSpecError) as err:
        for step in range(2):
            inj.set_position(step, 0)
            _autocast_forward(model).backward()
    text = str(err.value)
    for word in ("fault spec #0", site, repr(target), "bfloat16", "step 1", "bit 20", "0..15", "probe"):
        assert word in text, text


def test_injector_probe_refuses_before_training():
    model = _model()
    with pytest.raises(FaultSpecError, match=r"fault spec #0 \(activation on 0\).*bit 20.*bf16.*0\.\.15"):
        Injector(model, [_spec("activation", "0")], probe=probe_model(model, _autocast_forward))


def test_attach_rechecks_parameters_cast_since_construction():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    for site in ("weight", "param_grad", "optimizer_state"):
        inj = Injector(model.float(), [_spec(site, "0")], optimizer)  # fits fp32
        model.to(torch.bfloat16)
        with pytest.raises(FaultSpecError, match=r"bit 20 is out of range for bf16; allowed: 0\.\.15"):
            inj.attach()
        assert not inj._attached and not inj._spec_handles


@pytest.mark.parametrize(
    "pattern",
    [
        {"kind": "pe", "array": [1000, 1000], "pe": [999, 999]},
        {"kind": "pe", "array": [4, 100], "pe": [0, 99]},
        {"kind": "mac_cell", "array": [128, 128], "input_channel": 100},
    ],
)
def test_idle_fixed_pe_or_cell_is_refused(pattern):
    model = _model()  # weight of "0": [16, 8]
    site = "gemm.forward" if pattern["kind"] == "mac_cell" else "weight"
    with pytest.raises(FaultSpecError, match="idle"):
        validate_specs(model, [_spec(site, "0", bits=[30], pattern=pattern)])


@pytest.mark.parametrize(
    "pattern",
    [
        {"kind": "pe", "array": [1000, 1000]},  # random: may be idle
        {"kind": "pe", "array": [4, 4], "pe": [3, 3]},
        {"kind": "mac_cell", "array": [128, 128]},
        {"kind": "mac_cell", "array": [8, 8], "input_channel": 7, "output_channel": 7},
    ],
)
def test_pe_or_cell_that_can_hit_is_accepted(pattern):
    site = "gemm.forward" if pattern["kind"] == "mac_cell" else "weight"
    validate_specs(_model(), [_spec(site, "0", bits=[30], pattern=pattern)])


def test_idle_cell_on_one_layer_of_a_unit_is_fine():
    """One MAC array serving every layer: a cell idle on a narrow layer still meets the wide one."""
    model = _model()  # "0": in 8, "2": in 16
    pattern = {"kind": "mac_cell", "array": [16, 16], "input_channel": 12, "output_channel": 0}
    validate_specs(model, [_spec("gemm.forward", ["0", "2"], bits=[30], pattern=pattern)])
    with pytest.raises(FaultSpecError, match="idle"):
        validate_specs(model, [_spec("gemm.forward", "0", bits=[30], pattern=pattern)])


def test_cli_refuses_idle_pe_before_any_output(tmp_path):
    faults = tmp_path / "f.yaml"
    faults.write_text(
        "- {site: weight, target: conv2, model: bitflip, bits: [30], "
        "pattern: {kind: pe, array: [100, 100], pe: [50, 60]}, schedule: {kind: transient, step: 1}}\n"
    )
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "--workload", "cnn", "--faults", str(faults), "--steps", "2", "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "[50, 60]" in result.output and "idle" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


PERMANENT_ROW = """\
- site: activation
  target: fc3
  model: bitflip
  bits: [30]
  pattern: {kind: row, index: 400}
  schedule: {kind: SCHEDULE}
"""


COMM = """\
- site: weight
  target: fc1
  model: stuck_at_1
  bits: [29]
  schedule: {kind: permanent, start: 0}
- site: comm
  target: fc1.weight
  phase: before
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: 3}
  schedule: {kind: transient, step: 1}
"""


def test_a_permanent_module_fault_is_checked_against_the_evaluation_batches(tmp_path):
    """A permanent fault acts in evaluation too, whose batch (the validation set) has fewer rows
    than a training batch of 512: refused before the run starts, not at its final evaluation."""
    faults = tmp_path / "perm.yaml"
    faults.write_text(PERMANENT_ROW.replace("SCHEDULE", "permanent, start: 0"))
    code, out = cli_invoke(
        "train", "--workload", "cnn", "--batch-size", 512, "--steps", 1, "--faults", faults, "--out", tmp_path / "perm"
    )
    assert code == 2 and "'fc3': pattern row index 400 is out of range" in out, out
    assert not (tmp_path / "perm").exists()
    faults.write_text(PERMANENT_ROW.replace("SCHEDULE", "transient, step: 0"))  # training batches only
    code, out = cli_invoke(
        "train", "--workload", "cnn", "--batch-size", 512, "--steps", 1, "--faults", faults, "--out", tmp_path / "once"
    )
    assert code == 0, out


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda t: t.replace("bits: [30]", "bits: [40]"), ["'fc1.weight': bit 40 is out of range for fp32"]),
        (lambda t: t.replace("step: 1}", "step: 50}"), ["never fires", "steps 0..2 of this 3-step run"]),
        (
            lambda t: t.replace("{kind: element, index: 3}", "{kind: row, index: 100000}"),
            ["'fc1.weight': pattern row index 100000 is out of range for a tensor of shape [64, 64]"],
        ),
        (
            lambda t: t.replace("target: fc1.weight", "target: bucket.0").replace("index: 3", "index: 1000000000"),
            ["a gradient bucket (flat, torch.float32, at most", "index 1000000000 is out of range"],
        ),
    ],
    ids=["bits", "schedule", "parameter-shape", "bucket-size"],
)
def test_a_ddp_job_refuses_comm_specs_before_any_rank_starts(tmp_path, edit, needles):
    from sdcscope.faults import load_specs
    from sdcscope.jobs import check_job, make_job
    from sdcscope.workloads import WorkloadConfig

    faults = tmp_path / "comm.yaml"
    faults.write_text(edit(COMM))
    job = make_job(tmp_path / "run", 2, workload=WorkloadConfig(workload="cnn"), specs=load_specs(faults), steps=3)
    with pytest.raises(ValueError) as refused:
        check_job(job)
    assert str(refused.value).startswith("fault spec #1 (comm on ")
    for needle in needles:
        assert needle in str(refused.value)
    assert not (tmp_path / "run").exists()
