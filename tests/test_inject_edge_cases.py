"""Injector edge cases: each fault lands where its record says, or its spec is refused before any
work -- autocast, in-place ops after a GEMM, calls autograd does not record, frozen and sparse
parameters, evaluation batches, Adam's step counter, DDP comm specs, ``a @ b`` MAC cells, resumed
runs and the records of every site."""

import struct
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.faults import FaultSpec, FaultSpecError
from sdcscope.inject import CommInjector, Injector, corrupt_checkpoint_file, validate_specs
from sdcscope.inject.targets import probe_model
from sdcscope.workloads.gpt import GPT, MatMul, gpt_preset, lm_loss

runner = CliRunner()


def spec(**kw):
    base = {"model": "bitflip", "bits": [30], "pattern": {"kind": "element", "index": 5},
            "schedule": {"kind": "transient", "step": 0}}
    base.update(kw)
    return FaultSpec.from_dict(base)


def flip32(value: float, bit: int) -> float:
    (i,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", i ^ (1 << bit)))[0]


def flip_bf16(value: float, bit: int) -> float:
    word = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16) ^ (1 << bit)
    return word.view(torch.bfloat16).item()


def changed(golden: torch.Tensor, faulty: torch.Tensor) -> list[int]:
    return (golden.reshape(-1) != faulty.reshape(-1)).nonzero().flatten().tolist()


def _cli(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


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
        validate_specs(model, [spec(site="gemm.grad_input", target="b", bits=[20])], probe=probe)
    fits = spec(site="gemm.grad_input", target="b", bits=[14])
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


@pytest.mark.parametrize("make, site, operand", [
    (_conv(nn.Conv2d, (2, 3, 6, 6)), "gemm.grad_input", "x"),
    (_conv(nn.Conv1d, (2, 3, 6)), "gemm.grad_input", "x"),
    (lambda: (_MatMulInPlace(), torch.randn(4, 3), "mm"), "gemm.grad_input", "x"),
    (lambda: (_MatMulInPlace(), torch.randn(4, 3), "mm"), "gemm.grad_weight", "b"),
], ids=["conv2d", "conv1d", "matmul-a", "matmul-b"])
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
    s = spec(site=site, target=target, bits=[28])
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
    s = spec(site="gemm.grad_input", target="0", bits=[28], pattern={"kind": "element", "index": 0})
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
        validate_specs(model, [spec(site="gemm.grad_input", target="mm")],
                       probe=probe_model(model, lambda m: m(h).sum()))


def test_abft_sees_the_injected_matmul_operand_gradients():
    """ABFT reads dA / dB through its own operand views: the injector's node hooks corrupt them
    before those views, so the check names the faulty product."""
    from sdcscope.detect import ABFTConfig, ABFTDetector

    for site, gemm in (("gemm.grad_input", "grad_input"), ("gemm.grad_weight", "grad_weight")):
        torch.manual_seed(0)
        model = GPT(gpt_preset("tiny"))
        idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
        s = spec(site=site, target="blocks.0.attn.context", pattern={"kind": "element", "index": "random"})
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
    s = spec(site="gemm.grad_weight", target="mm",
             pattern={"kind": "mac_cell", "input_channel": cell[0], "output_channel": cell[1]})
    validate_specs(model, [s], steps=1, probe=probe_model(model, lambda m: m(a).sum()))
    with Injector(model, [s]) as inj:
        inj.set_position(0)
        model(a).sum().backward()
    assert inj.records[0]["index"] == [cell[0] * 5 + cell[1]]
    wrong = spec(site="gemm.grad_weight", target="mm", pattern={"kind": "mac_cell", "input_channel": 3})
    with pytest.raises(FaultSpecError, match="input_channel 3 is out of range for a tensor of shape \\[3, 5\\]"):
        validate_specs(model, [wrong], steps=1, probe=probe_model(model, lambda m: m(a).sum()))


def test_linear_grad_input_in_calls_autograd_does_not_record_and_on_a_frozen_weight():
    """``torch.no_grad()`` (an evaluation) and a reentrant checkpoint's first pass record no
    graph: no dX, no error; the recompute gets the fault. A frozen Linear still computes dX."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"fc": nn.Linear(6, 6)})
    x = torch.randn(4, 6, requires_grad=True)
    s = spec(site="gemm.grad_input", target="fc", bits=[28])

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


# ------------------------------------------------------------------------- parameter sites
def test_param_grad_on_a_sparse_embedding_gradient_lands_in_its_stored_rows():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    model, tokens = nn.Sequential(emb), torch.tensor([3, 1, 2, 1])
    model(tokens).pow(2).sum().backward()
    golden = emb.weight.grad.to_dense()
    emb.weight.grad = None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Injector(model, [spec(site="param_grad", target="0")], optimizer) as inj:
        inj.set_position(0)
        model(tokens).pow(2).sum().backward()
        optimizer.step()
    (rec,) = inj.records
    # stored rows 1, 2, 3 (coalesced): value 5 is row 2, column 1 -> flat 2 * 4 + 1 of the weight
    assert emb.weight.grad.is_sparse and rec["index"] == [9]
    assert changed(golden, emb.weight.grad.to_dense()) == [9]
    assert rec["before"] == [golden.reshape(-1)[9].item()] and rec["after"] == [flip32(rec["before"][0], 30)]


def test_optimizer_state_without_state_key_spares_adams_step_counter():
    """A 0-d parameter's ``step`` is shaped like it: a counter, not memory of the moments."""
    torch.manual_seed(0)
    model = nn.ParameterDict({"temp": nn.Parameter(torch.tensor(1.5))})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="state_key 'step' is never created.*allowed: exp_avg, exp_avg_sq"):
        validate_specs(model, [spec(site="optimizer_state", target="temp", state_key="step",
                                    schedule={"kind": "transient", "step": 1})], optimizer)
    s = spec(site="optimizer_state", target="temp", pattern={"kind": "element", "index": 0},
             schedule={"kind": "transient", "step": 1})
    with Injector(model, [s], optimizer) as inj:
        for step in range(2):
            optimizer.zero_grad()
            inj.set_position(step)
            (model["temp"] * 2).backward()
            optimizer.step()
    assert sorted(r["module"] for r in inj.records) == ["temp:exp_avg", "temp:exp_avg_sq"]
    assert optimizer.state[model["temp"]]["step"].item() == 2.0


