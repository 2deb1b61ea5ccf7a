"""transformers' ``Conv1D`` (GPT-2's projections: Y = X·W + b, W stored (in, out)) is a GEMM the
injector targets and ABFT checks like a Linear. The class here computes what transformers' does,
so the suite needs no transformers; tests/test_integrations_hf.py runs the real GPT-2."""

import pytest
import torch
from torch import nn

from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, is_gemm


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: ``nf`` outputs, ``nx`` inputs."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(Conv1D(32, 8), nn.GELU(), Conv1D(8, 32))


X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


def run(net, det, steps, inj=None, autocast=False):
    events = []
    for step in range(steps):
        if inj is not None:
            inj.set_position(step)
        det.begin_step(step)
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = net(X.requires_grad_())
        (out.float() ** 2).sum().backward()
        events += [(step, e.module, e.gemm, e.index) for e in det.check(step)]
    return events


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_clean_conv1d_checks_forward_dx_and_dw(autocast):
    net = mlp()
    assert is_gemm(net[0])
    det = ABFTDetector(net, ABFTConfig()).attach()
    assert run(net, det, 3, autocast=autocast) == []
    assert {g for (_, g) in det.max_ratio} == {"forward", "grad_input", "grad_weight"}
    assert max(det.max_ratio.values()) < (2.0 if autocast else 0.5)


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight"])
def test_injected_conv1d_faults_are_named_by_abft(site):
    net = mlp()
    spec = FaultSpec.from_dict(
        {
            "site": site,
            "target": "2",
            "model": "bitflip",
            "bits": [29],
            "seed": 2,
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    inj = Injector(net, [spec]).attach()
    det = ABFTDetector(net, ABFTConfig()).attach()
    events = run(net, det, 3, inj)
    (rec,) = inj.records
    gemm = site.split(".")[1]
    # the column the fault hit: the output feature of Y / the input feature of dX; for dW (stored
    # (in, out)) the input feature, as a Linear's (out, in) dW names it
    shape = {"forward": (2, 5, 8), "grad_input": (2, 5, 32), "grad_weight": tuple(net[2].weight.shape)}[gemm]
    where = [int(i) for i in torch.unravel_index(torch.tensor(rec["index"][0]), shape)]
    column = where[0] if gemm == "grad_weight" else where[-1]
    assert [(s, m, g, i[-1]) for s, m, g, i in events] == [(1, "2", gemm, column)]


def test_mac_cell_is_refused_on_a_conv1d():
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "0",
            "model": "bitflip",
            "bits": [29],
            "pattern": {"kind": "mac_cell"},
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    with pytest.raises(ValueError, match="mac_cell .* Conv1D"):
        Injector(mlp(), [spec])
