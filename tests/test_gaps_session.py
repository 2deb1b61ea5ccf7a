"""Regression tests for three gaps: non-mapping configs taken as defaults, mac_cell channels
silently ignored on single-axis sites, and non-finite values in the run directory's JSON lines."""

from __future__ import annotations

import json
import math
from types import MappingProxyType

import numpy as np
import pytest
import torch
from torch import nn

from sdcscope._io import JsonlWriter, dumps, read_jsonl, write_json
from sdcscope.detect.events import Event
from sdcscope.faults import FaultSpec, Pattern, Schedule, load_specs
from sdcscope.faults.spec import MAC_CELL_SINGLE_AXIS, check_site_pattern
from sdcscope.guard.config import GuardConfig
from sdcscope.inject.injector import Injector
from sdcscope.study.spec import CampaignSpec, FaultSpace, load_campaign

NOT_MAPPINGS = [[], [1], "", "abc", 0, 5, 1.5, False, True, ("a",)]


def strict_loads(line: str):
    """``json.loads`` as a strict parser (jq, JavaScript) reads: NaN/Infinity tokens are errors."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=refuse)


# --------------------------------------------------------------- 1. non-mapping configs


@pytest.mark.parametrize("data", NOT_MAPPINGS, ids=repr)
def test_guard_config_from_dict_refuses_a_non_mapping(data):
    with pytest.raises(TypeError, match=r"guard config must be a mapping.*got") as info:
        GuardConfig.from_dict(data)
    assert repr(data) in str(info.value)


@pytest.mark.parametrize("data", [None, {}, MappingProxyType({})], ids=repr)
def test_guard_config_from_dict_none_or_empty_mapping_is_the_defaults(data):
    assert GuardConfig.from_dict(data) == GuardConfig()


def test_guard_config_from_dict_takes_any_mapping_and_nested_mappings():
    cfg = GuardConfig.from_dict(MappingProxyType({"replay": False, "abft": MappingProxyType({"budget": 0.05})}))
    assert cfg.replay is False and cfg.abft.budget == 0.05


@pytest.mark.parametrize("section,value", [("abft", []), ("abft", "on"), ("metrics", 0), ("nonfinite", [1]),
                                           ("loss_spike", True), ("ranks", 3.0)])
def test_guard_config_refuses_a_non_mapping_section(section, value):
    with pytest.raises(TypeError, match=rf"guard {section} must be a mapping"):
        GuardConfig.from_dict({section: value})


@pytest.mark.parametrize("text", ["", "# only a comment\n", "null\n", "~\n", "{}\n"], ids=repr)
def test_guard_config_load_an_empty_file_is_the_defaults(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    assert GuardConfig.load(path) == GuardConfig()


@pytest.mark.parametrize("text", ["[]\n", "- abft\n", "5\n", "hello\n", "true\n", "'{}'\n"], ids=repr)
def test_guard_config_load_refuses_a_document_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"guard config '.*guard\.yaml' must hold a mapping"):
        GuardConfig.load(path)


@pytest.mark.parametrize("cls,what", [(FaultSpec, "fault spec"), (Pattern, "pattern"), (Schedule, "schedule"),
                                      (CampaignSpec, "campaign"), (FaultSpace, "faults")])
@pytest.mark.parametrize("data", [None, [], "x", 5], ids=repr)
def test_spec_loaders_refuse_a_non_mapping(cls, what, data):
    with pytest.raises(TypeError, match=rf"^{what} must be a mapping, got"):
        cls.from_dict(data)


@pytest.mark.parametrize("text", ["5\n", "hello there\n", "3.5\n", "true\n"], ids=repr)
def test_load_specs_refuses_a_scalar_document(tmp_path, text):
    path = tmp_path / "faults.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"faults\.yaml must hold a list of fault specs"):
        load_specs(path)


@pytest.mark.parametrize("text", ["- 5\n", "- []\n", "- hello\n"], ids=repr)
def test_load_specs_refuses_an_entry_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "faults.yaml"
    path.write_text(text)
    with pytest.raises(TypeError, match=r"fault spec #0 in .*faults\.yaml: fault spec must be a mapping"):
        load_specs(path)


def test_load_specs_an_empty_file_holds_no_fault(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_text("# nothing yet\n")
    assert load_specs(path) == []


@pytest.mark.parametrize("text", ["", "null\n", "[]\n", "- a\n", "5\n", "hello\n"], ids=repr)
def test_load_campaign_refuses_a_document_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "campaign.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"campaign\.yaml must hold a mapping \(a campaign spec\)"):
        load_campaign(path)


# ------------------------------------------------- 2. mac_cell channels on single-axis sites

BASE = dict(target="0", model="stuck_at_1", bits=[30], schedule={"kind": "transient", "step": 0})


@pytest.mark.parametrize("pattern", [{"input_channel": 1}, {"input_channel": 1, "output_channel": 2},
                                     {"array": [2, 2], "input_channel": 0, "output_channel": 1},
                                     {"array": [4, 4], "input_channel": 3, "swizzle": "per_step"}], ids=str)
def test_mac_cell_input_channel_on_activation_is_refused(pattern):
    with pytest.raises(ValueError, match=r"pattern mac_cell input_channel \d+ has no meaning on site "
                                         r"'activation': a module output holds output channels only.*ignored"):
        FaultSpec(site="activation", pattern={"kind": "mac_cell", **pattern}, **BASE)


@pytest.mark.parametrize("pattern", [{"output_channel": 2}, {"input_channel": 1, "output_channel": 2},
                                     {"array": [2, 2], "input_channel": 0, "output_channel": 1}], ids=str)
def test_mac_cell_output_channel_on_grad_input_is_refused(pattern):
    with pytest.raises(ValueError, match=r"pattern mac_cell output_channel \d+ has no meaning on site "
                                         r"'gemm.grad_input': dX = dY W holds input channels only.*ignored"):
        FaultSpec(site="gemm.grad_input", pattern={"kind": "mac_cell", **pattern}, **BASE)


def test_a_refused_mac_cell_channel_names_the_spec_in_a_fault_file(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_text("- {site: gemm.forward, target: '0', model: zero, schedule: {kind: transient, step: 0},\n"
                    "   pattern: {kind: mac_cell, input_channel: 1, output_channel: 2}}\n"
                    "- {site: activation, target: '0', model: zero, schedule: {kind: transient, step: 0},\n"
                    "   pattern: {kind: mac_cell, input_channel: 1, output_channel: 2}}\n")
    with pytest.raises(ValueError, match=r"fault spec #1 in .*: pattern mac_cell input_channel 1 .*'activation'"):
        load_specs(path)


@pytest.mark.parametrize("site,pattern", [
    ("activation", {"output_channel": 2}), ("activation", {"input_channel": "random", "output_channel": 2}),
    ("activation", {"array": [4, 4], "output_channel": 1, "swizzle": "per_step"}),
    ("gemm.grad_input", {"input_channel": 2}), ("gemm.grad_input", {"input_channel": 2, "output_channel": "random"}),
    ("gemm.forward", {"input_channel": 1, "output_channel": 2}),
    ("gemm.grad_weight", {"input_channel": 1, "output_channel": 2}),
    ("weight", {"input_channel": 1, "output_channel": 2}),
    ("param_grad", {"input_channel": 1, "output_channel": 2}),
    ("optimizer_state", {"input_channel": 1, "output_channel": 2}),
], ids=str)
def test_mac_cell_channels_that_have_a_meaning_are_accepted(site, pattern):
    spec = FaultSpec(site=site, pattern={"kind": "mac_cell", **pattern}, **BASE)
    check_site_pattern(site, spec.pattern)


def test_check_site_pattern_covers_a_prebuilt_pattern_object():
    pattern = Pattern(kind="mac_cell", input_channel=3, output_channel=1)
    with pytest.raises(ValueError, match="input_channel 3 has no meaning on site 'activation'"):
        FaultSpec(site="activation", pattern=pattern, **BASE)
    assert set(MAC_CELL_SINGLE_AXIS) == {"activation", "gemm.grad_input"}


def _fired(site: str, pattern: dict) -> list[int]:
    """Flat indices a fault hit in Linear(6, 8) of a tiny MLP (one step, x needs a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
    spec = FaultSpec(site=site, pattern={"kind": "mac_cell", **pattern}, **BASE)
    with Injector(model, [spec]) as inj:
        inj.set_position(0, 0)
        model(torch.randn(4, 6, requires_grad=True)).sum().backward()
    (record,) = inj.records
    return record["index"]


def test_the_channel_a_single_axis_site_has_is_honoured():
    # activation [4, 8]: output channel 2 of every row; dX [4, 6]: input channel 4 of every row
    assert _fired("activation", {"output_channel": 2}) == [2, 10, 18, 26]
    assert _fired("gemm.grad_input", {"input_channel": 4}) == [4, 10, 16, 22]


def test_campaign_refuses_a_pattern_that_one_of_its_sites_would_ignore():
    space = {"sites": ["gemm.forward", "activation"], "targets": ["*"], "models": ["zero"],
             "patterns": [{"kind": "mac_cell", "input_channel": 1, "output_channel": 2}]}
    with pytest.raises(ValueError, match=r"faults.patterns entry .* with faults.sites 'activation': pattern mac_cell "
                                         r"input_channel 1 has no meaning on site 'activation'"):
        FaultSpace.from_dict(space)
    FaultSpace.from_dict({**space, "sites": ["gemm.forward", "weight"]})


@pytest.mark.parametrize("site,pattern", [
    ("activation", {"kind": "mac_cell", "output_channel": 2}),               # input_channel 'random': unused
    ("gemm.grad_input", {"kind": "mac_cell", "input_channel": 2}),           # output_channel 'random': unused
    ("gemm.forward", {"kind": "mac_cell", "array": [4, 4], "input_channel": 1, "output_channel": 2}),
], ids=str)
def test_campaign_repeats_of_a_fault_that_draws_nothing_are_refused(site, pattern):
    space = {"sites": [site], "targets": ["*"], "models": ["bitflip"], "bits": [30], "patterns": [pattern],
             "repeats": 3}
    with pytest.raises(ValueError, match=r"faults.repeats=3: every point of this fault space is one fixed fault"):
        FaultSpace.from_dict(space)


@pytest.mark.parametrize("site,pattern", [
    ("activation", {"kind": "mac_cell"}), ("activation", {"kind": "mac_cell", "array": [4, 4]}),
    ("gemm.grad_input", {"kind": "mac_cell", "output_channel": "random"}),
    ("gemm.forward", {"kind": "mac_cell", "array": [4, 4], "input_channel": 1}),
], ids=str)
def test_campaign_repeats_of_a_fault_that_draws_are_accepted(site, pattern):
    FaultSpace.from_dict({"sites": [site], "targets": ["*"], "models": ["bitflip"], "bits": [30],
                          "patterns": [pattern], "repeats": 3})


def test_draws_on_matches_what_resolving_the_pattern_draws():
    def hits(pattern, shape, channel_dim):
        from sdcscope.faults import resolve_indices
        return {tuple(resolve_indices(pattern, shape, torch.Generator().manual_seed(s),
                                      channel_dim=channel_dim).tolist()) for s in range(8)}

    fixed_cell = Pattern.from_dict({"kind": "mac_cell", "array": [4, 4], "input_channel": 1, "output_channel": 2})
    assert not fixed_cell.draws and len(hits(fixed_cell, (8, 6), None)) == 1
    out_only = Pattern.from_dict({"kind": "mac_cell", "output_channel": 2})
    assert out_only.draws and not out_only.draws_on("activation") and out_only.draws_on("weight")
    assert len(hits(out_only, (3, 8), -1)) == 1 and len(hits(out_only, (8, 6), None)) > 1
    assert Pattern.from_dict({"kind": "mac_cell", "array": [4, 4]}).draws_on("activation")


# ------------------------------------------------------- 3. non-finite values in JSON lines


def test_jsonl_writer_writes_non_finite_floats_as_strings(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 1, "loss": math.nan, "grad": [math.inf, -math.inf, 1.0], "nested": {"x": math.nan}})
    writer.close()
    (line,) = path.read_text().splitlines()
    assert strict_loads(line) == {"step": 1, "loss": "nan", "grad": ["inf", "-inf", 1.0], "nested": {"x": "nan"}}
    (record,) = read_jsonl(path)
    assert math.isnan(float(record["loss"])) and [float(g) for g in record["grad"]] == [math.inf, -math.inf, 1.0]


