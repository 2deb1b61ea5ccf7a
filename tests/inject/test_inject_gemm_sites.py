"""Faults on GEMM sites land on the product the hardware computes, or the spec is refused before any work:
autocast compute dtypes, in-place ops after a GEMM, ``a @ b`` operand gradients and MAC cells, a padded
conv's dX, and calls autograd does not record or frozen weights."""

import struct

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import flip_spec
from sdcscope.faults import FaultSpecError
from sdcscope.inject import Injector, validate_specs
from sdcscope.inject.probe import probe_model
from sdcscope.workloads.gpt import GPT, MatMul, gpt_preset, lm_loss


def flip32(value: float, bit: int) -> float:
    (i,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", i ^ (1 << bit)))[0]


def flip_bf16(value: float, bit: int) -> float:
    word = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16) ^ (1 << bit)
    return word.view(torch.bfloat16).item()


def changed(golden: torch.Tensor, faulty: torch.Tensor) -> list[int]:
    return (golden.reshape(-1) != faulty.reshape(-1)).nonzero().flatten().tolist()


# ------------------------------------------------------------- gemm.grad_input / grad_weight
class _Stream(nn.Module):
    """Two Linears with an fp32 stream between them (as a residual stream is under autocast)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x).float())


def test_linear_grad_input_under_autocast_is_checked_in_the_gemm_compute_dtype():
    """dX is faulted at the addmm node, in bf16: bit 20 of an fp32 input is refused up front."""
    torch.manual_seed(0)
    model, x = _Stream(), torch.randn(5, 8)

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().pow(2).mean()

    probe = probe_model(model, loss)
    with pytest.raises(FaultSpecError, match="'b': bit 20 is out of range for bf16"):
        validate_specs(model, [flip_spec(site="gemm.grad_input", target="b", bits=[20])], probe=probe)
    fits = flip_spec(site="gemm.grad_input", target="b", bits=[14])
    validate_specs(model, [fits], probe=probe)
    with Injector(model, [fits]) as inj:
        inj.set_position(0)
        loss(model).backward()
    (rec,) = inj.records
    assert rec["after"] == [flip_bf16(rec["before"][0], 14)]


class _MatMulInPlace(nn.Module):
    """``a @ b`` whose product is modified in place right after the module."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(3, 5))
        self.mm = MatMul()

    def forward(self, a):
        return torch.relu_(self.mm(a, self.b))


def _conv(cls, shape):
    return lambda: (nn.Sequential(cls(3, 4, 3), nn.ReLU(inplace=True)), torch.randn(*shape), "0")


@pytest.mark.parametrize(
    "make, site, operand",
    [
        (_conv(nn.Conv2d, (2, 3, 6, 6)), "gemm.grad_input", "x"),
        (_conv(nn.Conv1d, (2, 3, 6)), "gemm.grad_input", "x"),
        (lambda: (_MatMulInPlace(), torch.randn(4, 3), "mm"), "gemm.grad_input", "x"),
        (lambda: (_MatMulInPlace(), torch.randn(4, 3), "mm"), "gemm.grad_weight", "b"),
    ],
    ids=["conv2d", "conv1d", "matmul-a", "matmul-b"],
)
def test_an_in_place_op_after_the_gemm_stays_legal_and_the_operand_gradient_is_hit(make, site, operand):
    """The operand's gradient is corrupted at the call's autograd node, not through a full
    backward hook (whose output view an in-place ReLU may not modify): same values as before."""
    torch.manual_seed(0)
    model, x, target = make()
    x.requires_grad_(True)

    def grad():
        x.grad = None
        model.zero_grad()
        model(x).sum().backward()
        return (x.grad if operand == "x" else model.b.grad).clone()

    golden = grad()
    s = flip_spec(site=site, target=target, bits=[28])
    validate_specs(model, [s], steps=1, probe=probe_model(model, lambda m: m(x).sum()))
    with Injector(model, [s]) as inj:
        inj.set_position(0)
        faulty = grad()
    (rec,) = inj.records
    assert changed(golden, faulty) == rec["index"] == [5]
    assert rec["before"] == [golden.reshape(-1)[5].item()] and rec["after"] == [flip32(rec["before"][0], 28)]


