"""ABFT on convolutions: checksums of Y, dX and dW of Conv1d/2d/3d of any geometry, through the
detector's hooks and in the guard with the injector's faults."""

import pytest
import torch
from torch import nn

from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.detect.abft.convcheck import conv_node, forward_lines, grad_input_lines, grad_weight_lines
from sdcscope.detect.checksum import line_ratios
from sdcscope.detect.rounding import rounding_model
from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

GEOMETRIES = [
    (nn.Conv2d(4, 6, 3, padding=1), (8, 4, 9, 9)),
    (nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, padding_mode="reflect"), (8, 4, 9, 9)),
    (nn.Conv2d(6, 6, 3, groups=6, padding=1, padding_mode="circular", bias=False), (4, 6, 7, 7)),  # depthwise
    (nn.Conv1d(3, 5, 4, dilation=2, padding="same"), (4, 3, 20)),  # asymmetric 'same': padded copy
    (nn.Conv1d(3, 5, 3), (3, 12)),  # unbatched input
    (nn.Conv3d(2, 4, 3, stride=(1, 2, 1), bias=False), (2, 2, 5, 6, 7)),
]


def _lines(mod, y, grads, fault=None):
    """The three checks of one call; ``fault``: (which, flat index) moved by 1 % of the tensor's
    largest magnitude before."""
    xc, w, geo = grads["x"], grads["w"], grads["geo"]
    model = rounding_model(torch.float32, "cpu", torch.float32)
    yy, dx, dw = (y if y.dim() == w.dim() else y.unsqueeze(0)), grads["dx"], grads["dw"]
    if fault is not None:
        which, i = fault
        t = {"y": yy, "dx": dx, "dw": dw}[which].clone()
        t.view(-1)[i] += 0.01 * t.abs().amax()
        yy, dx, dw = (t if which == "y" else yy), (t if which == "dx" else dx), (t if which == "dw" else dw)
    return (
        forward_lines(xc, w, mod.bias, yy, geo.conv, model=model, cs=torch.float32)
        + grad_input_lines(grads["dy"], w, dx, geo, model=model, cs=torch.float32)
        + grad_weight_lines(grads["dy"], xc, dw, geo, model=model, cs=torch.float32)
    )


