"""injections.jsonl records: one per application, labelled (``when``, ``call``), none lost or merged.

Covers a module called twice in one micro-batch, permanent memory faults re-applied after the
update, evaluation passes, ``param_grad`` under gradient accumulation and ``mac_cell`` on a
convolution with a non-zero padding mode.
"""

import struct
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import flip_spec, strict_loads
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import CommInjector, Injector, corrupt_checkpoint_file
from sdcscope.workloads import WorkloadConfig, make_workload


def spec(**kw):
    """Bit 31 of element 3 flipped once at step 0, unless ``kw`` says otherwise."""
    return flip_spec(**{"bits": [31], "pattern": {"kind": "element", "index": 3}, **kw})


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def rows(records, *keys):
    return [tuple(r[k] for k in keys) for r in records]


class Twice(nn.Module):
    """One Linear used twice per forward (weights shared across depth)."""

    def __init__(self, use_checkpoint=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use_checkpoint = use_checkpoint

    def body(self, x):
        return self.lin(torch.relu(self.lin(x)))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False) if self.use_checkpoint else self.body(x)


def _twice_run(s, use_checkpoint=False):
    torch.manual_seed(0)
    m = Twice(use_checkpoint)
    x = torch.randn(2, 4)
    clean = []
    h = m.lin.register_forward_hook(lambda mod, a, o: clean.append(o.detach().clone()))
    m(x)
    h.remove()
    seen = []
    m.lin.register_forward_hook(lambda mod, a, o: seen.append(o.detach().clone()))
    with Injector(m, [s]) as inj:
        inj.set_position(0)
        m(x).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    return clean, seen[:2], inj.records, grads


def test_shared_module_transient_fault_hits_the_first_call_once_and_is_logged_once():
    s = spec(site="gemm.forward", target="lin")
    clean, seen, records, grads = _twice_run(s)
    before = clean[0].reshape(-1)[3].item()
    assert rows(records, "step", "micro_batch", "when", "call", "index", "before", "after") == [
        (0, 0, "train", 0, [3], [before], [-before])
    ]
    assert seen[0].reshape(-1)[3].item() == -before  # the first call is corrupted...
    # ...the second one ran on the corrupted first call's result, not corrupted itself
    assert seen[1].reshape(-1)[3].item() != -seen[1].reshape(-1)[3].item()
    # activation checkpointing recomputes both calls: the same (single) corruption, logged once
    _, seen_ck, records_ck, grads_ck = _twice_run(s, use_checkpoint=True)
    assert records_ck == records and torch.equal(grads_ck, grads)
    assert all(torch.equal(a, b) for a, b in zip(seen_ck, seen))


def test_shared_module_permanent_fault_hits_every_call_each_logged():
    s = spec(site="gemm.forward", target="lin", schedule={"kind": "permanent", "start": 0})
    _, seen, records, grads = _twice_run(s)
    assert rows(records, "when", "call", "index") == [("train", 0, [3]), ("train", 1, [3])]
    for rec, out in zip(records, seen):
        assert rec["after"] == [-rec["before"][0]] and out.reshape(-1)[3].item() == rec["after"][0]
    _, _, records_ck, grads_ck = _twice_run(s, use_checkpoint=True)
    assert records_ck == records and torch.equal(grads_ck, grads)


def test_permanent_weight_fault_reapplied_after_every_update_is_logged():
    s = spec(
        site="weight",
        target="weight",
        model="stuck_at_0",
        bits=[22],
        pattern={"kind": "element", "index": [1, 2]},
        schedule={"kind": "permanent", "start": 0},
    )
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    updated = []  # the value the update wrote, before the injector re-applies the stuck bit
    opt.register_step_post_hook(lambda o, a, k: updated.append(m.weight.detach()[1, 2].item()))
    inj = Injector(m, [s], opt).attach()
    w0 = m.weight.detach()[1, 2].item()
    for step in range(6):
        inj.set_position(step)
        opt.zero_grad()
        m(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
    inj.close()
    stuck = [f32(bits(v) & ~(1 << 22)) for v in updated]
    expected_updates = [
        (k, "after_update", [v], [w]) for k, (v, w) in enumerate(zip(updated, stuck)) if bits(v) != bits(w)
    ]
    assert len(expected_updates) >= 2  # the stuck bit was set again by several updates
    got = rows(inj.records, "step", "when", "before", "after")
    assert [r for r in got if r[1] == "after_update"] == expected_updates
    # one pre-forward record per step (bit already cleared after step 0: before == after)
    assert [r[0] for r in got if r[1] == "train"] == list(range(6))
    assert got[0] == (0, "train", [w0], [f32(bits(w0) & ~(1 << 22))])
    # what the model holds at the end (after the last update) is the stuck value
    assert m.weight.detach()[1, 2].item() == stuck[-1]


@pytest.fixture(scope="module")
def gpt():
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))


