"""ABFT checksums: quiet on clean steps, and events naming layer, GEMM and element on faults."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import MLP, TinyTransformer, flip_bit, lm_batch, lm_loss, on_grad_weight
from sdcscope.detect import ABFTConfig, ABFTDetector, gemm_check, rounding_model

BOTH = ABFTConfig(checksums="both")  # element localisation (row × column)


def train(model, det, steps, *, dtype=None, autocast=False, micro=1, lr=1e-2, start=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    events = []
    for step in range(start, start + steps):
        det.begin_step(step)
        for mb in range(micro):
            if autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lm_loss(model, lm_batch(step * micro + mb))
            else:
                loss = lm_loss(model, lm_batch(step * micro + mb))
            loss.backward()
        events += det.check(step)
        opt.step()
        opt.zero_grad()
    return events


def transformer(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyTransformer(**kw)


# ------------------------------------------------------------------ clean runs
@pytest.mark.parametrize("checksums", ["column", "both"])
def test_clean_fp32_transformer_no_events_all_gemms_checked(checksums):
    model = transformer()
    det = ABFTDetector(model, ABFTConfig(checksums=checksums)).attach()
    assert train(model, det, 3) == []
    # 2 blocks × (6 Linear + 2 MatMul) + head = 17 layers × 3 GEMMs, per step
    assert det.checks_run == 3 * 17 * 3 and det.unjudged == 0
    assert 0 < max(det.max_ratio.values()) < 1.0  # fp32 with fp64 checksums: far below c = 8
    det.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_clean_mlp_3d_input_no_events():
    torch.manual_seed(0)
    model = MLP()
    det = ABFTDetector(model).attach()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(3, 5, 12)  # input does not require grad: fc1 has no dX check
        model(x).pow(2).mean().backward()
        assert det.check(step) == []
        opt.step()
        opt.zero_grad()
    assert det.checks_run == 3 * 5


@pytest.mark.parametrize("mode", ["bf16_model", "autocast"])
def test_clean_bf16_no_events(mode):
    model = transformer(1)
    if mode == "bf16_model":
        model = model.to(torch.bfloat16)
    det = ABFTDetector(model, BOTH).attach()
    assert train(model, det, 3, autocast=mode == "autocast") == []
    assert det.checks_run == 3 * 17 * 3
    assert max(det.max_ratio.values()) < 4.0  # bf16 output rounding: ~2 model stds at most


def test_gradient_accumulation_and_tied_head():
    model = transformer(2, tied=True)
    det = ABFTDetector(model).attach()
    assert det.skipped_grad_weight == []
    assert train(model, det, 2, micro=2) == []
    assert det.checks_run == 2 * 2 * 17 * 3  # the tied head's own dW too


# ------------------------------------------------------------------ injected faults
def corrupt_forward(module, index, bit):
    def hook(mod, args, out):
        out = out.clone()
        flip_bit(out, index, bit)
        return out

    return module.register_forward_hook(hook)


def test_gradient_penalty_skips_the_backward_checks_of_the_calls_it_runs_through():
    """A create_graph backward (a gradient penalty) feeds more terms into the same autograd nodes:
    the backward products of those calls are not checked alone (no false positive every step);
    their forward still is, and a flip there is found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    det = ABFTDetector(model).attach()

    def penalized(x, y):
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(model(x), y)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + 0.1 * g.pow(2).sum()

    for step in range(3):
        penalized(torch.randn(8, 16), torch.randint(0, 4, (8,))).backward()
        assert det.check(step) == []
        model.zero_grad()
    assert det.skipped_higher_order == 3 * 2 and det.checks_run == 3 * 2  # forward checks only
    corrupt_forward(model[2], (3, 1), 30)
    det.begin_step(3)  # ABFT's forward hook back behind the new one
    penalized(torch.randn(8, 16), torch.randint(0, 4, (8,))).backward()
    assert [(e.module, e.gemm) for e in det.check(3)] == [("2", "forward")]