@pytest.mark.parametrize("mod,shape", GEOMETRIES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_conv_checksums_clean_and_faulted(mod, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    y = mod(x)
    node, geo = conv_node(y, mod.weight)
    grads = {"x": node._saved_input, "w": node._saved_weight, "geo": geo}  # freed by backward
    node.register_hook(lambda gi, go: grads.update(dy=go[0], dx=gi[0], dw=gi[1]))
    (y * y).sum().backward()
    with torch.no_grad():
        clean = line_ratios(_lines(mod, y, grads))
        assert clean.amax() < 0.5, clean  # the rounding model holds with margin (c = 8)
        # the forward check through the module's own padding (no autograd node) agrees
        model = rounding_model(torch.float32, "cpu", torch.float32)
        xb, yb = (x, y) if y.dim() == mod.weight.dim() else (x.unsqueeze(0), y.unsqueeze(0))
        own = forward_lines(
            xb, mod.weight, mod.bias, yb, lambda a, b: mod._conv_forward(a, b, None), model=model, cs=torch.float32
        )
        assert line_ratios(own).amax() < 0.5
        for which, n in (("y", y.numel()), ("dx", grads["dx"].numel()), ("dw", grads["dw"].numel())):
            i = int(torch.randint(n, ()))
            faulted = line_ratios(_lines(mod, y, grads, (which, i)))
            k = ["y", "dx", "dw"].index(which)
            if which == "dx" and grads["dx"].view(-1)[i] == 0:
                continue  # a padded position's gradient: 0 stays 0
            assert faulted[k] > clean[k] * 10, (which, faulted, clean)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


def test_detector_checks_convs_and_names_the_position():
    net = _cnn()
    det = ABFTDetector(net, ABFTConfig()).attach()
    assert [(x.name, x.kind) for x in det.layers] == [("0", "conv"), ("2", "conv"), ("5", "linear")]
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, t = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        nn.functional.cross_entropy(net(x), t).backward()
        assert det.check(step) == []
        opt.step()
        opt.zero_grad()
    # the first conv's input needs no gradient: no dX check there
    assert {k for k in det.max_ratio if k[0] == "0"} == {("0", "forward"), ("0", "grad_weight")}
    assert max(det.max_ratio.values()) < 0.5

    def corrupt(module, args, out):
        out = out.clone()
        out[3, 5, 2, 1] = out[3, 5, 2, 1] * 1.5 + 1.0
        return out

    h = net[2].register_forward_hook(corrupt)
    det.begin_step(4)
    nn.functional.cross_entropy(net(x), t).backward()
    (e,) = det.check(4)
    h.remove()
    assert (e.module, e.gemm, e.index) == ("2", "forward", (3, None, 2, 1))
    assert e.evidence["ratio"] > 8


def test_frozen_conv_checks_its_forward_and_input_gradient():
    net = _cnn()
    net[2].weight.requires_grad_(False)
    det = ABFTDetector(net, ABFTConfig()).attach()
    assert det.skipped_grad_weight == ["2"]
    x = torch.randn(4, 3, 8, 8)
    net(x).sum().backward()
    assert det.check(0) == []
    assert {g for (m, g) in det.max_ratio if m == "2"} == {"forward", "grad_input"}


def test_conv_under_bf16_autocast_and_channels_last_is_clean():
    net = _cnn().to(memory_format=torch.channels_last)
    det = ABFTDetector(net, ABFTConfig()).attach()
    x = torch.randn(16, 3, 8, 8).to(memory_format=torch.channels_last)
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x).float().square().mean()
        loss.backward()
        assert det.check(step) == []
    assert ("2", "grad_weight") in det.max_ratio and max(det.max_ratio.values()) < 2


STEP = 6


@pytest.fixture(scope="module")
def cnn():
    return make_workload(WorkloadConfig(workload="cnn", preset="tiny", batch_size=16))


def _run(workload, spec=None):
    trainer = Trainer(workload, TrainConfig(seed=1))
    inj = None
    if spec is not None:
        inj = Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    guard = Guard(trainer.model, trainer.optimizer, GuardConfig(profile="full"))
    trainer.add_callback(guard.callback())
    while trainer.step < STEP + 3:
        trainer.train_step()
    return trainer, guard, inj


@pytest.fixture(scope="module")
def golden(cnn):
    trainer, clean, _ = _run(cnn)
    assert clean.events == []
    return param_sha256(trainer.model)


@pytest.mark.parametrize(
    "site,gemm", [("gemm.forward", "forward"), ("gemm.grad_input", "grad_input"), ("gemm.grad_weight", "grad_weight")]
)
def test_guard_finds_conv_flips_names_the_element_and_repairs(cnn, golden, site, gemm):
    spec = {
        "site": site,
        "target": "conv2",
        "model": "bitflip",
        "bits": [27],
        "seed": 3,
        "schedule": {"kind": "transient", "step": STEP},
    }
    trainer, guard, inj = _run(cnn, spec)
    (e,) = guard.events
    assert (e["detector"], e["module"], e["gemm"], e["step"]) == ("abft", "conv2", gemm, STEP)
    assert (e["verdict"], e["action"]) == ("transient", "recompute")
    (rec,) = inj.records
    conv = trainer.model.conv2  # on 4×4 maps (8×8 digits pooled once)
    n, o, c, k = cnn.config.batch_size, conv.out_channels, conv.in_channels, conv.kernel_size
    shape = {"forward": (n, o, 4, 4), "grad_input": (n, c, 4, 4), "grad_weight": (o, c, *k)}[gemm]
    where = [int(i) for i in torch.unravel_index(torch.tensor(rec["index"][0]), shape)]
    # forward / dX: the position (channel summed over); dW: the input channel and tap
    expect = [where[0], None, *where[2:]] if gemm != "grad_weight" else [None, *where[1:]]
    assert list(e["index"]) == expect
    assert param_sha256(trainer.model) == golden


@pytest.mark.parametrize("scale", [1e-2, 1e-6])
def test_fp16_results_below_the_smallest_normal_are_not_flagged(scale):
    """fp16 gradients of ~1e-6 are subnormal: their rounding error is absolute, not relative
    (before: Linear dX checks at 26,000 model stds on a clean step, conv dX at 90)."""
    torch.manual_seed(0)
    for net, x in (
        (_cnn().half(), torch.randn(16, 3, 8, 8)),
        (nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).half(), torch.randn(256, 64)),
    ):
        det = ABFTDetector(net, ABFTConfig()).attach()
        (net(x.half()).float().sum() * scale).backward()
        assert det.check(0) == [], det.max_ratio
        assert max(det.max_ratio.values()) < 4, det.max_ratio
        # a real fault on the same step is still found
        h = net[-1].register_forward_hook(
            lambda m, a, out: out + (out.detach().abs().amax() * (torch.arange(out.numel()).view(out.shape) == 5))
        )
        det.begin_step(1)  # ABFT's hook moves after the fault's
        (net(x.half()).float().sum() * scale).backward()
        h.remove()
        assert [e.gemm for e in det.check(1)] == ["forward"]