def test_evaluation_records_never_replace_training_records(gpt):
    s = spec(
        site="gemm.forward",
        target="blocks.0.attn.q_proj",
        pattern={"kind": "element", "index": 5},
        schedule={"kind": "permanent", "start": 0},
    )
    once = spec(site="gemm.forward", target="blocks.0.mlp.fc", schedule={"kind": "transient", "step": 2})

    def run(eval_every):
        trainer = Trainer(gpt, TrainConfig(seed=1))
        inj = Injector(trainer.model, [s, once], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
        for _ in range(3):
            if eval_every and trainer.step and trainer.step % eval_every == 0:
                trainer.evaluate()
            trainer.train_step()
        trainer.evaluate()
        inj.close()
        return inj.records

    plain, evaluated = run(0), run(2)
    train = [r for r in evaluated if r["when"] == "train"]
    assert train == plain[:-1] and [r["when"] for r in plain[:-1]] == ["train"] * 4
    assert rows(train, "step", "spec", "call") == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 1, 0)]
    # one record per spec and module per evaluation (many batches), permanent faults only
    assert rows([r for r in evaluated if r["when"] == "eval"], "step", "spec", "call") == [(2, 0, 0), (3, 0, 0)]
    assert rows(plain[-1:], "step", "when", "spec") == [(3, "eval", 0)]


def test_param_grad_fires_once_per_step_on_the_accumulated_gradient(gpt):
    s = spec(site="param_grad", target="blocks.0.mlp.fc.bias", schedule={"kind": "transient", "step": 1})
    perm = spec(site="param_grad", target="blocks.0.mlp.proj.bias", schedule={"kind": "permanent", "start": 1})

    def run(specs):
        trainer = Trainer(gpt, TrainConfig(seed=2, grad_accum=3))
        inj = Injector(trainer.model, specs, trainer.optimizer).attach() if specs else None
        if inj is not None:
            trainer.add_callback(inj.callback())
        used = {}
        fc, proj = trainer.model.blocks[0].mlp.fc.bias, trainer.model.blocks[0].mlp.proj.bias

        class Read:  # the accumulated gradient the update reads (clipping, then the optimizer)
            def before_optimizer_step(self, ctx):
                used[ctx.step] = (fc.grad[3].item(), proj.grad[3].item())

        trainer.add_callback(Read())
        for _ in range(2):
            trainer.train_step()
        return used, (inj.records if inj else None)

    golden, _ = run([])
    faulty, records = run([s, perm])
    g = golden[1]
    assert rows(records, "step", "micro_batch", "spec", "module", "before", "after") == [
        (1, 2, 1, "blocks.0.mlp.proj.bias", [g[1]], [-g[1]]),
        (1, 2, 0, "blocks.0.mlp.fc.bias", [g[0]], [-g[0]]),
    ]
    assert faulty[0] == golden[0] and faulty[1] == (-g[0], -g[1])


@pytest.mark.parametrize("mode", ["zeros", "circular", "reflect"])
def test_mac_cell_conv_error_uses_the_modules_padding(mode):
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode)
    x = torch.randn(1, 2, 5, 5)
    s = spec(site="gemm.forward", target="0", pattern={"kind": "mac_cell", "input_channel": 1, "output_channel": 2})
    model = nn.Sequential(conv)
    with Injector(model, [s]) as inj, torch.no_grad():
        inj.set_position(0)
        y = model(x)
    (rec,) = inj.records
    assert rec["index"] == [2 * 18 + 9 + k for k in range(9)]  # weight[2, 1, :, :]
    ref = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode)
    ref.load_state_dict(conv.state_dict())
    with torch.no_grad():
        ref.weight.view(-1)[torch.tensor(rec["index"])] = torch.tensor(rec["after"])
        expected = ref(x)
        assert not torch.allclose(expected, conv(x))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_a_permanent_bitflip_in_memory_acts_once_on_each_written_value():
    """An inverting cell: between two writes (micro-batches, evaluations) the flip stays; each
    update's new value is flipped once (a second application would undo the first)."""
    s = spec(
        site="weight",
        target="weight",
        bits=[30],
        pattern={"kind": "element", "index": [1, 2]},
        schedule={"kind": "permanent", "start": 0},
    )
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    written = []  # what each update wrote, before the injector acts on it
    opt.register_step_post_hook(lambda o, a, k: written.append(bits(m.weight.detach()[1, 2].item())))
    inj = Injector(m, [s], opt).attach()
    w0 = bits(m.weight.detach()[1, 2].item())
    seen = []
    for step in range(4):
        for micro_batch in range(2):
            inj.set_position(step, micro_batch)
            seen.append(bits(m.weight.detach()[1, 2].item()))
            m(torch.randn(8, 4)).pow(2).sum().backward()
        inj.set_position(step, evaluating=True)
        seen.append(bits(m.weight.detach()[1, 2].item()))
        opt.step()
        opt.zero_grad()
    inj.close()
    held = [w0 ^ (1 << 30)] + [w ^ (1 << 30) for w in written[:-1]]  # the value in memory during each step
    assert seen == [v for v in held for _ in range(3)]
    assert bits(m.weight.detach()[1, 2].item()) == written[-1] ^ (1 << 30)


