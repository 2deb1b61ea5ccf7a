"""Faults on FP8 GEMMs: ``operand`` is validated where the spec is built and where it is attached
(only an Fp8Linear has fp8 operands and scales, in their own fp8 format); converted layers keep
their parameters, and a transient fault on the result hits the one element once."""

import pytest
import torch
from torch import nn

from sdcscope.common.fp8 import Fp8Linear, convert_to_fp8
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector


def spec(**kw):
    base = {
        "site": "gemm.forward",
        "target": "0",
        "model": "bitflip",
        "bits": [6],
        "schedule": {"kind": "transient", "step": 0},
    }
    return FaultSpec.from_dict({**base, **kw})


def test_operand_refused_off_gemm_sites_and_off_fp8_layers():
    with pytest.raises(ValueError, match="operand 'a' is only used with the gemm"):
        spec(site="weight", target="0.weight", operand="a")
    with pytest.raises(ValueError, match="operand.*'x'.*allowed"):
        spec(operand="x")
    with pytest.raises(ValueError, match="'0' is a Linear, not an FP8 layer"):
        Injector(nn.Sequential(nn.Linear(4, 4)), [spec(operand="scale_a")])
    with pytest.raises(ValueError, match="bit 9 is out of range for fp8_e4m3fn"):  # the operand's own format
        Injector(nn.Sequential(Fp8Linear(4, 4)), [spec(operand="b", bits=[9])])


def test_convert_to_fp8_keeps_parameters_and_a_result_fault_hits_one_element_once():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    w = m[0].weight
    assert convert_to_fp8(m, "0") == ["0"] and isinstance(m[0], Fp8Linear) and m[0].weight is w
    assert type(m[2]) is nn.Linear
    x = torch.randn(3, 8)
    clean = m(x)
    inj = Injector(m, [spec(bits=[30], pattern={"kind": "element", "index": 5})]).attach()
    inj.set_position(0)
    faulty = m[0](x)
    (rec,) = inj.records
    assert rec["index"] == [5] and rec["module"] == "0"
    ref = m[0](x)  # the fault was transient: the next call is clean, and equal to the first
    assert torch.equal(ref, m[0].__class__.forward(m[0], x)) and torch.equal(m[2](torch.relu(ref)), clean)
    diff = (faulty != ref).nonzero().tolist()
    assert diff == [[0, 5]]  # flat index 5 of the (3, 8) result, nothing else