@pytest.mark.parametrize(
    "mod,shape",
    [
        (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), (4, 4, 5, 5)),
        (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2, bias=False), (4, 4, 5, 5)),
        (nn.ConvTranspose1d(3, 5, 4, stride=3), (4, 3, 9)),
        (nn.ConvTranspose3d(2, 4, 2, stride=2), (2, 2, 3, 4, 3)),
    ],
    ids=["2d-out-padding", "2d-groups-dilation", "1d", "3d"],
)
def test_transposed_convs_checked_with_roles_swapped(mod, shape):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Identity(), mod)
    det = ABFTDetector(net, ABFTConfig()).attach()
    x = torch.randn(*shape, requires_grad=True)
    (net(x) ** 2).sum().backward()
    assert det.check(0) == []
    assert {g for (_, g) in det.max_ratio} == {"forward", "grad_input", "grad_weight"}
    assert max(det.max_ratio.values()) < 0.5
    for gemm in ("forward", "grad_input", "grad_weight"):

        def fault(module, args, out, gemm=gemm):
            if gemm == "forward":
                return out + (torch.arange(out.numel()).view(out.shape) == 7) * out.detach().abs().amax()

            def node_hook(grad_inputs, grad_outputs):
                i = 0 if gemm == "grad_input" else 1
                g = grad_inputs[i].clone()
                g.view(-1)[5] += g.abs().amax()
                return tuple(g if j == i else t for j, t in enumerate(grad_inputs))

            out.grad_fn.register_hook(node_hook)

        h = mod.register_forward_hook(fault)
        det.begin_step(1)  # ABFT's hooks after the fault's
        (net(x) ** 2).sum().backward()
        h.remove()
        events = det.check(1)
        assert [(e.module, e.gemm) for e in events] == [("1", gemm)], events
        y_shape = mod(x).shape
        if gemm == "forward":
            n, _, *p = torch.unravel_index(torch.tensor(7), y_shape)
            assert events[0].index == (int(n), None, *map(int, p))
        elif gemm == "grad_input":
            n, _, *p = torch.unravel_index(torch.tensor(5), x.shape)
            assert events[0].index == (int(n), None, *map(int, p))
        else:
            _, o, *t = torch.unravel_index(torch.tensor(5), mod.weight.shape)
            assert events[0].index == (None, int(o), *map(int, t))


@pytest.mark.parametrize("mode", ["bf16-autocast", "fp16"])
def test_narrow_encoder_decoder_is_clean(mode):
    """A conv encoder and transposed-conv decoder in bf16/fp16: the col2im sums of dX and of the
    decoder's forward round per overlapping tap (clean ratios reached 5.3 model stds before)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 3, 3, padding=1),
    )
    if mode == "fp16":
        net = net.half()
    det = ABFTDetector(net, ABFTConfig()).attach()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    x = torch.randn(16, 3, 16, 16)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp16"):
            loss = (net(x.half() if mode == "fp16" else x).float() - x).square().mean()
        loss.backward()
        assert det.check(step) == []
        opt.step()
        opt.zero_grad()
    assert len(det.max_ratio) == 8 and max(det.max_ratio.values()) < 4, det.max_ratio


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "same4"])
def test_self_padding_conv_dx_checked_where_the_module_input_gets_it(mode):
    """A conv padding its input itself (an autograd pad node between its GEMM and its input):
    the injector's dX fault lands on the module's dX, after the pad; ABFT checks dX there and
    names the position in the module input's coordinates (before: missed, padded coordinates)."""
    pad = dict(padding="same") if mode == "same4" else dict(padding=1, padding_mode=mode)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 4 if mode == "same4" else 3, **pad),
        nn.Flatten(),
        nn.Linear(8 * 64, 10),
    )
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.grad_input",
            "target": "2",
            "model": "bitflip",
            "bits": [27],
            "seed": 5,
            "schedule": {"kind": "transient", "step": 0},
        }
    )
    inj = Injector(net, [spec]).attach()
    det = ABFTDetector(net, ABFTConfig()).attach()
    inj.set_position(0)
    x = torch.randn(4, 4, 8, 8)
    net(x).square().sum().backward()
    events = det.check(0)
    (rec,) = inj.records
    n, _, *q = (int(i) for i in torch.unravel_index(torch.tensor(rec["index"][0]), (4, 8, 8, 8)))
    assert [(e.module, e.gemm, e.index) for e in events] == [("2", "grad_input", (n, None, *q))]
    # and clean: the padding's adjoint folds the border rows into the model
    det.detach()
    det = ABFTDetector(net, ABFTConfig()).attach()
    inj.set_position(1)
    net.zero_grad()
    net(x).square().sum().backward()
    assert det.check(1) == [] and det.max_ratio[("2", "grad_input")] < 1


