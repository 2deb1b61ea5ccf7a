"""Found by probing standard layers the other tests leave out: a bias larger than a GEMM's
products (a grouped conv, a narrow Linear) kept out of clean fp32 checks, an activation fault on
a module returning a dict, a tied weight targeted by its second name, and module-site faults that
can never fire named when the injector detaches."""

import warnings

import pytest
import torch
from torch import nn

from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector


def spec(site, target, step=0):
    return FaultSpec(site=site, target=target, model="bitflip", bits=(30,),
                     pattern={"kind": "element", "index": "random"}, schedule={"kind": "transient", "step": step}, seed=1)


@pytest.mark.parametrize("layer,checksums", [
    (lambda: nn.Conv1d(32, 32, 3, padding=1, groups=16), "column"),   # 2 channels per group
    (lambda: nn.ConvTranspose1d(32, 32, 3, padding=1, groups=16), "column"),
    (lambda: nn.Linear(2, 8), "both"),
])
def test_a_bias_larger_than_the_products_is_no_clean_finding(layer, checksums):
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model = nn.Sequential(layer())
        with torch.no_grad():
            model[0].bias.mul_(4)     # a trained bias, larger than its init
        det = ABFTDetector(model, ABFTConfig(checksums=checksums)).attach()
        x = (0.1 * torch.randn(16, 32, 64) if isinstance(model[0], (nn.Conv1d, nn.ConvTranspose1d))
             else 0.1 * torch.randn(2048, 2)).relu()
        model(x).sum().backward()
        assert det.check(0) == []
        worst = max(worst, det.max_ratio[("0", "forward")])
    assert worst < 1.0     # (10 model stds for the conv, 80 for the Linear's rows before)


def test_an_activation_fault_on_a_dict_output_lands_on_its_first_tensor():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return {"mask": x > 0, "hidden": self.fc(x), "aux": self.fc.weight.sum()}

    torch.manual_seed(0)
    model, x = nn.Sequential(Body()), torch.randn(4, 8)
    clean = model(x)
    with Injector(model, [spec("activation", "0")]) as inj:
        out = model(x)
    (rec,) = inj.records
    assert type(out) is dict and list(out) == ["mask", "hidden", "aux"]
    changed = (out["hidden"] != clean["hidden"]).flatten().nonzero().flatten().tolist()
    assert changed == rec["index"] and rec["after"] == [out["hidden"].flatten()[changed[0]].item()]
    assert torch.equal(out["aux"], clean["aux"])


def test_a_tied_weight_is_a_target_by_either_name():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
            self.out.weight = self.emb.weight

    model = Tied()
    before = model.emb.weight.detach().clone()
    with Injector(model, [spec("weight", "out.weight")]) as inj:
        inj.set_position(0)
    assert [r["module"] for r in inj.records] == ["out.weight"]
    assert (model.emb.weight != before).sum() == 1
    with Injector(model, [spec("weight", "*.weight")]):   # one tensor, one target
        pass


def test_module_site_faults_that_never_fire_are_named_at_detach():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            return self.attn(h, h, h)[0]

    model = M()
    specs = [spec("gemm.forward", "attn.out_proj", 1), spec("gemm.grad_input", "inp", 1),
             spec("gemm.forward", "inp", 1), spec("gemm.forward", "inp", 9)]   # fires; not reached
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Injector(model, specs) as inj:
            for step in range(3):
                inj.set_position(step)
                model(torch.randn(2, 5, 8)).sum().backward()
    msgs = [str(w.message) for w in seen if "never fired" in str(w.message)]
    assert [r["spec"] for r in inj.records] == [2]
    assert len(msgs) == 2
    assert msgs[0].startswith("fault spec #0 (gemm.forward on 'attn.out_proj') never fired, though its schedule "
                              "covered step 1 on: the module was never called") and "F.linear" in msgs[0]
    assert msgs[1].startswith("fault spec #1 (gemm.grad_input on 'inp') never fired") and "first layer" in msgs[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a campaign reports such a trial as not_fired instead
        with Injector(model, specs[:1], warn_unfired=False) as inj:
            inj.set_position(1)
            model(torch.randn(2, 5, 8))
