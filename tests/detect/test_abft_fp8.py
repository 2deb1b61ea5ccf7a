"""ABFT of FP8 GEMMs: an Fp8Linear's Y, dX and dW are ``torch._scaled_mm`` of dynamically scaled
fp8 operands; clean training stays far below the threshold, and a fault in any GEMM's result,
fp8 operand or scale is caught on its step with the layer and the GEMM named."""

import pytest
import torch
from torch import nn

from sdcscope.common.fp8 import Fp8Linear, quantize
from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector

GEMMS = ("forward", "grad_input", "grad_weight")


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Fp8Linear(24, 48), nn.GELU(), Fp8Linear(48, 16))


def train(m, det, steps, inj=None):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    events = []
    for step in range(steps):
        if inj is not None:
            inj.set_position(step)
        x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(step))
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        found = det.check(step)
        events += found
        if not found:  # a flagged step's update is dropped (the guard's veto)
            opt.step()
    return events


def test_fp8_linear_runs_scaled_mm_of_dynamically_scaled_operands():
    lin = Fp8Linear(24, 16)
    x = torch.randn(5, 24, requires_grad=True)
    y = lin(x)
    xq, sx = quantize(x, torch.float8_e4m3fn)
    wq, sw = quantize(lin.weight, torch.float8_e4m3fn)
    assert xq.dtype == torch.float8_e4m3fn and xq.float().abs().max() == torch.finfo(xq.dtype).max
    want = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.float32) + lin.bias
    assert torch.equal(y, want)
    y.square().sum().backward()
    gq, sg = quantize(2 * y.detach(), torch.float8_e5m2)  # dY in e5m2, then dX = dY·W and dW = dYᵀ·X
    assert torch.equal(x.grad, torch._scaled_mm(gq, wq, scale_a=sg, scale_b=sw, out_dtype=torch.float32))
    assert torch.equal(lin.weight.grad, torch._scaled_mm(gq.t(), xq, scale_a=sg, scale_b=sx, out_dtype=torch.float32))


def test_clean_fp8_training_raises_nothing_far_below_the_threshold():
    m = model()
    det = ABFTDetector(m, ABFTConfig()).attach()
    assert [x.kind for x in det.layers] == ["fp8", "fp8"] and det.skipped == []
    assert train(m, det, 4) == []
    assert {g for _, g in det.max_ratio} == {"forward", "grad_input", "grad_weight"}
    assert max(det.max_ratio.values()) < det.config.c / 4


@pytest.mark.parametrize("operand,bit", [(None, 30), ("a", 6), ("b", 6), ("scale_a", 30), ("scale_b", 30)])
def test_fault_in_fp8_gemm_caught_on_its_step_with_layer_and_gemm(operand, bit):
    m = model()
    det = ABFTDetector(m, ABFTConfig()).attach()
    specs = [  # Y on step 1, dX on step 2, dW on step 3
        FaultSpec(
            site=f"gemm.{gemm}",
            target="2",
            model="bitflip",
            bits=[bit],
            operand=operand,
            schedule={"kind": "transient", "step": step},
            seed=3,
        )
        for step, gemm in enumerate(GEMMS, 1)
    ]
    inj = Injector(m, specs).attach()
    events = train(m, det, 4, inj)
    assert [(e.step, e.module, e.gemm) for e in events] == [(s, "2", g) for s, g in enumerate(GEMMS, 1)]
    assert [r["step"] for r in inj.records] == [1, 2, 3]
    for rec, gemm in zip(inj.records, GEMMS):
        assert rec["module"] == ("2" if operand is None else f"2:{operand}") and rec["call"] == 0
        # exactly the one bit, in the stored format of what was hit (fp8 operands: e4m3 / e5m2)
        fp8 = {"a": torch.float8_e5m2 if gemm != "forward" else torch.float8_e4m3fn, "b": torch.float8_e4m3fn}
        dtype = fp8.get(operand, torch.float32)
        before, after = torch.tensor(rec["before"]).to(dtype), torch.tensor(rec["after"]).to(dtype)
        itype = torch.int8 if dtype.itemsize == 1 else torch.int32
        assert torch.equal(before.view(itype) ^ after.view(itype), torch.tensor([1 << bit]).to(itype))


def test_torchao_float8_linear_checked_through_the_same_site():
    """torchao's Float8Linear (its CPU path): Y, dX and dW checked at its torch._scaled_mm calls,
    result / scale / fp8 operand faults caught and named, torch._scaled_mm restored on detach."""
    float8 = pytest.importorskip("torchao.float8")
    original = torch._scaled_mm
    m = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 16))
    float8.convert_to_float8_training(m)
    det = ABFTDetector(m, ABFTConfig()).attach()
    assert [x.kind for x in det.layers] == ["fp8", "fp8"] and det.skipped == []
    faults = [(None, 30), ("scale_b", 30), ("a", 6)]  # Y's result, dX's W scale, dW's dY (e5m2)
    specs = [
        FaultSpec(
            site=f"gemm.{g}",
            target="2",
            model="bitflip",
            bits=[bit],
            operand=op,
            seed=3,
            schedule={"kind": "transient", "step": s},
        )
        for s, (g, (op, bit)) in enumerate(zip(GEMMS, faults), 1)
    ]
    inj = Injector(m, specs).attach()
    events = train(m, det, 4, inj)
    assert [(e.step, e.module, e.gemm) for e in events] == [(s, "2", g) for s, g in enumerate(GEMMS, 1)]
    assert [r["module"] for r in inj.records] == ["2", "2:scale_b", "2:a"]
    clean = [r for (layer, _), r in det.max_ratio.items() if layer == "0"]
    assert len(clean) == 3 and max(clean) < det.config.c / 4
    det.detach()
    inj.detach()
    assert torch._scaled_mm is original
