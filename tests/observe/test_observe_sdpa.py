"""Attention metrics of models that call F.scaled_dot_product_attention, against float64 references."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.observe import Metrics, MetricsConfig, attention

ORIGINAL = F.scaled_dot_product_attention


class SDPAAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention through F.scaled_dot_product_attention."""

    def __init__(
        self,
        d: int = 32,
        heads: int = 4,
        kv_heads: int | None = None,
        scale: float | None = None,
        mask: str | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.hd = d // heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, self.hd * self.kv_heads)
        self.v = nn.Linear(d, self.hd * self.kv_heads)
        self.o = nn.Linear(d, d)
        self.scale, self.mask = scale, mask
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        kwargs = {}
        mask = None
        if self.mask == "causal":
            kwargs["is_causal"] = True
        elif self.mask == "bool":  # each query sees keys up to itself, the first row none at all
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            mask[0] = False
            kwargs["attn_mask"] = mask
        elif self.mask == "additive":
            mask = torch.linspace(-3.0, 0.0, t).expand(t, t).contiguous()
            kwargs["attn_mask"] = mask
        if self.scale is not None:
            kwargs["scale"] = self.scale
        if self.kv_heads != self.heads:
            kwargs["enable_gqa"] = True
        self.seen.append((q.detach(), k.detach(), mask))
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    def __init__(self, **attn) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(SDPAAttention(**attn) for _ in range(2))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _step(model: nn.Module, metrics: Metrics, step: int = 0, x: torch.Tensor | None = None) -> dict:
    x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(step)) if x is None else x
    loss = model(x).square().mean()
    loss.backward()
    metrics.after_backward()
    return metrics.collect(step, loss)


def _reference(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None
) -> tuple[float, float, float]:
    """(bound, max logit, mean entropy over rows with a key) in float64."""
    q, k = q.double(), k.double()
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    bound = (q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1)).amax().item() * s
    logits = q @ k.transpose(-2, -1) * s
    top = logits.amax().item()
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    if causal:
        logits = logits.masked_fill(~torch.ones(logits.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    p = logits.softmax(-1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return bound, top, ent[~ent.isnan()].mean().item()


@pytest.mark.parametrize(
    "attn",
    [
        dict(mask="causal"),
        dict(mask="bool"),
        dict(mask="additive", scale=0.3),
        dict(heads=4, kv_heads=2, mask="causal"),
    ],
    ids=["causal", "bool-mask-empty-row", "additive-scale", "gqa"],
)
def test_sdpa_attention_metrics_match_a_float64_reference(attn):
    torch.manual_seed(0)
    model = Net(**attn)
    with Metrics(model, config=MetricsConfig(probe_every=1)) as metrics:
        row = _step(model, metrics)
    for i, block in enumerate(model.blocks):
        ((q, k, mask),) = block.seen
        bound, top, ent = _reference(q, k, mask, attn.get("mask") == "causal", attn.get("scale"))
        name = f"blocks.{i}"
        assert row[f"attn/max_logit_bound/{name}"] == pytest.approx(bound, rel=1e-5)
        assert row[f"attn/max_logit/{name}"] == pytest.approx(top, rel=1e-5)
        assert row[f"attn/entropy/{name}"] == pytest.approx(ent, rel=1e-5)
        assert top <= bound * (1 + 1e-6)
    assert row["attn/max_logit"] == max(row[f"attn/max_logit/blocks.{i}"] for i in range(2))


def test_probe_metrics_only_on_probe_steps_and_the_bound_every_step():
    torch.manual_seed(0)
    model = Net(mask="causal")
    with Metrics(model, config=MetricsConfig(probe_every=2)) as metrics:
        rows = [_step(model, metrics, s) for s in range(3)]
    assert ["attn/max_logit" in r for r in rows] == [True, False, True]
    assert ["attn/entropy" in r for r in rows] == [True, False, True]
    assert all("attn/max_logit_bound/blocks.1" in r for r in rows)


def test_torch_transformer_layers_are_named_by_their_attention_module():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 2)
    with Metrics(enc, config=MetricsConfig(probe_every=1)) as metrics:
        x = torch.randn(2, 6, 32)
        loss = enc(x, mask=nn.Transformer.generate_square_subsequent_mask(6), is_causal=True).square().mean()
        loss.backward()
        row = metrics.collect(0, loss)
    assert {k for k in row if k.startswith("attn/max_logit/")} == {
        "attn/max_logit/layers.0.self_attn",
        "attn/max_logit/layers.1.self_attn",
    }
    assert 0 < row["attn/entropy_min"] <= math.log(6)


def test_eval_calls_other_models_and_disabled_taps_record_nothing():
    torch.manual_seed(0)
    model, other = Net(mask="causal"), Net(mask="causal")
    with (
        Metrics(model, config=MetricsConfig(probe_every=1)) as metrics,
        Metrics(other, config=MetricsConfig(probe_every=1, sdpa=False)) as off,
    ):
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 7, 8))
        model.train()
        other(torch.randn(2, 7, 8)).sum().backward()  # SDPA calls of a model the tap is not for
        assert not [k for k in metrics.collect(0) if k.startswith("attn")]
        assert not [k for k in off.collect(0) if k.startswith("attn")]


