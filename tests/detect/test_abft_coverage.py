"""ABFT's coverage beyond plain modules: Linear subclasses computing x·Wᵀ + b (transformers'
FalconLinear) are checked, others are named in a warning; weights a module applies itself with
F.linear (an MoE's 3-D expert weights, a router's, nn.MultiheadAttention's in_proj_weight) are
checked per call, per expert."""

from __future__ import annotations

import gc
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
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "2",
            "model": "bitflip",
            "bits": [29],
            "seed": 1,
            "schedule": {"kind": "transient", "step": 1},
        }
    )
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
    det, said = _warned(net, ABFTConfig(linear_subclasses=["LoRALinear"]))  # the user's word for it
    assert det.skipped == [] and not said


def test_weights_a_module_applies_with_f_linear_are_checked_per_expert():
    """An MoE's 3-D expert weight (one layer per expert), a router's and MHA's in_proj_weight:
    clean calls pass all three checks; a wrong element in one expert's product is named."""
    import sdcscope.detect.abft.taps as abft

    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "emb": nn.Embedding(10, 8),
            "attn": nn.MultiheadAttention(8, 2, batch_first=True),
            "experts": Experts(),
            "router": nn.Linear(8, 3),
        }
    )
    det, said = _warned(net)
    assert not said and det.unchecked_params == ["attn.in_proj_weight", "experts.w"]  # not the table
    assert {x.name for x in det.layers} == {
        "attn.out_proj",
        "router",
        "attn.in_proj_weight",
        "experts.w[0]",
        "experts.w[1]",
        "experts.w[2]",
    }
    det.attach()

    def run(step):
        x = torch.randn(2, 5, 8)
        h = net["attn"](x, x, x, need_weights=False)[0]
        (net["experts"](h) + net["router"](h).sum()).square().sum().backward()
        return [(e.module, e.gemm) for e in det.check(step)]

    for step in range(3):  # out_proj: applied by the attention with F.linear, found after two steps
        assert run(step) == []
    assert det.unreached == set() and det.max_ratio[("attn.out_proj", "grad_weight")] < 1
    assert all(
        det.max_ratio[(f"experts.w[{e}]", g)] < 1 for e in range(3) for g in ("forward", "grad_input", "grad_weight")
    )
    assert det.max_ratio[("attn.in_proj_weight", "grad_weight")] < 1

    plain = abft._linear_original[0]
    expert = net["experts"].w

    def faulty(x, w, b=None):  # the GEMM of expert 1 writes one wrong element
        out = plain(x, w, b)
        if w._base is expert and w.storage_offset() == expert.stride(0):
            out = out.clone()
            out.view(-1)[3] += 1e3
        return out

    abft._linear_original[0] = faulty
    try:
        assert run(3) == [("experts.w[1]", "forward")]
    finally:
        abft._linear_original[0] = plain
    gc.collect()  # detectors other tests dropped while attached leave with them
    det.detach()
    assert det not in abft._linear_taps and (F.linear is plain or len(abft._linear_taps))


def test_an_idle_expert_stays_in_the_rotation_and_other_products_are_unreached():
    class Routed(Experts):
        def forward(self, x):  # expert 2 never gets a token
            return F.linear(x, self.w[0]) + F.linear(x, self.w[1])

    class Batched(Experts):
        def forward(self, x):  # every expert by one bmm: not F.linear
            return torch.einsum("td,eod->to", x, self.w)

    for cls, unreached in ((Routed, set()), (Batched, {"experts.w[0]", "experts.w[1]", "experts.w[2]"})):
        net = nn.ModuleDict({"experts": cls()})
        det = ABFTDetector(net).attach()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for step in range(3):
                net["experts"](torch.randn(4, 8)).square().sum().backward()
                assert det.check(step) == []
        assert det.unreached == unreached
        det.detach()


def test_linear_subclasses_is_validated():
    with pytest.raises((TypeError, ValueError), match="linear_subclasses"):
        ABFTConfig(linear_subclasses=[3])


def test_the_injector_says_why_a_module_applying_its_own_weights_takes_no_gemm_fault():
    net = nn.ModuleDict({"experts": Experts(), "router": nn.Linear(8, 3)})
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "experts",
            "model": "bitflip",
            "bits": [30],
            "schedule": {"kind": "transient", "step": 0},
        }
    )
    with pytest.raises(ValueError, match=r"'experts' \(Experts\) is not a GEMM module.*site 'activation'"):
        Injector(net, [spec])