@pytest.mark.parametrize("scaled", ["x", "dy"])
def test_tiny_operands_raise_no_false_mismatch_and_flips_are_still_found(scaled):
    """Operands below ~1e-19 (a saturated gate's dY): their fp32 squared norms underflow; the
    norm floor keeps the threshold from collapsing to 0, and an exponent flip is still far above."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64))
    det = ABFTDetector(model).attach()
    for step, sc in enumerate([1e-12, 1e-19, 1e-22, 1e-25]):
        x = (torch.randn(64, 256) * (sc if scaled == "x" else 1)).requires_grad_(True)
        y = model(x)
        (y * torch.randn_like(y) * (sc if scaled == "dy" else 1)).sum().backward()
        assert det.check(step) == [], sc
    corrupt_forward(model[0], (5, 7), 30)
    det.begin_step(4)
    x = (torch.randn(64, 256) * (1e-25 if scaled == "x" else 1)).requires_grad_(True)
    model(x).sum().backward()
    assert [(e.gemm, e.index) for e in det.check(4)][:1] == [("forward", (None, 7))]  # column 7


def test_forward_output_bitflip_located():
    model = transformer(3)
    idx = (1, 5, 7)
    corrupt_forward(model.blocks[0].fc, idx, 30)  # registered before ABFT: ABFT sees it
    det = ABFTDetector(model, BOTH).attach()
    events = train(model, det, 1)
    fwd = [e for e in events if e.gemm == "forward"]
    assert fwd[0].module == "blocks.0.fc" and fwd[0].index == idx
    assert abs(fwd[0].evidence["residual"]) > fwd[0].evidence["threshold"] > 0
    assert fwd[0].verdict == "checksum_mismatch" and fwd[0].detector == "abft"
    # the same wrong value flows on; downstream GEMMs computed correctly on it stay quiet
    assert {e.module for e in fwd} == {"blocks.0.fc"}


@pytest.mark.parametrize("gemm", ["forward", "grad_input", "grad_weight"])
def test_default_column_checksums_name_layer_gemm_and_column(gemm):
    model = transformer(3)
    target = model.blocks[1].fc
    if gemm == "forward":
        idx = (1, 5, 7)
        corrupt_forward(target, idx, 30)
    else:
        idx = (0, 3, 9) if gemm == "grad_input" else (4, 11)

        def hook(grad):
            grad = grad.clone()
            flip_bit(grad, idx, 30 if abs(grad[idx].item()) < 1 else 23)
            return grad

        if gemm == "grad_weight":
            on_grad_weight(target, hook)
        else:
            target.register_full_backward_hook(lambda m, gi, go: (hook(gi[0]),))
    det = ABFTDetector(model).attach()  # ABFTConfig().checksums == "column"
    events = [e for e in train(model, det, 1) if e.gemm == gemm]
    assert [(e.module, e.index[-1]) for e in events][:1] == [("blocks.1.fc", idx[-1])]
    assert all(i is None for i in events[0].index[:-1])  # no row side: the column only


def test_forward_injector_attached_after_abft_is_seen():
    model = transformer(3)
    det = ABFTDetector(model, BOTH).attach()
    idx = (2, 0, 4)
    corrupt_forward(model.blocks[1].o_proj, idx, 30)  # after ABFT; begin_step re-orders
    fwd = [e for e in train(model, det, 1) if e.gemm == "forward"]
    assert [(e.module, e.index) for e in fwd] == [("blocks.1.o_proj", idx)]


def test_forward_moderate_exponent_flip_detected_fp32():
    model = transformer(4)
    x, _ = lm_batch(0)
    with torch.no_grad():
        y = model.blocks[1].q_proj(
            model.blocks[1].ln(model.blocks[0](model.tok(x) + model.pos(torch.arange(x.shape[1]))))
        )
    # find an element whose exponent bit 25 is clear: flipping it multiplies by 2**4
    flat = y.reshape(-1).view(torch.int32)
    pos = int(torch.nonzero((flat & (1 << 25)) == 0)[0])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), y.shape))
    corrupt_forward(model.blocks[1].q_proj, idx, 25)
    det = ABFTDetector(model, BOTH).attach()
    events = [e for e in train(model, det, 1) if e.gemm == "forward"]
    assert [(e.module, e.index) for e in events] == [("blocks.1.q_proj", idx)]


def test_matmul_score_forward_flip_located():
    model = transformer(5)
    idx = (2, 1, 6, 3)  # (batch, head, query, key)
    corrupt_forward(model.blocks[1].score, idx, 30)
    det = ABFTDetector(model, BOTH).attach()
    fwd = [e for e in train(model, det, 1) if e.gemm == "forward"]
    assert fwd[0].module == "blocks.1.score" and fwd[0].index == idx


def test_grad_input_bitflip_located():
    model = transformer(6)
    idx = (0, 3, 9)

    def hook(mod, grad_input, grad_output):
        g = grad_input[0].clone()
        flip_bit(g, idx, 30 if abs(g[idx].item()) < 1 else 23)
        return (g,)

    model.blocks[0].proj.register_full_backward_hook(hook)
    det = ABFTDetector(model, BOTH).attach()
    events = train(model, det, 1)
    dx = [e for e in events if e.gemm == "grad_input"]
    assert (dx[0].module, dx[0].index) == ("blocks.0.proj", idx)
    assert {(e.module, e.gemm) for e in events} == {("blocks.0.proj", "grad_input")}


def test_grad_input_located_when_injector_attached_after_abft():
    model = transformer(6)
    det = ABFTDetector(model, BOTH).attach()
    idx = (1, 2, 4)

    def hook(mod, grad_input, grad_output):
        g = grad_input[0].clone()
        g[idx] += 1e3
        return (g,)

    model.blocks[1].fc.register_full_backward_hook(hook)  # after ABFT: still seen (view hook)
    events = train(model, det, 1)
    assert [(e.module, e.gemm, e.index) for e in events] == [("blocks.1.fc", "grad_input", idx)]


def _on_grad_input_at_gemm_node(module, fn):
    """Apply ``fn(dX) -> dX`` at the call's GEMM node (addmm/mm), where hardware corrupts it: no
    module backward hook, so ABFT keeps its fast path."""

    def forward_hook(mod, args, out):
        node = out.grad_fn
        while type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0"):
            node = node.next_functions[0][0]
        xi = 1 if type(node).__name__ == "AddmmBackward0" else 0
        node.register_hook(lambda gi, go: tuple(fn(g) if k == xi else g for k, g in enumerate(gi)))

    module.register_forward_hook(forward_hook)


def test_fast_path_reads_dx_and_dw_at_the_gemm_node_and_finds_their_flips():
    """After its first call a plain Linear is checked without the operand view (no pre-hook):
    dY and dX come from one post-hook of the call's GEMM node; flips in dX and dW made at that node
    are found, named and located as on the view path."""
    model = transformer(6)
    det = ABFTDetector(model, BOTH).attach()
    assert train(model, det, 2) == []
    layer = next(x for x in det.layers if x.name == "blocks.1.fc")
    assert layer.fast and layer.pre is None and not layer.module._forward_pre_hooks
    idx_dx, idx_dw = (1, 2, 4), (5, 7)

    def bump(i):
        def fn(g):
            g = g.clone()
            g[i if g.dim() == 2 and len(i) == 2 else (i[0] * 8 + i[1], i[2])] += 1e3  # seq = 8
            return g

        return fn

    _on_grad_input_at_gemm_node(model.blocks[1].fc, bump(idx_dx))  # dX flattened to (B*T, in)
    on_grad_weight(model.blocks[0].proj, bump(idx_dw))
    events = train(model, det, 1, start=2)
    got = {(e.module, e.gemm, e.index) for e in events}
    assert got == {("blocks.1.fc", "grad_input", idx_dx), ("blocks.0.proj", "grad_weight", idx_dw)}


def test_hot_path_builds_the_lines_the_general_path_builds(monkeypatch):
    """Column checks of Linears computing in the checksum dtype skip gemm_lines (the hot path):
    the same ratios on clean steps and the same events (layer, GEMM, column, threshold) for flips
    in Y, dX and dW as the general path."""
    import sdcscope.detect.abft.linear as abft_module

    calls = []
    general = abft_module.gemm_lines
    monkeypatch.setattr(abft_module, "gemm_lines", lambda *a, **k: calls.append(1) or general(*a, **k))

    def bump(i):
        def fn(g):
            g = g.clone()
            g[i] += 1e3
            return g

        return fn

    def run(hot: bool):
        calls.clear()
        model = transformer(6)
        det = ABFTDetector(model, ABFTConfig(kinds=("linear",))).attach()
        if not hot:
            monkeypatch.setattr(det, "_lean_ok", lambda *a: False)
        clean = train(model, det, 2)
        n_calls, ratios = len(calls), dict(det.max_ratio)
        model.blocks[1].v_proj.register_forward_hook(lambda m, a, out: out + bump((0, 3, 5))(torch.zeros_like(out)))
        _on_grad_input_at_gemm_node(model.blocks[1].fc, bump((9, 4)))
        on_grad_weight(model.blocks[0].proj, bump((5, 7)))
        events = train(model, det, 1, start=2)
        return clean, n_calls, ratios, {(e.module, e.gemm, e.index, round(e.evidence["threshold"], 3)) for e in events}

    clean_hot, calls_hot, ratios_hot, events_hot = run(True)
    clean_gen, calls_gen, ratios_gen, events_gen = run(False)
    # hot: only the backward checks of each layer's first call (the view path, before the fast one)
    assert clean_hot == clean_gen == [] and calls_hot == 13 * 2 and calls_gen == 2 * 13 * 3
    assert ratios_hot.keys() == ratios_gen.keys()
    assert all(ratios_hot[k] == pytest.approx(ratios_gen[k], rel=1e-5) for k in ratios_gen)
    assert events_hot == events_gen
    assert {e[:3] for e in events_hot} == {
        ("blocks.1.v_proj", "forward", (None, None, 5)),  # the column
        ("blocks.1.fc", "grad_input", (None, None, 4)),
        ("blocks.0.proj", "grad_weight", (None, 7)),
    }


def test_full_backward_hook_added_later_brings_the_view_path_back():
    """A full backward hook (an injector's dX fault) edits dX after the GEMM node: once one is
    registered, the next step checks that layer through the operand view again."""
    model = transformer(6)
    det = ABFTDetector(model, BOTH).attach()
    assert train(model, det, 2) == []
    idx = (1, 2, 4)

    def hook(mod, grad_input, grad_output):
        g = grad_input[0].clone()
        g[idx] += 1e3
        return (g,)

    model.blocks[1].fc.register_full_backward_hook(hook)
    events = train(model, det, 1, start=2)
    assert [(e.module, e.gemm, e.index) for e in events] == [("blocks.1.fc", "grad_input", idx)]
    assert next(x for x in det.layers if x.name == "blocks.1.fc").pre is not None


def test_grad_weight_bitflip_located_per_call_under_accumulation():
    model = transformer(7)
    idx = (4, 11)
    fired = []

    def hook(grad):
        if len(fired) == 1:  # corrupt the second micro-batch's contribution only
            grad = grad.clone()
            flip_bit(grad, idx, 30 if abs(grad[idx].item()) < 1 else 23)
        fired.append(1)
        return grad

    on_grad_weight(model.blocks[1].q_proj, hook)
    det = ABFTDetector(model, BOTH).attach()
    events = train(model, det, 1, micro=2)
    # the second micro-batch's (only) call: micro-batch 1, call 0 (calls count within a micro-batch)
    assert [(e.module, e.gemm, e.index, e.evidence["micro_batch"], e.evidence["call"]) for e in events] == [
        ("blocks.1.q_proj", "grad_weight", idx, 1, 0)
    ]


def test_matmul_operand_grads_located():
    model = transformer(8)
    ia, ib = (1, 0, 5, 2), (3, 1, 4, 6)

    def hook(mod, grad_input, grad_output):
        ga, gb = grad_input[0].clone(), grad_input[1].clone()
        ga[ia] += 100.0
        gb[ib] -= 100.0
        return ga, gb

    model.blocks[0].context.register_full_backward_hook(hook)
    det = ABFTDetector(model, BOTH).attach()
    events = train(model, det, 1)
    got = {(e.module, e.gemm, e.evidence.get("operand"), e.index) for e in events}
    assert got == {("blocks.0.context", "grad_input", "a", ia), ("blocks.0.context", "grad_weight", "b", ib)}


def test_nonfinite_output_flagged_downstream_unjudged():
    torch.manual_seed(9)
    model = MLP()

    def hook(mod, args, out):
        out = out.clone()
        out[1, 2] = float("nan")
        return out

    model.fc1.register_forward_hook(hook)
    det = ABFTDetector(model, ABFTConfig(gemms=("forward",), checksums="both")).attach()
    model(torch.randn(4, 12)).sum().backward()
    events = det.check(0)
    assert [(e.module, e.index) for e in events] == [("fc1", (1, 2))]
    assert math.isinf(events[0].evidence["ratio"]) and det.unjudged == 1


# ------------------------------------------------------------------ threshold model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_model_below_not_flagged_above_flagged(dtype):
    g = torch.Generator().manual_seed(0)
    n, k, m = 64, 48, 40
    a = torch.randn(n, k, generator=g).to(dtype)
    b = (0.1 * torch.randn(k, m, generator=g)).to(dtype)
    bias = torch.randn(m, generator=g).to(dtype)
    c = (a @ b + bias).to(dtype)
    model = rounding_model(dtype, "cpu", torch.float64)
    c_mult = ABFTConfig().c

    def run(out):
        chk = gemm_check(a, b, out, bias=bias, model=model, checksum_dtype=torch.float64)
        return chk.locate(), chk

    clean, chk = run(c)
    assert clean["ratio"] < c_mult / 4
    i, j = 17, 23
    tau = min(chk.row[1][0, i].item(), chk.col[1][0, j].item())  # model std of row i / col j
    tau_max = max(chk.row[1][0, i].item(), chk.col[1][0, j].item())
    assert clean["ratio"] == pytest.approx(chk.ratio.item())
    below = c.clone()
    below[i, j] += 0.5 * c_mult * tau
    s, _ = run(below)
    assert s["ratio"] <= c_mult
    above = c.clone()
    above[i, j] += 3 * c_mult * tau_max
    s, _ = run(above)
    assert s["ratio"] > c_mult and (s["row"], s["col"]) == (i, j)


def test_rounding_model_units():
    m32 = rounding_model(torch.float32, "cpu", torch.float64)
    assert (m32.u_acc, m32.u_in, m32.narrow) == (2**-24, 0.0, False)
    mb = rounding_model(torch.bfloat16, "cpu", torch.float32)
    assert (mb.u_acc, mb.u_out, mb.u_cs, mb.narrow) == (2**-24, 2**-8, 2**-24, True)
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert rounding_model(torch.float32, "cpu", torch.float64).u_in == 2 * 2**-11
    finally:
        torch.set_float32_matmul_precision(prev)


# ------------------------------------------------------------------ sampling, budget, calibration
def test_every_and_rotation_cover_all_layers():
    model = transformer(10)
    det = ABFTDetector(model, ABFTConfig(every=2, layer_fraction=0.5)).attach()
    seen = []
    for step in range(4):
        det.begin_step(step)
        seen.append(set(det.active_layers))
        loss = lm_loss(model, lm_batch(step))
        loss.backward()
        assert det.check(step) == []
        model.zero_grad()
    assert seen[1] == seen[3] == set()
    assert sorted(map(len, (seen[0], seen[2]))) == [8, 9] and not seen[0] & seen[2]  # 17 layers in 2 slots
    assert seen[0] | seen[2] == {layer.name for layer in det.layers}
    assert det.coverage_bound() == (9, 4)  # every other step, 2 slots
    assert det.checks_run == 17 * 3  # 17 layers × 3 GEMMs, each once


def graph_size(out: torch.Tensor) -> int:
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(nxt for nxt, _ in fn.next_functions)
    return len(seen)


def test_unsampled_step_adds_nothing_to_autograd():
    model = transformer(11)
    x, _ = lm_batch(0)
    plain = graph_size(model(x))
    det = ABFTDetector(model, ABFTConfig(every=2)).attach()
    det.begin_step(0)
    assert graph_size(model(x)) > plain  # sampled: operand views
    det.check(0)  # arms step 1: not sampled
    out = model(x)
    assert graph_size(out) == plain
    out.sum().backward()
    assert det.check(1) == [] and det.checks_run == 17  # only step 0's forward checks


def test_budget_shrinks_the_rotation():
    model = transformer(12)
    det = ABFTDetector(model, ABFTConfig(budget=0.02)).attach()
    sizes = []
    for step in range(6):
        det.begin_step(step)
        sizes.append(len(det.active_layers))
        lm_loss(model, lm_batch(step)).backward()
        assert det.check(step) == []
        model.zero_grad()
    assert sizes[0] == 17 and sizes[-1] < 17


def test_calibration_tightens_thresholds():
    model = transformer(13)
    det = ABFTDetector(model, ABFTConfig(calibration_steps=2)).attach()
    assert train(model, det, 3) == []
    th = [det.threshold(layer.name, "forward") for layer in det.layers]
    assert all(0.5 <= t < 8.0 for t in th)


def test_config_validation():
    with pytest.raises(ValueError, match="gemm 'fwd'.*allowed: forward, grad_input, grad_weight"):
        ABFTConfig(gemms=("fwd",))
    with pytest.raises(ValueError, match="layer_fraction=0"):
        ABFTConfig(layer_fraction=0)
    with pytest.raises(ValueError, match="checksum_dtype.*allowed"):
        ABFTConfig(checksum_dtype="float16")
    with pytest.raises(ValueError, match=r"ABFT targets pattern 'blocks.\*.qproj'.*closest"):
        ABFTDetector(transformer(), ABFTConfig(targets=("blocks.*.qproj",)))
    det = ABFTDetector(transformer(), ABFTConfig(targets="*.score"))
    assert [layer.name for layer in det.layers] == ["blocks.0.score", "blocks.1.score"]
    with pytest.raises(ValueError, match="kind 'conv2d'.*allowed: linear, matmul, conv"):
        ABFTConfig(kinds=("conv2d",))
    linear = ABFTDetector(transformer(), ABFTConfig(kinds="linear"))
    assert linear.layers and all(layer.kind == "linear" for layer in linear.layers)
    assert len(linear.layers) == len(ABFTDetector(transformer()).layers) - 4  # 2 blocks × score, context
    with pytest.raises(TypeError, match="include_eval='no' must be a boolean"):
        ABFTConfig(include_eval="no")
    with pytest.raises(ValueError, match="targets=5 must be a name or a list of names"):
        ABFTConfig(targets=5)
    with pytest.raises(ValueError, match="targets is empty"):
        ABFTConfig(targets=[])
    with pytest.warns(UserWarning, match="ABFT checks no GEMM of this LSTM"):
        assert ABFTDetector(nn.LSTM(2, 3)).layers == []


# ------------------------------------------------------------------ models of every kind
def run_plain(model, det, steps, batch, loss_fn, *, autocast=False):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    events = []
    for step in range(steps):
        det.begin_step(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, batch(step))
        loss.backward()
        events += det.check(step)
        opt.step()
        opt.zero_grad()
    return events


def mlp_batch(step, shape=(4, 16, 8)):
    g = torch.Generator().manual_seed(step)
    return torch.randn(*shape, generator=g)


def test_weight_with_other_gradient_contributions_checks_the_gemm_alone():
    """An explicit L2 term and a tied decoder add to weight.grad beside the Linear's dW = dYᵀX:
    quiet on clean steps, and a flip in the Linear's own dW is still found."""
    torch.manual_seed(0)
    enc = nn.Linear(8, 16)

    def loss_fn(m, x):  # tied autoencoder + L2 penalty on every parameter
        h = torch.relu(m(x))
        rec = F.linear(h, m.weight.t())
        return (rec - x).pow(2).mean() + 1e-2 * sum(p.pow(2).sum() for p in m.parameters())

    det = ABFTDetector(nn.Sequential(enc)).attach()
    model = det.model
    assert run_plain(model, det, 4, mlp_batch, lambda m, x: loss_fn(m[0], x)) == []

    def flip(g):
        g = g.clone()
        flip_bit(g, (3, 5), 30 if abs(g[3, 5].item()) < 1 else 23)
        return g

    on_grad_weight(enc, flip)
    events = run_plain(model, det, 1, mlp_batch, lambda m, x: loss_fn(m[0], x))
    assert [(e.module, e.gemm, e.index[-1]) for e in events] == [("0", "grad_weight", 5)]


def test_float64_model_keyword_call_and_lora_subclass():
    class LoRA(nn.Linear):  # its output is not X Wᵀ + b: not checked
        def __init__(self, d):
            super().__init__(d, d)
            self.a = nn.Parameter(torch.randn(2, d) * 0.1)
            self.b = nn.Parameter(torch.randn(d, 2) * 0.1)

        def forward(self, x):
            return super().forward(x) + x @ self.a.T @ self.b.T

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.lora, self.out = nn.Linear(8, 8), LoRA(8), nn.Linear(8, 4)

        def forward(self, x):
            return self.out(input=torch.relu(self.lora(self.fc(x))))  # a keyword operand

    torch.manual_seed(0)
    model = Net().double()
    det = ABFTDetector(model).attach()
    assert [layer.name for layer in det.layers] == ["fc", "out"] and det.skipped == ["lora"]
    batch = lambda step: mlp_batch(step).double()  # noqa: E731
    assert run_plain(model, det, 3, batch, lambda m, x: m(x).pow(2).mean()) == []
    assert det.checks_run == 3 * 5  # fc's input needs no gradient: no dX check

    def add_one(module, args, kwargs, out):
        out = out.clone()
        out[1, 2, 3] += 1.0
        return out

    model.out.register_forward_hook(add_one, with_kwargs=True)
    events = run_plain(model, det, 1, batch, lambda m, x: m(x).pow(2).mean())
    assert [(e.module, e.gemm, e.index) for e in events][:1] == [("out", "forward", (None, None, 3))]


def test_rows_repeated_within_a_sequence_stay_within_the_model():
    """Mean-pooling over tokens repeats dY's rows within a sequence, so rounding errors of those
    rows are equal, not independent: no false alarm in bf16, fp32 or fp32 with fp64 checksums."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = lambda step: mlp_batch(step, (4, 1024, 32))  # noqa: E731
    loss_fn = lambda m, x: m(x).float().mean(1).pow(2).sum()  # noqa: E731
    for cfg, autocast in ((ABFTConfig(), True), (ABFTConfig(), False), (ABFTConfig(checksum_dtype="float64"), False)):
        det = ABFTDetector(model, cfg).attach()
        assert run_plain(model, det, 3, batch, loss_fn, autocast=autocast) == []
        det.detach()


def test_one_dimensional_input_and_in_place_consumer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    det = ABFTDetector(model).attach()
    batch = lambda step: mlp_batch(step, (8,))  # noqa: E731
    assert run_plain(model, det, 3, batch, lambda m, x: m(x).pow(2).sum()) == []
    corrupt_forward(model[0], (5,), 30)
    events = run_plain(model, det, 1, batch, lambda m, x: m(x).pow(2).sum())
    assert [(e.module, e.gemm, e.index) for e in events][:1] == [("0", "forward", (5,))]


def test_replay_of_a_checked_step_rearms_its_layers():
    model = transformer(10)
    det = ABFTDetector(model, ABFTConfig(layer_fraction=0.25)).attach()
    sample = []
    for step in range(3):
        det.begin_step(step)
        sample.append(det.active_layers)
        lm_loss(model, lm_batch(step)).backward()
        det.check(step)
        model.zero_grad()
        if step == 1:  # a replay of step 1, then the rotation goes on as if none happened
            det.begin_step(1)
            assert det.active_layers == sample[1]
            lm_loss(model, lm_batch(1)).backward()
            assert det.check(1) == []
            model.zero_grad()
    assert len({frozenset(s) for s in sample}) == 3
    fresh = ABFTDetector(transformer(10), ABFTConfig(layer_fraction=0.25)).attach()
    for step in range(3):
        fresh.begin_step(step)
        assert fresh.active_layers == sample[step]
        fresh.check(step)


def test_operands_are_released_once_their_checks_are_recorded():
    """ABFT holds a layer's input and output gradient only until its checks are recorded: after
    backward nothing but small checksum vectors waits for ``check()``."""
    model = transformer(14)
    det = ABFTDetector(model).attach()
    det.begin_step(0)
    lm_loss(model, lm_batch(0)).backward()
    assert len(det._operands) == 0
    assert det.check(0) == [] and det.checks_run == 51


@pytest.mark.parametrize("layout", ["contiguous", "heads", "broadcast"])
def test_batched_statistics_match_a_dense_reference(layout):
    """Batched operands are read where they lie (no reshaped copies): GEMV and norms agree with a
    dense computation for contiguous, head-transposed and broadcast layouts."""
    from sdcscope.detect.checksum import Operand, _matvec

    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 5, 3, 4, generator=g)  # (batch, tokens, heads, dim)
    t = {
        "contiguous": base.transpose(1, 2).contiguous(),
        "heads": base.transpose(1, 2),
        "broadcast": base[:1, :, :1].transpose(1, 2).expand(2, 3, 5, 4),
    }[layout]
    dense = t.contiguous().double()
    op = Operand(t, torch.float64)
    vec = torch.randn(6, 4, generator=g, dtype=torch.float64)
    got = _matvec(op.stat("x"), vec)
    ref = torch.einsum("bpq,bq->bp", dense.reshape(6, 5, 4), vec)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(op.stat("fn"), dense.reshape(6, -1).norm(dim=-1).float())
    torch.testing.assert_close(op.T.stat("fn"), op.stat("fn"))


# ------------------------------------------------------------------ models that skip, freeze or break layers
class _Dropped(nn.Module):
    """A stack whose middle layer is skipped on the steps in ``skip`` (LayerDrop, an idle expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.skip = False

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if not self.skip:
            h = h + torch.tanh(self.mid(h))
        return self.out(h)


def _steps(model, det, steps, *, skip=(), fault=None, grad=True):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = []
    for step in range(steps):
        model.skip = step in skip
        det.begin_step(step)
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        with torch.set_grad_enabled(grad):
            F.cross_entropy(model(x), y).backward()
        events += det.check(step)
        opt.step()
        opt.zero_grad()
    return events


def test_layer_not_called_on_its_first_sampled_steps_stays_checked():
    """A layer skipped on the first steps (a dropped block) is not 'unreached' -- only a weight
    used without the module's forward is -- so a later fault in it is found."""
    torch.manual_seed(0)
    model = _Dropped()
    model.mid.register_forward_hook(lambda m, a, out: flip_bit(out, (3, 5), 29) if not model.skip and m.hit else None)
    model.mid.hit = False
    det = ABFTDetector(model).attach()
    assert _steps(model, det, 4, skip={0, 1, 2}) == [] and det.unreached == set()
    model.mid.hit = True
    events = _steps(model, det, 1)
    assert [(e.module, e.gemm, e.index) for e in events] == [("mid", "forward", (None, 5))]
    assert det.unreached == set()


def test_weight_used_outside_the_module_forward_is_checked_at_its_f_linear_calls():
    torch.manual_seed(0)
    model = _Dropped()
    model.forward = lambda x: model.out(torch.tanh(F.linear(torch.tanh(model.inp(x)), model.mid.weight)))
    det = ABFTDetector(model, ABFTConfig(targets=["mid", "out"])).attach()
    _steps(model, det, 3)
    assert det.unreached == set() and ("mid", "grad_weight") in det.max_ratio


def test_weight_used_by_another_product_is_unreached():
    torch.manual_seed(0)
    model = _Dropped()
    model.forward = lambda x: model.out(torch.tanh(torch.tanh(model.inp(x)) @ model.mid.weight.T))
    det = ABFTDetector(model, ABFTConfig(targets=["mid", "out"])).attach()
    with pytest.warns(UserWarning, match="ABFT: mid sampled but never called"):
        _steps(model, det, 5)  # two steps without its forward, two more without an F.linear call
    assert det.unreached == {"mid"}


def test_model_trained_in_eval_mode_is_checked_but_not_evaluation_under_no_grad():
    torch.manual_seed(0)
    model = _Dropped().eval()
    det = ABFTDetector(model).attach()
    _steps(model, det, 2)
    assert det.checks_run == 2 * (3 + 3 + 2)  # per step: 3 Y, 3 dW, 2 dX (inp's input needs no grad)
    before = det.checks_run
    det.begin_step(2)
    with torch.no_grad():
        model(torch.randn(4, 8))
    det.check(2)
    assert det.checks_run == before


def test_complex_linear_is_skipped_and_a_failing_hook_never_breaks_training(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.cfloat), nn.Linear(4, 2, dtype=torch.cfloat))
    with pytest.warns(UserWarning, match="no checkable submodule .* skipped 0, 1"):
        det = ABFTDetector(model)
    assert det.skipped == ["0", "1"]
    model = _Dropped()
    det = ABFTDetector(model).attach()
    monkeypatch.setattr(det, "_lean_forward", lambda *a, **k: 1 / 0)
    det.begin_step(0)
    loss = F.cross_entropy(model(torch.randn(8, 8)), torch.zeros(8, dtype=torch.long))
    loss.backward()  # the hooks raised inside forward: training went on
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="ABFT hook failed on step 0.*ZeroDivisionError"):
        det.check(0)
    monkeypatch.undo()
    assert _steps(model, det, 2) == [] and det.checks_run > 0  # the next steps are checked again


@pytest.mark.parametrize(
    "layer,checksums",
    [
        (lambda: nn.Conv1d(32, 32, 3, padding=1, groups=16), "column"),  # 2 channels per group
        (lambda: nn.ConvTranspose1d(32, 32, 3, padding=1, groups=16), "column"),
        (lambda: nn.Linear(2, 8), "both"),
    ],
)
def test_a_bias_larger_than_the_products_is_no_clean_finding(layer, checksums):
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model = nn.Sequential(layer())
        with torch.no_grad():
            model[0].bias.mul_(4)  # a trained bias, larger than its init
        det = ABFTDetector(model, ABFTConfig(checksums=checksums)).attach()
        x = (
            0.1 * torch.randn(16, 32, 64)
            if isinstance(model[0], (nn.Conv1d, nn.ConvTranspose1d))
            else 0.1 * torch.randn(2048, 2)
        ).relu()
        model(x).sum().backward()
        assert det.check(0) == []
        worst = max(worst, det.max_ratio[("0", "forward")])
    assert worst < 1.0  # (10 model stds for the conv, 80 for the Linear's rows before)