def test_two_taps_share_the_wrapper_and_the_last_detach_restores_torch():
    torch.manual_seed(0)
    a, b = Net(mask="causal"), Net(mask="causal")
    ma = Metrics(a, config=MetricsConfig(probe_every=1)).attach()
    mb = Metrics(b, config=MetricsConfig(probe_every=1)).attach()
    assert F.scaled_dot_product_attention is not ORIGINAL
    assert "attn/max_logit/blocks.0" in _step(a, ma)
    assert "attn/max_logit/blocks.0" in _step(b, mb)
    ma.detach()
    assert "attn/max_logit/blocks.0" in _step(b, mb, 1)
    gc.collect()  # taps of metrics other tests dropped without detaching leave with them
    mb.detach()
    assert not attention._taps and F.scaled_dot_product_attention is ORIGINAL


def test_the_wrapper_returns_torchs_result_and_a_failing_tap_only_warns(monkeypatch):
    torch.manual_seed(0)
    model = Net(mask="causal")
    x = torch.randn(2, 7, 8)
    with torch.no_grad():
        plain = model(x)
    with Metrics(model, config=MetricsConfig(probe_every=1)) as metrics:
        with torch.no_grad():
            assert torch.equal(model(x), plain)
        monkeypatch.setattr(metrics._sdpa, "_record", lambda *a: 1 / 0)
        with pytest.warns(RuntimeWarning, match="attention metrics of 'blocks.0' skipped"):
            model(x)


def test_sdpa_flag_is_validated():
    with pytest.raises(TypeError, match="sdpa"):
        MetricsConfig(sdpa="yes")


class TorchEncoder(nn.Module):
    """nn.TransformerEncoderLayer: its attention has one fused in_proj, no separate q/k Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 32)
        self.enc = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


@pytest.mark.parametrize(
    "build,scaled", [(lambda: Net(mask="causal"), True), (TorchEncoder, False)], ids=["separate-q-k", "fused-in-proj"]
)
def test_qk_clip_acts_on_sdpa_layers_with_q_and_k_projections_and_reports_the_others(build, scaled):
    from sdcscope.guard import Guard, GuardConfig

    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(
        model, opt, GuardConfig.from_dict({"qk_clip": 1e-3, "abft": None}), loss_fn=lambda m, b: m(b).square().mean()
    ).attach()
    x = torch.randn(3, 7, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with guard.step(0, x):
        loss = model(x).square().mean()
        loss.backward()
    guard.optimizer_step(loss)
    guard.close()
    found = [e for e in guard.events if e["detector"] == "attention_logit"]
    assert found and all(e["verdict"] == "high" for e in found)
    if scaled:
        assert {e["module"] for e in found} == {"blocks.0", "blocks.1"}
        assert all(e["action"] == "qk_clip" and e["evidence"]["scale"] < 1 for e in found)
        gamma = found[0]["evidence"]["scale"]  # W_q after the SGD step, then scaled by gamma
        w = model.blocks[0].q.weight
        step = before["blocks.0.q.weight"] - 0.01 * w.grad
        assert torch.allclose(w, step * gamma, rtol=1e-5, atol=1e-7)
    else:
        (e,) = found
        assert e["module"] == "enc.self_attn" and e["action"] == "report"
        assert "no separate q/k nn.Linear under 'enc.self_attn'" in e["evidence"]["qk_clip"]
