"""Each site: a single known flip at a known step lands exactly where the record says,
as the exact bit flip of the value before, and nothing else changes at that step."""

import struct

import pytest
import torch
from torch import nn

from helpers import flip_spec, random_flip
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, validate_specs
from sdcscope.inject.probe import probe_model
from sdcscope.workloads import WorkloadConfig, make_workload

STEP = 2


@pytest.fixture(scope="module")
def workload():
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))


def flip32(value: float, bit: int) -> float:
    (i,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", i ^ (1 << bit)))[0]


class Capture:
    """Engine callback + hooks that keep a copy of one tensor at STEP (seen after the injector)."""

    def __init__(self, trainer, site, module):
        self.value = None
        self.trainer = trainer
        mod = dict(trainer.model.named_modules()).get(module)
        if site in ("activation", "gemm.forward"):
            mod.register_forward_hook(self._keep_output)
        elif site == "gemm.grad_input":
            mod.register_full_backward_hook(lambda m, gi, go: self._keep(gi[0]))
        self.site, self.module = site, module

    def _keep(self, t):
        if self.trainer.step == STEP and self.value is None:
            self.value = t.detach().clone()

    def _keep_output(self, m, args, out):
        self._keep(out)

    def before_step(self, ctx):
        if ctx.step == STEP and self.site == "weight":
            p = dict(self.trainer.model.named_parameters())[self.module]
            self.value = p.detach().clone()

    def before_optimizer_step(self, ctx):
        if ctx.step != STEP:
            return
        named = dict(self.trainer.model.named_parameters())
        if self.site in ("param_grad", "gemm.grad_weight"):
            self.value = named[self.module].grad.detach().clone()

    def after_step(self, ctx):
        if ctx.step == STEP and self.site == "optimizer_state":
            p = dict(self.trainer.model.named_parameters())[self.module.split(":")[0]]
            self.value = self.trainer.optimizer.state[p]["exp_avg_sq"].detach().clone()


CASES = [
    # site, target, tensor captured, bit
    ("gemm.forward", "blocks.0.attn.q_proj", "blocks.0.attn.q_proj", 30),
    ("activation", "blocks.1.mlp", "blocks.1.mlp", 27),
    ("gemm.grad_input", "blocks.0.mlp.fc", "blocks.0.mlp.fc", 29),
    ("gemm.grad_weight", "blocks.1.attn.v_proj", "blocks.1.attn.v_proj.weight", 26),
    ("weight", "blocks.0.mlp.proj", "blocks.0.mlp.proj.weight", 30),
    ("param_grad", "blocks.0.ln1.weight", "blocks.0.ln1.weight", 28),
]


def _run(workload, spec_dict, site, captured, steps=STEP + 1):
    trainer = Trainer(workload, TrainConfig(seed=4))
    inj = None
    if spec_dict is not None:  # attached first: the capture hooks below see its result
        inj = Injector(trainer.model, [FaultSpec.from_dict(spec_dict)], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    cap = Capture(trainer, site, captured)
    trainer.add_callback(cap)
    for _ in range(steps):
        trainer.train_step()
    return cap.value, (inj.records if inj else None)


@pytest.mark.parametrize("site,target,captured,bit", CASES)
def test_single_flip_lands_exactly(workload, site, target, captured, bit):
    spec = {
        "site": site,
        "target": target,
        "model": "bitflip",
        "bits": [bit],
        "pattern": {"kind": "element", "index": "random"},
        "schedule": {"kind": "transient", "step": STEP},
        "seed": 11,
    }
    golden, _ = _run(workload, None, site, captured)
    faulty, records = _run(workload, spec, site, captured)
    assert len(records) == 1
    rec = records[0]
    assert rec["step"] == STEP and rec["site"] == site and rec["bits"] == [bit]
    (idx,), (before,), (after,) = rec["index"], rec["before"], rec["after"]
    assert after == flip32(before, bit)
    diff = (golden.reshape(-1) != faulty.reshape(-1)).nonzero().flatten().tolist()
    assert diff == [idx]
    assert golden.reshape(-1)[idx].item() == before
    assert faulty.reshape(-1)[idx].item() == after


def test_optimizer_state_flip(workload):
    spec = {
        "site": "optimizer_state",
        "target": "blocks.0.mlp.fc.weight",
        "state_key": "exp_avg_sq",
        "model": "bitflip",
        "bits": [23],
        "schedule": {"kind": "transient", "step": STEP},
        "seed": 3,
    }
    trainer = Trainer(workload, TrainConfig(seed=4))
    inj = Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach()
    trainer.callbacks.insert(0, inj.callback())
    p = trainer.model.blocks[0].mlp.fc.weight
    seen = {}

    def keep(opt, args, kwargs):
        if opt.state:
            seen.setdefault(trainer.step, opt.state[p]["exp_avg_sq"].clone())

    trainer.optimizer.register_step_pre_hook(keep)
    for _ in range(STEP + 1):
        trainer.train_step()
    (rec,) = inj.records
    (idx,), (before,), (after,) = rec["index"], rec["before"], rec["after"]
    assert rec["module"] == "blocks.0.mlp.fc.weight:exp_avg_sq"
    assert after == flip32(before, 23)
    # the pre-hook that captured ran after the injector's: it saw the flipped state
    assert seen[STEP].reshape(-1)[idx].item() == after


def test_checkpoint_flip_is_refused_by_manifest(workload, tmp_path):
    from sdcscope.engine import CheckpointError, load_checkpoint, save_checkpoint
    from sdcscope.inject import corrupt_checkpoint_file

    trainer = Trainer(workload, TrainConfig(seed=4))
    trainer.train_step()
    save_checkpoint(trainer.snapshot(), tmp_path / "ck")
    spec = FaultSpec.from_dict(
        {
            "site": "checkpoint",
            "target": "blocks.0.attn.k_proj.weight",
            "model": "bitflip",
            "bits": [30],
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    (rec,) = corrupt_checkpoint_file(tmp_path / "ck" / "state.pt", [spec])
    assert rec["after"][0] == flip32(rec["before"][0], 30)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "ck")
    raw = torch.load(tmp_path / "ck" / "state.pt", weights_only=True)
    assert raw["model"]["blocks.0.attn.k_proj.weight"].reshape(-1)[rec["index"][0]].item() == rec["after"][0]


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
    with Injector(model, [random_flip("activation", "0")]) as inj:
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
    with Injector(model, [random_flip("weight", "out.weight")]) as inj:
        inj.set_position(0)
    assert [r["module"] for r in inj.records] == ["out.weight"]
    assert (model.emb.weight != before).sum() == 1
    with Injector(model, [random_flip("weight", "*.weight")]):  # one tensor, one target
        pass


def changed(golden: torch.Tensor, faulty: torch.Tensor) -> list[int]:
    return (golden.reshape(-1) != faulty.reshape(-1)).nonzero().flatten().tolist()


class _Recurrent(nn.Module):
    """Modules returning tuples: an LSTM's (output, (h, c)), an attention's (output, weights)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.mha(h, h, h)[0]


def test_param_grad_on_a_sparse_embedding_gradient_lands_in_its_stored_rows():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    model, tokens = nn.Sequential(emb), torch.tensor([3, 1, 2, 1])
    model(tokens).pow(2).sum().backward()
    golden = emb.weight.grad.to_dense()
    emb.weight.grad = None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Injector(model, [flip_spec(site="param_grad", target="0")], optimizer) as inj:
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
        validate_specs(
            model,
            [
                flip_spec(
                    site="optimizer_state", target="temp", state_key="step", schedule={"kind": "transient", "step": 1}
                )
            ],
            optimizer,
        )
    s = flip_spec(
        site="optimizer_state",
        target="temp",
        pattern={"kind": "element", "index": 0},
        schedule={"kind": "transient", "step": 1},
    )
    with Injector(model, [s], optimizer) as inj:
        for step in range(2):
            optimizer.zero_grad()
            inj.set_position(step)
            (model["temp"] * 2).backward()
            optimizer.step()
    assert sorted(r["module"] for r in inj.records) == ["temp:exp_avg", "temp:exp_avg_sq"]
    assert optimizer.state[model["temp"]]["step"].item() == 2.0


@pytest.mark.parametrize("target", ["lstm", "mha"])
def test_an_activation_fault_lands_on_the_first_tensor_of_a_tuple_output(target):
    torch.manual_seed(0)
    model, x = _Recurrent(), torch.randn(2, 5, 8)
    probe = probe_model(model, lambda m: m(x).sum())
    module, got = getattr(model, target), []
    module.register_forward_hook(lambda m, a, out: got.append(out))
    model(x)
    with Injector(
        model, [flip_spec(site="activation", target=target, pattern={"kind": "element", "index": 7})], probe=probe
    ) as inj:
        model(x)
    clean, out = got
    assert type(out) is tuple and len(out) == 2
    assert [(r["module"], r["count"]) for r in inj.records] == [(target, 1)]
    assert (out[0] != clean[0]).flatten().nonzero().flatten().tolist() == [7]
    assert out[0].flatten()[7].item() == flip32(clean[0].flatten()[7].item(), 30)
    rest = (out[1], clean[1]) if target == "mha" else (out[1][0], clean[1][0])  # untouched
    assert torch.equal(*rest)


def test_dispatch_site_targets_moe_dispatches_only():
    """Site ``dispatch`` resolves to the MoE token dispatches (``is_dispatch``) and names them when a
    pattern hits another module."""
    from sdcscope.inject.targets import resolve_targets
    from sdcscope.workloads.moe import MoEConfig, MoEGPT

    model = MoEGPT(MoEConfig(n_layer=2, n_head=2, d_model=32, block_size=8, mlp_ratio=2, n_expert=2, top_k=1))
    spec = FaultSpec(site="dispatch", target="blocks.*", model="drop", schedule={"kind": "transient", "step": 0})
    assert [t.name for t in resolve_targets(model, spec)] == ["blocks.0.moe.dispatch", "blocks.1.moe.dispatch"]
    bad = FaultSpec(
        site="dispatch", target="blocks.0.moe.router", model="drop", schedule={"kind": "transient", "step": 0}
    )
    with pytest.raises(ValueError, match=r"no MoE token dispatch.*blocks.0.moe.dispatch"):
        resolve_targets(model, bad)
