"""The Guard on models and loops unlike the reference GPT: parametrized weights, sparse
gradients, layers unfrozen mid-run, in-place activations after a faulty layer, and Linears their
parent applies with ``F.linear``."""

import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from helpers import ce, deep_mlp, guarded_train, learnable_batch, random_flip
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector


def run(model, guard, steps, *, before=lambda step: None, inside=lambda step: None, batch=learnable_batch):
    opt = guard.optimizer
    for step in range(steps):
        before(step)
        b = batch(step)
        opt.zero_grad()
        with guard.step(step, b):
            loss = ce(model, b)
            loss.backward()
            inside(step)
        guard.optimizer_step(loss)
    return guard.events


def guard_for(model, config=None, **kw):
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    return Guard(
        model, opt, config or GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=ce, **kw
    ).attach()


def test_a_parametrized_linear_is_left_to_the_other_detectors_and_never_touched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), spectral_norm(nn.Linear(32, 32)), nn.Tanh(), nn.Linear(32, 4))
    u = model[2].parametrizations.weight[0]._u.clone()
    guard = guard_for(model)
    assert torch.equal(u, model[2].parametrizations.weight[0]._u)  # building the guard read no weight
    assert guard.abft.skipped == ["2"] and [x.name for x in guard.abft.layers] == ["0", "4"]
    assert run(model, guard, 8) == [] and guard.discarded_steps == 0


def test_sparse_gradients_are_measured_and_checked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(40, 3))
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), 0.1),
        GuardConfig(profile="full"),
        run_dir=tempfile.mkdtemp(),
        loss_fn=ce,
    ).attach()

    def batch(step):
        x = torch.randint(0, 50, (8, 5), generator=torch.Generator().manual_seed(step))
        return x, x[:, 0] % 3

    def corrupt(step):
        if step == 4:
            model[0].weight.grad = torch.sparse_coo_tensor(
                [[1]], torch.full((1, 8), float("nan")), (50, 8), check_invariants=True
            )

    events = run(model, guard, 6, batch=batch, inside=corrupt)
    assert [(e["step"], e["detector"], e["evidence"]["params"]) for e in events] == [(4, "nonfinite", ["0.weight"])]
    assert torch.isfinite(model[0].weight).all()


def test_a_layer_unfrozen_mid_run_is_watched_like_the_others():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for p in model[2].parameters():
        p.requires_grad_(False)
    guard = guard_for(model)
    assert guard.abft.skipped_grad_weight == ["2"]

    def unfreeze(step):
        if step == 3:
            for p in model[2].parameters():
                p.requires_grad_(True)

    def corrupt(step):
        if step == 5:
            model[2].weight.grad[3, 4] = float("nan")

    events = run(model, guard, 7, before=unfreeze, inside=corrupt)
    assert guard.abft.skipped_grad_weight == []
    assert [(e["step"], e["detector"], e["module"]) for e in events] == [(5, "nonfinite", "2")]
    assert torch.isfinite(model[2].weight).all()
    assert guard.abft.max_ratio[("2", "grad_weight")] < 1  # its dW is checked since it has one


def test_an_injected_fault_next_to_an_inplace_activation():
    for site, gemm in (("gemm.forward", "forward"), ("activation", "forward"), ("gemm.grad_input", "grad_input")):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)
        )
        spec = FaultSpec(
            site=site,
            target="2",
            model="bitflip",
            bits=(30,),
            seed=1,
            pattern={"kind": "element", "index": [2, 3]},
            schedule={"kind": "transient", "step": 2},
        )
        inj = Injector(model, [spec]).attach()
        guard = guard_for(model)
        events = run(model, guard, 4, before=inj.set_position)
        assert [(e["step"], e["module"], e["gemm"], e["verdict"]) for e in events if e["detector"] == "abft"] == [
            (2, "2", gemm, "transient")
        ], site
        assert [(r["step"], r["index"]) for r in inj.records] == [(2, [2 * 16 + 3])]


def test_weights_the_attention_applies_with_f_linear_are_checked_there():
    """nn.MultiheadAttention applies out_proj.weight and its own in_proj_weight with F.linear:
    out_proj is found after two sampled steps without its forward, in_proj_weight at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Linear(16, 4))
    guard = guard_for(model, GuardConfig(profile="full", abft={"layer_fraction": 0.25}))

    def batch(step):
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(step))
        return x, x[..., :4].argmax(-1)

    def seq_ce(model, b):
        return F.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten())

    guard.loss_fn = seq_ce
    sampled = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            sampled.append(sorted(guard.abft.active_layers))
            b = batch(step)
            guard.optimizer.zero_grad()
            with guard.step(step, b):
                loss = seq_ce(model, b)
                loss.backward()
            guard.optimizer_step(loss)
    assert guard.events == [] and guard.abft.unreached == set()
    assert not [w for w in caught if "ABFT" in str(w.message)]
    assert sum(s.count("0.self_attn.out_proj") for s in sampled) >= 3  # it stays in the rotation
    ratios = guard.abft.max_ratio
    assert all(ratios[("0.self_attn.out_proj", g)] < 1 for g in ("forward", "grad_input", "grad_weight"))
    assert all(ratios[("0.self_attn.in_proj_weight", g)] < 1 for g in ("forward", "grad_weight"))  # x needs no dX


# -- 1. a model built under torch.set_default_dtype(torch.float64) ---------------------------------
@pytest.mark.parametrize("fault", [False, True])
def test_abft_checks_a_model_built_under_a_float64_default_dtype(fault):
    """ABFT's fused judgement built its result vector in the default dtype: under a float64
    default every check raised (an ``internal_error`` event each step, no GEMM checked)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = deep_mlp()
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        inj = Injector(model, [random_flip("gemm.forward", step=3, bit=62)], opt).attach() if fault else None
        guard = Guard(
            model, opt, GuardConfig(profile="full", metrics=None), run_dir=tempfile.mkdtemp(), loss_fn=ce
        ).attach()
        events = guarded_train(model, opt, guard, inj, 5)
        guard.close()
    finally:
        torch.set_default_dtype(old)
    assert guard.abft.checks_run > 0
    assert [e for e in events if e[1] == "abft"] == (
        [(3, "abft", "transient", "2", "forward", "recompute")] if fault else []
    )
    assert not [e for e in events if e[1] == "guard"]


def test_the_default_guard_under_a_float64_default_dtype_raises_no_internal_error():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = deep_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = Guard(model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
        assert guarded_train(model, opt, guard, None, 3) == []  # stable rank (step 0) included
    finally:
        torch.set_default_dtype(old)
