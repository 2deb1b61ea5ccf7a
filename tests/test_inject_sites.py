"""Each site: a single known flip at a known step lands exactly where the record says,
as the exact bit flip of the value before, and nothing else changes at that step."""

import struct

import pytest
import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
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
    spec = {"site": site, "target": target, "model": "bitflip", "bits": [bit],
            "pattern": {"kind": "element", "index": "random"},
            "schedule": {"kind": "transient", "step": STEP}, "seed": 11}
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
    spec = {"site": "optimizer_state", "target": "blocks.0.mlp.fc.weight", "state_key": "exp_avg_sq",
            "model": "bitflip", "bits": [23], "schedule": {"kind": "transient", "step": STEP}, "seed": 3}
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
    spec = FaultSpec.from_dict({"site": "checkpoint", "target": "blocks.0.attn.k_proj.weight",
                                "model": "bitflip", "bits": [30], "schedule": {"kind": "transient", "step": 1}})
    (rec,) = corrupt_checkpoint_file(tmp_path / "ck" / "state.pt", [spec])
    assert rec["after"][0] == flip32(rec["before"][0], 30)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "ck")
    raw = torch.load(tmp_path / "ck" / "state.pt", weights_only=True)
    assert raw["model"]["blocks.0.attn.k_proj.weight"].reshape(-1)[rec["index"][0]].item() == rec["after"][0]
