"""Bad inputs found by probing: a Python ``Injector`` (no CLI probe) names the spec and module of a
fault that does not fit the tensor it meets at run time, re-checks what is known statically at
``attach()`` and takes a ``probe``; a ``pe`` / ``mac_cell`` at a fixed position that is idle on
every tensor it lands on is refused before any work (it would "fire" without changing a value and
make a run look masked)."""

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.faults import FaultSpec, FaultSpecError
from sdcscope.inject import Injector, validate_specs
from sdcscope.inject.targets import probe_model

runner = CliRunner()


def _spec(site, target, bits=(20,), pattern=None, step=1):
    return FaultSpec.from_dict({"site": site, "target": target, "model": "bitflip", "bits": list(bits),
                                "pattern": pattern or {"kind": "element"},
                                "schedule": {"kind": "transient", "step": step}})


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _autocast_forward(model):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(torch.randn(5, 8)).float().pow(2).mean()


@pytest.mark.parametrize("site,target", [("activation", "0"), ("gemm.forward", "0"),
                                         ("gemm.grad_input", "2"), ("gemm.grad_weight", "0")])
def test_runtime_misfit_names_spec_module_and_dtype(site, target):
    """Bit 20 fits the fp32 model but not the bf16 tensors autocast computes: without a probe this is
    only known when the fault fires; the error then says which spec, site, module, dtype and step."""
    model = _model()
    inj = Injector(model, [_spec(site, target)])   # fp32 parameters: accepted
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
        inj = Injector(model.float(), [_spec(site, "0")], optimizer)   # fits fp32
        model.to(torch.bfloat16)
        with pytest.raises(FaultSpecError, match=r"bit 20 is out of range for bf16; allowed: 0\.\.15"):
            inj.attach()
        assert not inj._attached and not inj._spec_handles


@pytest.mark.parametrize("pattern", [{"kind": "pe", "array": [1000, 1000], "pe": [999, 999]},
                                     {"kind": "pe", "array": [4, 100], "pe": [0, 99]},
                                     {"kind": "mac_cell", "array": [128, 128], "input_channel": 100}])
def test_idle_fixed_pe_or_cell_is_refused(pattern):
    model = _model()   # weight of "0": [16, 8]
    site = "gemm.forward" if pattern["kind"] == "mac_cell" else "weight"
    with pytest.raises(FaultSpecError, match="idle"):
        validate_specs(model, [_spec(site, "0", bits=[30], pattern=pattern)])


@pytest.mark.parametrize("pattern", [{"kind": "pe", "array": [1000, 1000]},            # random: may be idle
                                     {"kind": "pe", "array": [4, 4], "pe": [3, 3]},
                                     {"kind": "mac_cell", "array": [128, 128]},
                                     {"kind": "mac_cell", "array": [8, 8], "input_channel": 7, "output_channel": 7}])
def test_pe_or_cell_that_can_hit_is_accepted(pattern):
    site = "gemm.forward" if pattern["kind"] == "mac_cell" else "weight"
    validate_specs(_model(), [_spec(site, "0", bits=[30], pattern=pattern)])


def test_idle_cell_on_one_layer_of_a_unit_is_fine():
    """One MAC array serving every layer: a cell idle on a narrow layer still meets the wide one."""
    model = _model()   # "0": in 8, "2": in 16
    pattern = {"kind": "mac_cell", "array": [16, 16], "input_channel": 12, "output_channel": 0}
    validate_specs(model, [_spec("gemm.forward", ["0", "2"], bits=[30], pattern=pattern)])
    with pytest.raises(FaultSpecError, match="idle"):
        validate_specs(model, [_spec("gemm.forward", "0", bits=[30], pattern=pattern)])


def test_cli_refuses_idle_pe_before_any_output(tmp_path):
    faults = tmp_path / "f.yaml"
    faults.write_text("- {site: weight, target: conv2, model: bitflip, bits: [30], "
                      "pattern: {kind: pe, array: [100, 100], pe: [50, 60]}, schedule: {kind: transient, step: 1}}\n")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--workload", "cnn", "--faults", str(faults), "--steps", "2",
                                 "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "[50, 60]" in result.output and "idle" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_report_refuses_another_tools_config_json(tmp_path):
    """A folder with some other tool's config.json (a model checkpoint's) is no run: no report is
    written into it, and a folder of such folders holds no runs."""
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_layer": 12}')
    for target in (model_dir, tmp_path):
        result = runner.invoke(app, ["report", str(target)])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and "Traceback" not in result.output
    assert "no 'workload'" in runner.invoke(app, ["report", str(model_dir)]).output
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
