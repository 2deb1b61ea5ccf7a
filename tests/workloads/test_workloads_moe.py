"""The mixture-of-experts GPT: its layer computes what its experts and router say, routing ties
go to the lower expert, training is bitwise deterministic, and the load-balancing loss trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sdcscope.workloads import WorkloadConfig
from sdcscope.workloads.moe import MoEConfig, MoEGPT, MoELayer, route

TINY = dict(n_layer=1, n_head=2, d_model=32, block_size=16, mlp_ratio=2, n_expert=2)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (4, 17), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_is_the_router_weighted_sum_of_its_chosen_experts(top_k):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**TINY, top_k=top_k))
    x = torch.randn(2, 5, 32)
    out = layer(x)
    flat = x.reshape(-1, 32)
    probs = F.softmax(layer.router(flat), dim=-1)
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for e in torch.argsort(-probs[t])[:top_k].tolist():  # no ties in random logits
            want[t] += probs[t, e] * layer.experts[e](flat[t : t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, 32), want)


def test_routing_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    _, weights, experts = route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights[1], torch.full((2,), 0.25))


def _train(seed: int, steps: int = 2, **cfg) -> MoEGPT:
    torch.manual_seed(seed)
    model = MoEGPT(MoEConfig(**{**TINY, "top_k": 2, **cfg}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
    return model


def test_same_seed_gives_bitwise_identical_parameters():
    a, b, c = _train(0), _train(0), _train(1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_load_balancing_loss_gradient_is_its_weight_times_the_aux_gradient():
    """The gradient the layer hands the router through its output equals the one of adding
    ``aux_loss · aux`` to the loss explicitly."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**TINY, top_k=1, aux_loss=0.5))
    x = torch.randn(6, 32)
    layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.aux_weight = 0.0
    out = layer(x)
    probs = F.softmax(layer.router(x), dim=-1)
    share = torch.bincount(probs.argmax(-1), minlength=2).float() / 6
    (out.sum() + 0.5 * 2 * (share * probs.mean(0)).sum()).backward()
    torch.testing.assert_close(with_aux, layer.router.weight.grad)
    assert layer.aux is not None and float(layer.aux) >= 1.0 - 1e-6  # E·Σ f·P >= 1, equality when balanced


def test_moe_config_refuses_more_choices_than_experts():
    with pytest.raises(ValueError, match=r"top_k=3 must be <= n_expert=2"):
        MoEConfig(**TINY, top_k=3)
    with pytest.raises(ValueError, match="moe preset"):
        WorkloadConfig(workload="moe", preset="base")
