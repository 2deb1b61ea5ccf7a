"""FaultSpec: loading, round trips and validation messages."""

from __future__ import annotations

import json

import pytest
import yaml

from sdcscope.faults import SITES, FaultSpec, Pattern, Schedule, load_specs
from sdcscope.study.spec import CampaignSpec, FaultSpace

DESIGN_EXAMPLE = """\
- site: gemm.forward            # Y = X Wᵀ of an nn.Linear, in the forward pass
  target: blocks.0.attn.q_proj  # shell pattern on module names
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: random}
  schedule: {kind: transient, step: 5}
  rank: 0
  seed: 1
"""

BASE = {
    "site": "weight",
    "target": "fc",
    "model": "bitflip",
    "bits": [30],
    "schedule": {"kind": "transient", "step": 0},
}


def spec(**changes) -> FaultSpec:
    return FaultSpec.from_dict({**BASE, **changes})


def test_design_example_loads(tmp_path):
    (loaded,) = load_specs(DESIGN_EXAMPLE)
    assert loaded == FaultSpec(
        site="gemm.forward",
        target="blocks.0.attn.q_proj",
        model="bitflip",
        bits=[30],
        pattern=Pattern(kind="element", index="random"),
        schedule=Schedule(kind="transient", step=5),
        rank=0,
        seed=1,
    )
    assert loaded.target == ("blocks.0.attn.q_proj",) and loaded.bits == (30,)
    path = tmp_path / "faults.yaml"
    path.write_text(DESIGN_EXAMPLE, encoding="utf-8")
    assert load_specs(path) == load_specs(str(path)) == [loaded]
    assert loaded.matches("blocks.0.attn.q_proj") and not loaded.matches("blocks.1.attn.q_proj")


ROUND_TRIP = [
    BASE,
    {**BASE, "target": ["blocks.*.attn.q_proj", "head"], "rank": None, "seed": -3},
    {**BASE, "format": "bf16", "bits": [15, 0], "pattern": {"kind": "element", "index": [1, 2]}},
    {**BASE, "pattern": {"kind": "burst", "length": 4, "start": 7}},
    {**BASE, "pattern": {"kind": "row", "index": 3}},
    {**BASE, "pattern": {"kind": "column"}},
    {**BASE, "site": "gemm.forward", "pattern": {"kind": "pe", "array": [2, 4], "pe": [1, 3]}},
    {**BASE, "site": "gemm.grad_input", "pattern": {"kind": "mac_cell", "input_channel": 2}},
    {**BASE, "site": "gemm.forward", "pattern": {"kind": "mac_cell", "array": [8, 8], "output_channel": 7}},
    {
        **BASE,
        "site": "gemm.forward",
        "pattern": {"kind": "mac_cell", "array": [8, 8], "swizzle": "per_step", "swizzle_seed": 5},
    },
    {**BASE, "pattern": {"kind": "tensor", "ber": 1e-6}},
    {**BASE, "bits": None, "pattern": {"kind": "tensor", "ber": 1}},
    {**BASE, "model": "stuck_at_1", "schedule": {"kind": "permanent", "start": 3}},
    {
        **BASE,
        "model": "random_value",
        "bits": None,
        "schedule": {"kind": "intermittent", "p": 0.25, "start": 2, "stop": 9},
    },
    {**BASE, "model": "zero", "bits": None, "schedule": {"kind": "transient", "step": 4, "micro_batch": 2}},
    {**BASE, "site": "optimizer_state", "state_key": "exp_avg_sq"},
]


@pytest.mark.parametrize("data", ROUND_TRIP)
def test_round_trip_through_dict_yaml_and_json(data):
    s = FaultSpec.from_dict(data)
    d = s.to_dict()
    assert FaultSpec.from_dict(d) == s
    assert load_specs(yaml.safe_dump([d])) == [s]
    assert load_specs(json.dumps([d])) == [s]
    assert hash(s) == hash(FaultSpec.from_dict(d))


def test_defaults_and_single_mapping():
    (s,) = load_specs("site: weight\ntarget: fc\nmodel: zero\nschedule: {kind: permanent}\n")
    assert s.pattern == Pattern(kind="element", index="random")
    assert s.schedule.start == 0 and s.rank == 0 and s.seed == 0 and s.bits is None
    assert s.to_dict() == {
        "site": "weight",
        "target": "fc",
        "model": "zero",
        "pattern": {"kind": "element", "index": "random"},
        "schedule": {"kind": "permanent", "start": 0},
        "rank": 0,
        "seed": 0,
    }
    assert load_specs("") == []


def test_yaml_exponent_without_dot_is_a_float():
    (s,) = load_specs(DESIGN_EXAMPLE.replace("{kind: element, index: random}", "{kind: tensor, ber: 1e-6}"))
    assert s.pattern.ber == 1e-6