@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_a_padded_convs_grad_input_is_the_modules_dx(mode):
    """A padded Conv hands dX on at its pad, summed over the padded copies of each element."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode))
    s = flip_spec(site="gemm.grad_input", target="0", bits=[28], pattern={"kind": "element", "index": 0})
    validate_specs(model, [s], probe=probe_model(model, lambda m: m(x).sum()))
    model(x).sum().backward()
    golden, x.grad = x.grad.clone(), None
    with Injector(model, [s]) as inj:
        inj.set_position(0)
        model(x).sum().backward()
    (rec,) = inj.records
    assert changed(golden, x.grad) == rec["index"] == [0] and rec["before"] == [golden.reshape(-1)[0].item()]


class _Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.mm = MatMul()

    def forward(self, h):
        return self.mm(h, h)


def test_an_operand_gradient_no_single_node_hands_on_is_refused():
    """The same tensor as both operands of ``a @ b``: its gradient is the sum of two products."""
    model, h = _Square(), torch.randn(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="'mm': no single node of this call hands on the gradient of its operand 0"):
        validate_specs(
            model, [flip_spec(site="gemm.grad_input", target="mm")], probe=probe_model(model, lambda m: m(h).sum())
        )


def test_abft_sees_the_injected_matmul_operand_gradients():
    """ABFT reads dA / dB through its own operand views: the injector's node hooks corrupt them
    before those views, so the check names the faulty product."""
    from sdcscope.detect import ABFTConfig, ABFTDetector

    for site, gemm in (("gemm.grad_input", "grad_input"), ("gemm.grad_weight", "grad_weight")):
        torch.manual_seed(0)
        model = GPT(gpt_preset("tiny"))
        idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
        s = flip_spec(site=site, target="blocks.0.attn.context", pattern={"kind": "element", "index": "random"})
        with Injector(model, [s]) as inj:
            det = ABFTDetector(model, ABFTConfig()).attach()
            inj.set_position(0)
            det.begin_step(0)
            lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
            events = det.check(0)
            det.detach()
        assert len(inj.records) == 1
        assert {(e.module, e.gemm) for e in events} == {("blocks.0.attn.context", gemm)}


@pytest.mark.parametrize("cell", [(1, 2), (2, 4)])
def test_mac_cell_on_a_matmul_grad_weight_hits_b_at_input_row_and_output_column(cell):
    """b of ``a @ b`` is [K (input channels), N (output channels)]: cell (a, o) is b[a, o]."""
    torch.manual_seed(0)
    model = _MatMulInPlace()
    a = torch.randn(4, 3)
    s = flip_spec(
        site="gemm.grad_weight",
        target="mm",
        pattern={"kind": "mac_cell", "input_channel": cell[0], "output_channel": cell[1]},
    )
    validate_specs(model, [s], steps=1, probe=probe_model(model, lambda m: m(a).sum()))
    with Injector(model, [s]) as inj:
        inj.set_position(0)
        model(a).sum().backward()
    assert inj.records[0]["index"] == [cell[0] * 5 + cell[1]]
    wrong = flip_spec(site="gemm.grad_weight", target="mm", pattern={"kind": "mac_cell", "input_channel": 3})
    with pytest.raises(FaultSpecError, match="input_channel 3 is out of range for a tensor of shape \\[3, 5\\]"):
        validate_specs(model, [wrong], steps=1, probe=probe_model(model, lambda m: m(a).sum()))


def test_linear_grad_input_in_calls_autograd_does_not_record_and_on_a_frozen_weight():
    """``torch.no_grad()`` (an evaluation) and a reentrant checkpoint's first pass record no
    graph: no dX, no error; the recompute gets the fault. A frozen Linear still computes dX."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"fc": nn.Linear(6, 6)})
    x = torch.randn(4, 6, requires_grad=True)
    s = flip_spec(site="gemm.grad_input", target="fc", bits=[28])

    def run(forward):
        x.grad = None
        with Injector(model, [s]) as inj:
            inj.set_position(0)
            with torch.no_grad():
                model["fc"](x)
            forward().pow(2).sum().backward()
        return x.grad.clone(), [(r["index"], r["before"], r["after"]) for r in inj.records]

    plain = run(lambda: model["fc"](x))
    assert len(plain[1]) == 1
    recomputed = run(lambda: checkpoint(model["fc"], x, use_reentrant=True))
    assert torch.equal(recomputed[0], plain[0]) and recomputed[1] == plain[1]
    model.requires_grad_(False)
    frozen = run(lambda: model["fc"](x))
    assert torch.equal(frozen[0], plain[0]) and frozen[1] == plain[1]


# ------------------------------------------------------------------------------- records