def test_depthwise_conv_under_bf16_autocast_is_clean():
    """CPU bf16 depthwise kernels accumulate in bf16 (a clean dX check at 4,248 model stds
    under the fp32-accumulation model)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 64, 1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.ReLU(), nn.Conv2d(64, 8, 1)
    )
    det = ABFTDetector(net, ABFTConfig()).attach()
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(torch.randn(8, 3, 16, 16)).float().square().mean()
        loss.backward()
        assert det.check(step) == []
    assert max(det.max_ratio.values()) < 2


def test_non_reentrant_checkpoint_is_not_recomputed_by_the_checks():
    """Reading a checkpointed conv's saved operands in its forward hook recomputed the region at
    once (and checked the next conv against operands of another run): under saved-tensor hooks
    the forward is checked from the module's input, and each conv runs once forward, once again
    when backward recomputes it."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    a, b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
    calls = []
    a.register_forward_hook(lambda m, i, o: calls.append("a"))
    net = nn.ModuleDict({"a": a, "b": b})
    det = ABFTDetector(net, ABFTConfig()).attach()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    checkpoint(lambda t: b(torch.relu(a(t))), x, use_reentrant=False).square().sum().backward()
    assert calls == ["a", "a"]
    assert det.check(0) == []
    assert {("a", "forward"), ("b", "forward")} <= set(det.max_ratio)


def test_a_lone_layer_is_not_checked_and_the_warning_says_why():
    with pytest.warns(UserWarning, match=r"not the model itself: wrap a lone layer"):
        assert ABFTDetector(nn.Conv2d(1, 2, 3)).layers == []
    assert [x.name for x in ABFTDetector(nn.Sequential(nn.Conv2d(1, 2, 3))).layers] == ["0"]


@pytest.mark.parametrize(
    "site,gemm", [("gemm.forward", "forward"), ("gemm.grad_input", "grad_input"), ("gemm.grad_weight", "grad_weight")]
)
def test_injected_transposed_conv_faults_are_named_by_abft(site, gemm):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2), nn.ReLU(), nn.ConvTranspose2d(4, 3, 3, stride=2, output_padding=1)
    )
    x = torch.randn(2, 2, 9, 9)
    spec = FaultSpec.from_dict(
        {
            "site": site,
            "target": "2",
            "model": "bitflip",
            "bits": [29],
            "seed": 1,
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    inj = Injector(net, [spec]).attach()
    det = ABFTDetector(net, ABFTConfig()).attach()
    for step in range(3):
        inj.set_position(step)
        det.begin_step(step)
        net.zero_grad()
        (net(x) ** 2).sum().backward()
        events = det.check(step)
        assert [(e.module, e.gemm) for e in events] == ([("2", gemm)] if step == 1 else []), (step, events)
    assert [r["step"] for r in inj.records] == [1]
    with pytest.raises(ValueError, match="mac_cell .* ConvTranspose2d"):
        Injector(
            net,
            [
                FaultSpec.from_dict(
                    {
                        "site": site,
                        "target": "2",
                        "model": "bitflip",
                        "bits": [29],
                        "pattern": {"kind": "mac_cell"},
                        "schedule": {"kind": "transient", "step": 1},
                    }
                )
            ],
        )