PERMANENT_ROW = """\
- site: activation
  target: fc3
  model: bitflip
  bits: [30]
  pattern: {kind: row, index: 400}
  schedule: {kind: SCHEDULE}
"""


def test_a_permanent_module_fault_is_checked_against_the_evaluation_batches(tmp_path):
    """A permanent fault acts in evaluation too, whose batch (the validation set) has fewer rows
    than a training batch of 512: refused before the run starts, not at its final evaluation."""
    faults = tmp_path / "perm.yaml"
    faults.write_text(PERMANENT_ROW.replace("SCHEDULE", "permanent, start: 0"))
    code, out = _cli("train", "--workload", "cnn", "--batch-size", 512, "--steps", 1, "--faults", faults,
                     "--out", tmp_path / "perm")
    assert code == 2 and "'fc3': pattern row index 400 is out of range" in out, out
    assert not (tmp_path / "perm").exists()
    faults.write_text(PERMANENT_ROW.replace("SCHEDULE", "transient, step: 0"))   # training batches only
    code, out = _cli("train", "--workload", "cnn", "--batch-size", 512, "--steps", 1, "--faults", faults,
                     "--out", tmp_path / "once")
    assert code == 0, out


PERMANENT_FLIPS = """\
- site: weight
  target: fc1
  model: bitflip
  bits: [29]
  pattern: {kind: element, index: 10}
  schedule: {kind: permanent, start: 1}
- site: optimizer_state
  target: fc2.weight
  state_key: exp_avg
  model: bitflip
  bits: [27]
  pattern: {kind: element, index: 3}
  schedule: {kind: permanent, start: 1}
"""


def test_a_resumed_run_keeps_its_permanent_bit_flips_bitwise(tmp_path):
    """The checkpoint holds the flipped values: the resumed injector knows them in place rather
    than flipping them back."""
    import json

    faults = tmp_path / "flips.yaml"
    faults.write_text(PERMANENT_FLIPS)
    common = ["train", "--workload", "cnn", "--faults", faults]
    assert _cli(*common, "--steps", 4, "--out", tmp_path / "whole")[0] == 0
    assert _cli(*common, "--steps", 2, "--out", tmp_path / "part")[0] == 0
    assert _cli("train", "--resume", tmp_path / "part", "--steps", 4)[0] == 0
    whole, part = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "part"))
    assert part["param_sha256"] == whole["param_sha256"]
    assert (tmp_path / "part" / "injections.jsonl").read_text() == (tmp_path / "whole" / "injections.jsonl").read_text()