def test_fp64_faults_are_recorded_exactly_and_sampled_at_every_bit():
    t = torch.tensor([0.1, 1e300, -2.5, 3.0], dtype=torch.float64)
    m = nn.Linear(4, 4).double()
    with torch.no_grad():
        m.weight[0] = t
    s = spec(site="weight", target="weight", bits=[0, 63], pattern={"kind": "element", "index": [0, 1]})
    inj = Injector(m, [s]).attach()
    inj.set_position(0)
    (rec,) = inj.records
    assert rec["before"] == [1e300] and rec["after"] == [m.weight[0, 1].item()] == [-1.0000000000000002e300]
    ber = spec(site="weight", target="weight", bits=[62, 63], pattern={"kind": "tensor", "ber": 0.5}, seed=3)
    inj2 = Injector(m, [ber]).attach()
    inj2.set_position(0)
    changed = [
        (a ^ b) & (2**64 - 1)
        for a, b in zip(
            torch.tensor(inj2.records[0]["before"], dtype=torch.float64).view(torch.int64).tolist(),
            torch.tensor(inj2.records[0]["after"], dtype=torch.float64).view(torch.int64).tolist(),
        )
    ]
    assert changed and set(changed) <= {1 << 62, 1 << 63, 3 << 62}


def test_a_tied_tensor_in_a_checkpoint_is_corrupted_once(tmp_path):
    from sdcscope.inject import corrupt_checkpoint_file

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    m = Tied()
    s = FaultSpec.from_dict(
        {
            "site": "checkpoint",
            "target": "*.weight",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": [2, 1]},
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    torch.save({"model": m.state_dict(), "step": 1}, tmp_path / "state.pt")
    (rec,) = corrupt_checkpoint_file(tmp_path / "state.pt", [s])
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    assert rec["module"] == "emb.weight" and bits(saved["emb.weight"][2, 1].item()) == bits(
        m.emb.weight[2, 1].item()
    ) ^ (1 << 30)


def test_a_transient_param_grad_fault_acts_once_however_often_backward_runs():
    s = spec(site="param_grad", target="weight", bits=[30], pattern={"kind": "element", "index": [0, 0]})
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    inj = Injector(m, [s]).attach()
    inj.set_position(0)
    x = torch.randn(3, 4)
    m(x).sum().backward()
    m(x).pow(2).sum().backward()  # a second loss of the same step
    assert len(inj.records) == 1


def test_a_layers_dx_fault_lands_behind_another_fault_that_replaced_its_output():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    specs = [
        spec(site="gemm.grad_input", target="2", bits=[30], pattern={"kind": "element", "index": [1, 2]}),
        spec(site="gemm.forward", target="2", model="zero", bits=None, pattern={"kind": "mac_cell"}),
    ]
    inj = Injector(m, specs).attach()
    inj.set_position(0)
    m(torch.randn(2, 4)).sum().backward()
    assert sorted(r["site"] for r in inj.records) == ["gemm.forward", "gemm.grad_input"]


def test_injection_records_with_non_finite_values_are_strict_json(tmp_path):
    # stuck-at-1 on fp32 bit 30 (the exponent's top bit) turns +-[1, 2) into NaN, +-1.0 into +-inf
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.5, -1.25, 1.0, -1.0]] * 3))
    spec = FaultSpec(
        site="weight",
        target="weight",
        model="stuck_at_1",
        bits=[30],
        pattern={"kind": "row", "index": 0},
        schedule={"kind": "transient", "step": 0},
    )
    log = tmp_path / "injections.jsonl"
    with Injector(model, [spec], log=log) as inj:
        inj.set_position(0, 0)
    (line,) = log.read_text().splitlines()
    record = strict_loads(line)
    assert record["before"] == [1.5, -1.25, 1.0, -1.0]
    assert record["after"] == ["nan", "nan", "inf", "-inf"]
    assert "NaN" not in line and "Infinity" not in line


def test_every_site_records_when_and_call(tmp_path):
    """Checkpoint and comm records carry the fields every injections.jsonl line has."""
    model = nn.Sequential(nn.Linear(4, 4))
    with Injector(model, [flip_spec(site="weight", target="0")]) as inj:
        inj.set_position(0)
    fields = set(inj.records[0])
    torch.save(
        {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "step": 1}, tmp_path / "state.pt"
    )
    (ckpt,) = corrupt_checkpoint_file(
        tmp_path / "state.pt", [flip_spec(site="checkpoint", target="0", schedule={"kind": "transient", "step": 1})]
    )
    assert set(ckpt) == fields and (ckpt["when"], ckpt["call"]) == ("train", None)
    comm = CommInjector(model, [flip_spec(site="comm", target="0.weight")])
    comm.set_position(0)
    grad = torch.zeros(4, 4)
    comm.before_reduce(types.SimpleNamespace(index=0, buffer=grad.view(-1), names=["0.weight"], grads=[grad]))
    (rec,) = comm.records
    assert set(rec) == fields | {"phase"} and (rec["when"], rec["call"]) == ("train", None)
