"""What ABFT cannot check is said at construction: Linear subclasses overriding forward (unless
named as computing x·Wᵀ + b, like transformers' FalconLinear, which is then checked), and weights a
module applies itself (an MoE's 3-D expert weights, nn.MultiheadAttention's in_proj_weight)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector


class FalconLinear(nn.Linear):
    """transformers' FalconLinear: its own forward, still x·Wᵀ + b."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class LoRALinear(nn.Linear):
    def __init__(self, d_in: int, d_out: int, r: int = 2) -> None:
        super().__init__(d_in, d_out)
        self.a = nn.Parameter(torch.randn(r, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, r) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.a.T @ self.b.T


class Experts(nn.Module):
    """Fused MoE experts as in transformers 5: one 3-D weight, F.linear per routed expert."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(F.linear(x, self.w[i]) for i in range(len(self.w)))


def _warned(model: nn.Module, config: ABFTConfig | None = None) -> tuple[ABFTDetector, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        det = ABFTDetector(model, config)
    return det, [str(w.message) for w in caught if "ABFT" in str(w.message)]


def test_a_linear_subclass_computing_xwt_b_is_checked_and_its_faults_named():
    torch.manual_seed(0)
    net = nn.Sequential(FalconLinear(8, 16), nn.GELU(), FalconLinear(16, 4))
    det, said = _warned(net)
    assert [x.name for x in det.layers] == ["0", "2"] and not said
    det.attach()
    spec = FaultSpec.from_dict({"site": "gemm.forward", "target": "2", "model": "bitflip", "bits": [29],
                                "seed": 1, "schedule": {"kind": "transient", "step": 1}})
    inj = Injector(net, [spec]).attach()
    for step in range(3):
        inj.set_position(step)
        net(torch.randn(5, 8)).square().sum().backward()
        assert [(e.module, e.gemm) for e in det.check(step)] == ([("2", "forward")] if step == 1 else [])
    assert det.max_ratio[("0", "grad_weight")] < 1 and det.max_ratio[("2", "grad_input")] < 1


def test_other_overriding_subclasses_are_skipped_and_named_in_a_warning():
    net = nn.Sequential(nn.Linear(8, 8), LoRALinear(8, 8))
    det, (said,) = _warned(net)
    assert det.skipped == ["1"] and [x.name for x in det.layers] == ["0"]
    assert "layers it cannot check: 1" in said and "linear_subclasses" in said
    det, said = _warned(net, ABFTConfig(linear_subclasses=["LoRALinear"]))   # the user's word for it
    assert det.skipped == [] and not said


def test_weights_applied_by_a_modules_own_forward_are_listed():
    torch.manual_seed(0)
    net = nn.ModuleDict({"emb": nn.Embedding(10, 8), "attn": nn.MultiheadAttention(8, 2),
                         "experts": Experts(), "router": nn.Linear(8, 3)})
    det, (said,) = _warned(net)
    assert det.unchecked_params == ["attn.in_proj_weight", "experts.w"]   # not the embedding table
    assert "weights applied outside nn.Linear" in said and "experts.w" in said
    _, said = _warned(net, ABFTConfig(targets=["router"]))   # the user chose the targets
    assert not said


def test_linear_subclasses_is_validated():
    with pytest.raises((TypeError, ValueError), match="linear_subclasses"):
        ABFTConfig(linear_subclasses=[3])


def test_the_injector_says_why_a_module_applying_its_own_weights_takes_no_gemm_fault():
    net = nn.ModuleDict({"experts": Experts(), "router": nn.Linear(8, 3)})
    spec = FaultSpec.from_dict({"site": "gemm.forward", "target": "experts", "model": "bitflip", "bits": [30],
                                "schedule": {"kind": "transient", "step": 0}})
    with pytest.raises(ValueError, match=r"'experts' \(Experts\) is not a GEMM module.*site 'activation'"):
        Injector(net, [spec])