@pytest.mark.parametrize("value,written", [
    (np.float32("nan"), "nan"), (np.float64("-inf"), "-inf"), (np.float32(1.5), 1.5), (np.int64(3), 3),
    (torch.tensor(float("nan")), "nan"), (torch.tensor(2.5), 2.5),
    (np.array([1.0, np.inf]), [1.0, "inf"]), (torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16), [1.0, "-inf"]),
    ({float("nan"): 1}, {"nan": 1}), ((1, math.nan), [1, "nan"]),
], ids=repr)
def test_numpy_and_torch_values_are_written_as_their_numbers(value, written):
    assert strict_loads(dumps({"x": value})) == {"x": written}


def test_write_json_is_strict_json(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"final_loss": math.inf, "val": torch.tensor(float("nan"))})
    assert strict_loads(path.read_text()) == {"final_loss": "inf", "val": "nan"}


def test_injection_records_with_non_finite_values_are_strict_json(tmp_path):
    # stuck-at-1 on fp32 bit 30 (the exponent's top bit) turns +-[1, 2) into NaN, +-1.0 into +-inf
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.5, -1.25, 1.0, -1.0]] * 3))
    spec = FaultSpec(site="weight", target="weight", model="stuck_at_1", bits=[30],
                     pattern={"kind": "row", "index": 0}, schedule={"kind": "transient", "step": 0})
    log = tmp_path / "injections.jsonl"
    with Injector(model, [spec], log=log) as inj:
        inj.set_position(0, 0)
    (line,) = log.read_text().splitlines()
    record = strict_loads(line)
    assert record["before"] == [1.5, -1.25, 1.0, -1.0]
    assert record["after"] == ["nan", "nan", "inf", "-inf"]
    assert "NaN" not in line and "Infinity" not in line


def test_event_records_with_non_finite_evidence_are_strict_json(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(path)
    writer.write(Event(step=3, detector="nonfinite", verdict="nonfinite",
                       evidence={"loss": math.nan, "grad_norm": math.inf}).to_dict())
    writer.close()
    (line,) = path.read_text().splitlines()
    assert strict_loads(line)["evidence"] == {"loss": "nan", "grad_norm": "inf"}