def test_bits_ranges():
    for bit in range(8):
        assert spec(format="int8", bits=[bit]).bits == (bit,)
    assert spec(format="fp32", bits=[31]).bits == (31,)
    assert spec(bits=[31]).bits == (31,)  # no format: the widest format bounds it


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"format": "fp32", "bits": [40]}, ["bit 40", "0..31"]),
        ({"bits": [64]}, ["bit 64", "0..63"]),  # no format: the widest (fp64) bounds it here, the target later
        ({"format": "fp32", "bits": [32]}, ["bit 32", "0..31"]),
        ({"format": "int8", "bits": [8]}, ["bit 8", "0..7"]),
        ({"format": "int8", "bits": [9]}, ["bit 9", "0..7"]),
        ({"format": "fp9"}, ["'fp9'", "fp32", "bf16"]),
        ({"site": "gemm.fwd"}, ["'gemm.fwd'", "did you mean 'gemm.forward'", *SITES]),
        ({"model": "bit_flip"}, ["'bit_flip'", "did you mean 'bitflip'", "stuck_at_0"]),
        ({"schedule": {"kind": "transient", "step": -1}}, ["step", ">= 0", "-1"]),
        ({"schedule": {"kind": "intermittent", "p": 1.5}}, ["1.5", "[0, 1]"]),
        ({"schedule": {"kind": "intermittent", "p": -0.1}}, ["-0.1", "[0, 1]"]),
        ({"schedule": {"kind": "intermittent", "p": 0.5, "start": 4, "stop": 4}}, ["stop", "4"]),
        ({"schedule": {"kind": "permanant"}}, ["'permanant'", "did you mean 'permanent'", "transient"]),
        ({"schedule": {"kind": "transient"}}, ["transient", "step"]),
        ({"schedule": {"kind": "permanent", "step": 3}}, ["'permanent'", "'step'", "start"]),
        ({"schedule": {"kind": "transient", "stpe": 3}}, ["'stpe'", "did you mean 'step'"]),
        ({"shedule": {}}, ["'shedule'", "did you mean 'schedule'"]),
        ({"pattern": {"kind": "row", "length": 2}}, ["'row'", "'length'", "index"]),
        ({"pattern": {"kind": "elemnt"}}, ["'elemnt'", "did you mean 'element'", "mac_cell"]),
        ({"pattern": {"kind": "element", "index": "any"}}, ["'any'", "'random'"]),
        ({"pattern": {"kind": "burst"}}, ["burst", "length"]),
        ({"pattern": {"kind": "burst", "length": 0}}, ["length", ">= 1", "0"]),
        ({"pattern": {"kind": "pe", "array": [2, 4], "pe": [2, 0]}}, ["[2, 0]", "[2, 4]", "0..1"]),
        ({"pattern": {"kind": "pe"}}, ["pe", "array"]),
        ({"pattern": {"kind": "tensor", "ber": 0}}, ["ber", "(0, 1]", "0"]),
        ({"pattern": {"kind": "tensor", "ber": 2.0}}, ["ber", "(0, 1]", "2.0"]),
        ({"model": "zero", "pattern": {"kind": "tensor", "ber": 0.1}}, ["'zero'", "bitflip"]),
        ({"model": "zero"}, ["'zero'", "takes no bits", "bitflip"]),
        ({"bits": None}, ["'bitflip'", "needs bits"]),
        ({"bits": []}, ["bits", "empty"]),
        ({"bits": [3, 3]}, ["distinct", "[3, 3]"]),
        ({"rank": -1}, ["rank", ">= 0", "-1"]),
        ({"state_key": "exp_avg"}, ["'exp_avg'", "optimizer_state", "'weight'"]),
        (
            {"site": "param_grad", "schedule": {"kind": "transient", "step": 1, "micro_batch": 1}},
            ["'param_grad'", "micro_batch", "gemm.forward"],
        ),
    ],
)
def test_bad_values_raise_value_error_naming_value_and_allowed(changes, needles):
    with pytest.raises(ValueError) as info:
        spec(**changes)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"site": 3}, "3"),
        ({"target": []}, "[]"),
        ({"target": ["fc", ""]}, "''"),
        ({"bits": 30}, "30"),
        ({"bits": ["30"]}, "'30'"),
        ({"schedule": {"kind": "transient", "step": "5"}}, "'5'"),
        ({"schedule": {"kind": "transient", "step": 5.0}}, "5.0"),
        ({"schedule": "transient"}, "'transient'"),
        ({"seed": True}, "True"),
        ({"pattern": {"kind": "tensor", "ber": "often"}}, "'often'"),
        ({"site": "optimizer_state", "state_key": 1}, "1"),
    ],
)
def test_bad_types_raise_type_error(changes, needle):
    with pytest.raises(TypeError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        spec(**changes)


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("- site: weight\n  target: [fc\n", encoding="utf-8")
    with pytest.raises(ValueError, match="malformed YAML in .*broken.yaml"):
        load_specs(path)


def test_errors_in_a_list_name_the_spec_and_file(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_text(DESIGN_EXAMPLE + DESIGN_EXAMPLE.replace("step: 5", "step: -2"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"fault spec #1 in .*faults.yaml: .*-2"):
        load_specs(path)


def test_not_a_list_of_specs():
    with pytest.raises(ValueError, match="no such file"):
        load_specs("missing.yaml")
    with pytest.raises(TypeError, match="mapping"):
        load_specs("- 3\n- 4\n")


@pytest.mark.parametrize(
    "cls,what",
    [
        (FaultSpec, "fault spec"),
        (Pattern, "pattern"),
        (Schedule, "schedule"),
        (CampaignSpec, "campaign"),
        (FaultSpace, "faults"),
    ],
)
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