# ---------------------------------------------------------------------------------- comm
COMM = """\
- site: weight
  target: fc1
  model: stuck_at_1
  bits: [29]
  schedule: {kind: permanent, start: 0}
- site: comm
  target: fc1.weight
  phase: before
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: 3}
  schedule: {kind: transient, step: 1}
"""


@pytest.mark.parametrize("edit, needles", [
    (lambda t: t.replace("bits: [30]", "bits: [40]"), ["'fc1.weight': bit 40 is out of range for fp32"]),
    (lambda t: t.replace("step: 1}", "step: 50}"), ["never fires", "steps 0..2 of this 3-step run"]),
    (lambda t: t.replace("{kind: element, index: 3}", "{kind: row, index: 100000}"),
     ["'fc1.weight': pattern row index 100000 is out of range for a tensor of shape [64, 64]"]),
    (lambda t: t.replace("target: fc1.weight", "target: bucket.0").replace("index: 3", "index: 1000000000"),
     ["a gradient bucket (flat, torch.float32, at most", "index 1000000000 is out of range"]),
], ids=["bits", "schedule", "parameter-shape", "bucket-size"])
def test_a_ddp_job_refuses_comm_specs_before_any_rank_starts(tmp_path, edit, needles):
    from sdcscope.engine.ddp import check_job, parse_job

    faults = tmp_path / "comm.yaml"
    faults.write_text(edit(COMM))
    job = parse_job(["--workload", "cnn", "--faults", str(faults), "--steps", "3", "--out", str(tmp_path / "run")], 2)
    with pytest.raises(ValueError) as refused:
        check_job(job, 2)
    assert str(refused.value).startswith("fault spec #1 (comm on ")
    for needle in needles:
        assert needle in str(refused.value)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------- records
def test_every_site_records_when_and_call(tmp_path):
    """Checkpoint and comm records carry the fields every injections.jsonl line has."""
    model = nn.Sequential(nn.Linear(4, 4))
    with Injector(model, [spec(site="weight", target="0")]) as inj:
        inj.set_position(0)
    fields = set(inj.records[0])
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "step": 1},
               tmp_path / "state.pt")
    (ckpt,) = corrupt_checkpoint_file(tmp_path / "state.pt", [spec(site="checkpoint", target="0",
                                                                     schedule={"kind": "transient", "step": 1})])
    assert set(ckpt) == fields and (ckpt["when"], ckpt["call"]) == ("train", None)
    comm = CommInjector(model, [spec(site="comm", target="0.weight")])
    comm.set_position(0)
    grad = torch.zeros(4, 4)
    comm.before_reduce(types.SimpleNamespace(index=0, buffer=grad.view(-1), names=["0.weight"], grads=[grad]))
    (rec,) = comm.records
    assert set(rec) == fields | {"phase"} and (rec["when"], rec["call"]) == ("train", None)


class _Recurrent(nn.Module):
    """Modules returning tuples: an LSTM's (output, (h, c)), an attention's (output, weights)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.mha(h, h, h)[0]


@pytest.mark.parametrize("target", ["lstm", "mha"])
def test_an_activation_fault_lands_on_the_first_tensor_of_a_tuple_output(target):
    torch.manual_seed(0)
    model, x = _Recurrent(), torch.randn(2, 5, 8)
    probe = probe_model(model, lambda m: m(x).sum())
    module, got = getattr(model, target), []
    module.register_forward_hook(lambda m, a, out: got.append(out))
    model(x)
    with Injector(model, [spec(site="activation", target=target, pattern={"kind": "element", "index": 7})],
                  probe=probe) as inj:
        model(x)
    clean, out = got
    assert type(out) is tuple and len(out) == 2
    assert [(r["module"], r["count"]) for r in inj.records] == [(target, 1)]
    assert (out[0] != clean[0]).flatten().nonzero().flatten().tolist() == [7]
    assert out[0].flatten()[7].item() == flip32(clean[0].flatten()[7].item(), 30)
    rest = (out[1], clean[1]) if target == "mha" else (out[1][0], clean[1][0])   # untouched
    assert torch.equal(*rest)
