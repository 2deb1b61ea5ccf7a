"""Each metric of sdcscope.observe.Metrics against a direct computation on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import MLP, TinyTransformer, lm_batch, lm_loss
from sdcscope.observe import Metrics, MetricsConfig


def approx(a, b, rel=1e-4, abs=1e-7):
    return a == pytest.approx(b, rel=rel, abs=abs)


@pytest.mark.parametrize(
    "opt_name,source",
    [
        ("adamw", "optimizer"),
        ("adamw", "copy"),
        ("adam_l2", "optimizer"),
        ("sgd_momentum", "optimizer"),
        ("sgd_nesterov", "optimizer"),
        ("sgd", "optimizer"),
        ("rmsprop", "auto"),
    ],
)
def test_grad_param_update_metrics_match_direct(opt_name, source):
    torch.manual_seed(0)
    model = MLP()
    params = list(model.parameters())
    opt = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "adam_l2": lambda: torch.optim.Adam(params, lr=1e-2, weight_decay=0.05),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
        "sgd_nesterov": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, weight_decay=0.01),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3),
    }[opt_name]()
    m = Metrics(model, opt, MetricsConfig(update_ratio=source, stats_every=1))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in params]
        moments = [opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state.get(p, {}) else None for p in params]
        m.after_backward()
        m.before_optimizer_step()
        before = [p.detach().clone() for p in params]
        opt.step()
        m.after_optimizer_step()
        out = m.collect(step)
        opt.zero_grad()

        gn = math.sqrt(sum(g.pow(2).sum().item() for g in grads))
        assert approx(out["grad_norm"], gn)
        assert approx(out["grad_norm/fc1"], math.sqrt(grads[0].pow(2).sum().item() + grads[1].pow(2).sum().item()))
        pn = math.sqrt(sum(p.pow(2).sum().item() for p in params))
        assert approx(out["param_norm"], pn)
        delta = [p.detach() - b for p, b in zip(params, before)]
        dn = math.sqrt(sum(d.pow(2).sum().item() for d in delta))
        assert approx(out["update_ratio"], dn / pn, rel=2e-3)
        fc2 = math.sqrt(sum(d.pow(2).sum().item() for d in delta[2:]))
        fc2p = math.sqrt(sum(p.pow(2).sum().item() for p in params[2:]))
        assert approx(out["update_ratio/fc2"], fc2 / fc2p, rel=2e-3)
        dot = sum((d * g).sum().item() for d, g in zip(delta, grads))
        assert approx(out["cos/update_grad"], dot / (dn * gn), rel=2e-3, abs=2e-4)
        assert out["cos/update_grad"] < 0  # a descent step
        if step > 0 and moments[0] is not None:
            mn = math.sqrt(sum(mm.pow(2).sum().item() for mm in moments))
            gm = sum((g * mm).sum().item() for g, mm in zip(grads, moments))
            assert approx(out["cos/grad_moment"], gm / (gn * mn))
        assert out["lr"] == opt.param_groups[0]["lr"]


def test_adam_g2_over_v_and_preclip_norm():
    torch.manual_seed(1)
    model = MLP()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.95))
    m = Metrics(model, opt, MetricsConfig(stats_every=1))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        raw = math.sqrt(sum(p.grad.pow(2).sum().item() for p in params))
        m.after_backward()
        nn.utils.clip_grad_norm_(params, raw / 10)  # clipping must not change grad_norm
        g2 = [p.grad.pow(2).sum().item() for p in params]
        t = opt.state[params[0]]["step"].item() if opt.state else 0
        v = [opt.state[p]["exp_avg_sq"].sum().item() / (1 - 0.95**t) if t else None for p in params]
        m.before_optimizer_step()
        opt.step()
        m.after_optimizer_step()
        out = m.collect(step)
        opt.zero_grad()
        assert approx(out["grad_norm"], raw)
        if t:
            assert approx(out["adam/g2_over_v"], sum(g2) / sum(v))
            per = [(g2[0] + g2[1]) / (v[0] + v[1]), (g2[2] + g2[3]) / (v[2] + v[3])]
            assert approx(out["adam/g2_over_v_min"], min(per))
            assert approx(out["adam/g2_over_v_max"], max(per))
        else:
            assert "adam/g2_over_v" not in out


def test_attention_logits_entropy_lse_kurtosis_stable_rank():
    torch.manual_seed(2)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = MetricsConfig(stats_every=2, probe_every=2, stable_rank_every=2, power_iters=30)
    seen = {}

    def spy(name):
        def hook(mod, args, out):
            seen[name] = (tuple(a.detach().clone() for a in args), out.detach().clone())

        return hook

    blk = model.blocks[0]
    for name, mod in (
        ("score", blk.score),
        ("context", blk.context),
        ("head", model.head),
        ("block1", model.blocks[1]),
    ):
        mod.register_forward_hook(spy(name))
    with torch.no_grad():  # a weight with a known spectrum: σ = 4, 2, 1, 1, ...
        u, _, vt = torch.linalg.svd(torch.randn(16, 16))
        s = torch.ones(16)
        s[0], s[1] = 4.0, 2.0
        blk.q_proj.weight.copy_(u @ torch.diag(s) @ vt)
    with Metrics(model, opt, cfg) as m:
        for step in range(2):
            loss = lm_loss(model, lm_batch(step))
            loss.backward()
            out = m.collect(step, loss)
            opt.zero_grad()
            (q, kt), scores = seen["score"]
            bound = (q.norm(dim=-1).amax(-1) * kt.norm(dim=-2).amax(-1)).amax().item()
            assert scores.numel() <= q.numel() + kt.numel()  # short rows: the bound is the exact max
            assert approx(out["attn/max_logit_bound/blocks.0"], scores.max().item())
            assert out["attn/max_logit_bound"] >= out["attn/max_logit_bound/blocks.0"]
            assert approx(out["loss"], loss.item())
            if step == 0:  # statistics and probe step
                lse = torch.logsumexp(seen["head"][1], -1)
                assert approx(out["logits/lse_mean"], lse.mean().item())
                assert approx(out["logits/lse_max"], lse.max().item())
                assert approx(out["attn/max_logit/blocks.0"], scores.max().item())
                assert out["attn/max_logit/blocks.0"] <= bound + 1e-6
                p = seen["context"][0][0]
                ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean().item()
                assert approx(out["attn/entropy/blocks.0"], ent)
                x = seen["block1"][1].reshape(-1, 16)
                s2 = x.pow(2).mean(0)
                assert approx(out["act/kurtosis/blocks.1"], (s2.pow(2).mean() / s2.mean() ** 2).item())
                # ‖W‖_F² / σ_max² = (16 + 4 + 14·1) / 16
                assert approx(out["stable_rank/blocks.0.q_proj.weight"], 34 / 16, rel=1e-3)
                assert out["stable_rank_min"] <= 34 / 16 + 1e-3
            else:  # every-step tier only
                assert "attn/max_logit_bound" in out and "param_norm" not in out
                assert "logits/lse_mean" not in out
                assert "attn/max_logit/blocks.0" not in out
                assert "act/kurtosis/blocks.1" not in out
                assert "stable_rank/blocks.0.q_proj.weight" not in out
    assert not m._handles  # detached on exit


def test_long_rows_bound_the_logit_by_q_and_k_norms_and_tiers_hook_only_their_steps():
    torch.manual_seed(4)
    model = TinyTransformer(seq=24)  # 24 > 2 · head dim 8: q and k cost less to read than the logits
    blk = model.blocks[0]
    seen = {}
    blk.score.register_forward_hook(lambda mod, args, out: seen.update(score=(args, out.detach())))
    with Metrics(model, None, MetricsConfig(stats_every=3, probe_every=2)) as m:
        for step in range(4):
            hooked = {
                name: bool(mod._forward_hooks or mod._forward_pre_hooks)
                for name, mod in (("context", blk.context), ("head", model.head), ("block", model.blocks[1]))
            }
            assert hooked == {"context": step % 2 == 0, "head": step % 3 == 0, "block": step % 2 == 0}
            lm_loss(model, lm_batch(step, seq=24)).backward()
            out = m.collect(step)
            (q, kt), scores = seen["score"]
            bound = (q.norm(dim=-1).amax(-1) * kt.norm(dim=-2).amax(-1)).amax().item()
            assert approx(out["attn/max_logit_bound/blocks.0"], bound)
            assert scores.max().item() <= bound * (1 + 1e-6)
            assert ("attn/max_logit/blocks.0" in out) == (step % 2 == 0)
    assert len(blk.score._forward_hooks) == 1 and not any(  # every hook gone on exit but the spy
        mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules() if mod is not blk.score
    )


def test_one_host_sync_per_collect(monkeypatch):
    torch.manual_seed(3)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = Metrics(model, opt, MetricsConfig(stats_every=1, probe_every=1, stable_rank_every=1)).attach()
    calls = {"tolist": 0, "item": 0, "__float__": 0}
    counting = [False]
    step_counters: set[int] = set()  # the optimizer's CPU step counters (read as floats: no sync)
    for name in calls:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if counting[0] and id(self) not in step_counters:
                calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    def metered(fn, *args):
        step_counters.update(id(st["step"]) for st in opt.state.values())
        counting[0] = True
        try:
            return fn(*args)
        finally:
            counting[0] = False

    for step in range(2):
        loss = lm_loss(model, lm_batch(step))
        loss.backward()
        metered(m.after_backward)
        metered(m.before_optimizer_step)
        opt.step()
        metered(m.after_optimizer_step)
        opt.zero_grad()
        out = metered(m.collect, step, loss)
    # the only read of computed values is one .tolist() per collect
    assert calls == {"tolist": 2, "item": 0, "__float__": 0}
    assert len(out) > 40 and all(isinstance(v, float) for v in out.values())


def test_eval_forward_is_not_recorded_and_optimizer_hooks():
    torch.manual_seed(4)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = Metrics(model, opt, MetricsConfig(output_module="fc2", stats_every=1)).attach(optimizer_hooks=True)
    model.eval()
    model(torch.randn(3, 12))  # an evaluation pass: not part of the step's statistics
    model.train()
    x = torch.randn(8, 12)
    loss = nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long))
    loss.backward()
    opt.step()  # the step hooks call before/after_optimizer_step
    opt.zero_grad()
    out = m.collect(0, loss.item())
    lse = torch.logsumexp(model.fc2(torch.tanh(model.fc1(x))), -1)  # after the step: differs
    assert "update_ratio" in out and "param_norm" in out and out["loss"] == loss.item()
    assert out["logits/lse_max"] != pytest.approx(lse.max().item(), rel=1e-9)
    m.close()
    assert not m._handles


def test_config_validation_and_module_errors():
    with pytest.raises(ValueError, match="update_ratio.*allowed: auto, optimizer, copy, off"):
        MetricsConfig(update_ratio="exact")
    with pytest.raises(ValueError, match="probe_every=0"):
        MetricsConfig(probe_every=0)
    with pytest.raises(ValueError, match="sink.*allowed"):
        MetricsConfig(sink="csv")
    with pytest.raises(TypeError, match="kurtosis_modules=3 must be a pattern or a list"):
        MetricsConfig(kurtosis_modules=3)
    assert MetricsConfig(kurtosis_modules="blocks.*").kurtosis_modules == ("blocks.*",)
    with pytest.raises(ValueError, match=r"output_module pattern 'haed'.*closest: head"):
        Metrics(TinyTransformer(), config=MetricsConfig(output_module="haed"))
    with pytest.raises(ValueError, match="attn_score pattern"):
        Metrics(MLP(), config=MetricsConfig(attn_score="*score"))
    with pytest.raises(ValueError, match="stable_rank_params pattern"):
        Metrics(MLP(), config=MetricsConfig(stable_rank_params=("nope*",)))
    with pytest.raises(TypeError, match="MetricsConfig"):
        Metrics(MLP(), config={"probe_every": 3})
    # defaults that match nothing are fine: an MLP has no attention and no 'head'
    Metrics(MLP()).attach().detach()


def test_one_nonfinite_gradient_leaves_the_other_layers_norms_finite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m = Metrics(model, None, MetricsConfig())
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    m.after_backward()
    out = m.collect(0)
    assert out["grad_norm/0"] == math.inf
    assert approx(out["grad_norm/1"], math.hypot(model[1].weight.grad.norm().item(), model[1].bias.grad.norm().item()))


def test_a_discarded_steps_forward_statistics_are_not_the_next_rows():
    torch.manual_seed(0)
    model, x = TinyTransformer(), lm_batch(0)
    cfg = MetricsConfig(probe_every=1)
    with Metrics(model, None, cfg) as m2:
        lm_loss(model, x).backward()
        m2.after_backward()
        clean = m2.collect(0)
    keys = [k for k in clean if k.startswith(("attn/", "act/", "logits/"))]
    assert keys
    with Metrics(model, None, cfg) as m:
        with torch.no_grad():
            model.blocks[0].q_proj.weight.mul_(50)  # a corrupted first execution: huge logits
        lm_loss(model, x).backward()
        with torch.no_grad():
            model.blocks[0].q_proj.weight.div_(50)
        m.restart_step()  # what the Guard does before a replay, and on a veto or rollback
        lm_loss(model, x).backward()
        m.after_backward()
        again = m.collect(0)
        assert all(approx(again[k], clean[k]) for k in keys)
        # a step that was never collected (discarded) does not leak into the next one begun
        lm_loss(model, x)
        assert m._max or m._mean
        m.begin_step(5)
        assert m._max == {} and m._mean == {}


def test_adam_ratio_takes_the_gradients_a_trainer_clips_after_it():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    m = Metrics(model, opt, MetricsConfig(stats_every=1))
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        (model(torch.randn(16, 12, generator=g)) ** 2).sum().mul(100).backward()
        m.after_backward()
        m.before_optimizer_step(clip_norm=0.5)  # the trainer clips next
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if step == 1:  # g²/v̂ with the clipped gradient, v̂ built from step 0's clipped one
            g2 = sum(p.grad.pow(2).sum() for p in model.parameters())
            v_hat = sum(opt.state[p]["exp_avg_sq"].sum() for p in model.parameters()) / (1 - 0.999)
            expected = (g2 / v_hat).item()
        opt.step()
        m.after_optimizer_step()
        row = m.collect(step)
    assert approx(row["adam/g2_over_v"], expected, rel=1e-3)


def test_auto_update_source_copies_when_the_reconstruction_is_not_exact():
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.emb(x).mean(1))

    torch.manual_seed(0)
    model = Sparse()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    m = Metrics(model, opt, MetricsConfig(stats_every=1))
    torch.nn.functional.cross_entropy(model(torch.tensor([[1, 2, 3]])), torch.tensor([0])).backward()
    before = [p.detach().clone() for p in model.parameters()]
    m.after_backward()
    m.before_optimizer_step()
    opt.step()
    m.after_optimizer_step()
    out = m.collect(0)
    d2 = sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before))
    p2 = sum(p.detach().pow(2).sum() for p in model.parameters())
    assert approx(out["update_ratio"], (d2 / p2).sqrt().item()) and "update_ratio/emb" in out


@pytest.mark.parametrize("exact", [True, False], ids=["svd", "power-iteration"])
def test_stable_rank_exact_for_small_weights_by_power_iteration_above(monkeypatch, exact):
    import sdcscope.observe.metrics as metrics_module

    if not exact:  # as a weight above the SVD size limit
        monkeypatch.setattr(metrics_module, "_EXACT_SIGMA", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    with torch.no_grad():  # σ = 4, 2, then fourteen 1s: ‖W‖_F² / σ_max² = 34 / 16
        u, _, vt = torch.linalg.svd(torch.randn(16, 16))
        s = torch.ones(16)
        s[0], s[1] = 4.0, 2.0
        model[0].weight.copy_(u @ torch.diag(s) @ vt)
    m = Metrics(model, None, MetricsConfig(stable_rank_every=1, power_iters=3))
    assert approx(m.collect(0)["stable_rank/0.weight"], 34 / 16, rel=1e-4)
