"""ABFT of fused attention: sampled query rows of F.scaled_dot_product_attention recomputed in fp32."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.detect import ABFTConfig, ABFTDetector


class Attn(nn.Module):
    """Self-attention through SDPA; ``kv_heads`` < 4: grouped-query attention."""

    def __init__(self, mask: str = "causal", kv_heads: int = 4) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.kv = nn.Linear(32, 16 * kv_heads)
        self.mask, self.kv_heads = mask, kv_heads

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, 8).permute(2, 0, 3, 1, 4)
        kw = {"enable_gqa": True} if self.kv_heads != 4 else {}
        if self.mask == "causal":
            kw["is_causal"] = True
        elif self.mask == "bool":
            kw["attn_mask"] = torch.rand(n, n, generator=torch.Generator().manual_seed(0)) > 0.3
            kw["attn_mask"].fill_diagonal_(True)
        elif self.mask == "additive":
            kw["attn_mask"] = torch.randn(b, 1, n, n, generator=torch.Generator().manual_seed(0))
        return F.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).reshape(b, n, 32)


@pytest.fixture
def faulty_sdpa(monkeypatch):
    """F.scaled_dot_product_attention whose output ``fault['index']`` becomes ``factor`` × it +
    ``shift`` (a fault inside the fused kernel: installed before ABFT's wrapper)."""
    fault: dict = {}
    original = F.scaled_dot_product_attention

    def kernel(*args, **kwargs):
        out = original(*args, **kwargs)
        if fault:
            out = out.clone()
            out[fault["index"]] = out[fault["index"]] * fault["factor"] + fault.get("shift", 0.0)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)
    return fault


def step(model, det, n, autocast=None):
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = model(torch.randn(2, n, 32))
    y.float().square().mean().backward()
    return [e for e in det.check(0) if e.module == "attn"]


@pytest.mark.parametrize("mask,kv_heads", [("causal", 4), ("bool", 4), ("additive", 2), ("none", 1)])
def test_clean_attention_passes_and_a_wrong_output_row_is_named(faulty_sdpa, mask, kv_heads):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", Attn(mask, kv_heads))
    det = ABFTDetector(model, ABFTConfig(attention_rows=12)).attach()  # every query row of 12
    for autocast in (None, torch.bfloat16):
        assert step(model, det, 12, autocast) == []
    faulty_sdpa.update(index=(1, 2, 5, 3), factor=1.0, shift=2.0)
    for autocast in (None, torch.bfloat16):
        events = step(model, det, 12, autocast)
        assert [(e.detector, e.gemm, e.index) for e in events] == [("abft", "forward", (1, 2, 5, 3))]
        assert events[0].evidence["check"] == "sdpa_rows" and events[0].evidence["ratio"] > 8
    assert det.sdpa.checks_run == 4
    det.detach()


def test_sampled_rows_cost_a_share_of_the_calls_and_catch_a_corrupted_key_in_any_row(faulty_sdpa):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", Attn("none"))
    det = ABFTDetector(model, ABFTConfig(attention_rows=2)).attach()
    faulty_sdpa.update(index=(0, 1, slice(None), 0), factor=-3.0)  # one feature of every row: a V column
    assert len(step(model, det, 32)) == 1
    det.detach()


def test_dropout_calls_are_counted_unchecked_and_turning_the_check_off_warns_naming_the_module():
    torch.manual_seed(0)

    class Drop(Attn):
        def forward(self, x):
            q = self.q(x).view(2, 8, 4, 8).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).transpose(1, 2).reshape(2, 8, 32)

    model = nn.Sequential()
    model.add_module("attn", Drop())
    det = ABFTDetector(model, ABFTConfig()).attach()
    step(model, det, 8)
    assert (det.sdpa.unchecked_dropout, det.sdpa.checks_run) == (1, 0)
    det.detach()
    off = ABFTDetector(model, ABFTConfig(kinds=["linear"])).attach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, off, 8)
    assert any("scaled_dot_product_attention) of attn" in str(w.message) for w in caught)
    off.detach()
    before = dict(off.sdpa.calls)
    step(model, off, 8)
    assert off.sdpa.calls == before  # detached: its check sees no call
