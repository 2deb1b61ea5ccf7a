"""The MoE dispatch check: silent on clean dispatches, and a dropped, duplicated or bit-flipped
token of the permutation is caught exactly, in its step, naming the layer and the expert; ABFT
names the expert whose GEMM a flip hit, and the router whose logits one did."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sdcscope.detect import ABFTConfig, ABFTDetector, DispatchCheck
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads.moe import MoEConfig, MoEGPT

CFG = dict(n_layer=2, n_head=2, d_model=32, block_size=16, mlp_ratio=2, n_expert=2, top_k=2)


def _model(**cfg) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(MoEConfig(**{**CFG, **cfg}))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (2, 17), generator=g)
    return x[:, :-1], x[:, 1:]


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def _slot_expert(model: MoEGPT, layer: int, x: torch.Tensor, slot: int) -> int:
    """The expert the router sends dispatch slot ``slot`` of block ``layer`` to (a clean forward)."""
    seen = {}
    h = model.blocks[layer].moe.dispatch.register_forward_hook(lambda m, a, out: seen.update(counts=out.counts))
    with torch.no_grad():
        model(x)
    h.remove()
    return int(torch.searchsorted(seen["counts"].cumsum(0), torch.tensor(slot), right=True))


@pytest.mark.parametrize("model_name", ["drop", "duplicate", "bitflip"])
def test_a_corrupted_token_in_dispatch_is_caught_naming_layer_and_expert(model_name):
    model = _model(top_k=1 if model_name == "duplicate" else 2)
    extra = {"bits": [3]} if model_name == "bitflip" else {}  # a low mantissa bit: tiny, still exact
    spec = FaultSpec.from_dict(
        {
            "site": "dispatch",
            "target": "blocks.1.moe.dispatch",
            "model": model_name,
            **extra,
            "schedule": {"kind": "transient", "step": 1},
            "seed": 3,
        }
    )
    inj = Injector(model, [spec]).attach()
    check = DispatchCheck(model).attach()
    found = {}
    for step in range(3):
        inj.set_position(step)
        check.begin_step(step)
        _loss(model, _batch(step)).backward()
        found[step] = check.check(step)
    assert found[0] == [] and found[2] == []
    (event,) = found[1]
    (record,) = inj.records
    slot = record["index"][0] // 32
    expert = _slot_expert(model, 1, _batch(1)[0], slot)
    assert (event.detector, event.verdict, event.module) == ("dispatch", "token_mismatch", "blocks.1.moe.dispatch")
    assert event.evidence["expert"] == expert and event.index == (expert,)
    assert event.evidence["count"] == event.evidence["expected_count"]
    assert event.evidence["checksum"] != event.evidence["expected_checksum"]


def test_guard_catches_a_dropped_token_in_its_step_and_the_replay_repairs_it(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec = FaultSpec.from_dict(
        {
            "site": "dispatch",
            "target": "blocks.0.moe.dispatch",
            "model": "drop",
            "schedule": {"kind": "transient", "step": 1},
        }
    )
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(profile="minimal"), run_dir=tmp_path, loss_fn=_loss).attach()
    for step in range(3):
        inj.set_position(step)
        batch = _batch(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = _loss(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
    guard.close()
    assert [(e["step"], e["detector"], e["module"], e["verdict"], e["action"]) for e in guard.events] == [
        (1, "dispatch", "blocks.0.moe.dispatch", "transient", "recompute")
    ]


@pytest.mark.parametrize("target", ["blocks.0.moe.experts.1.fc", "blocks.1.moe.router"])
def test_abft_names_the_expert_or_router_whose_gemm_a_flip_hit(target):
    model = _model()
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": target,
            "model": "bitflip",
            "bits": [30],
            "schedule": {"kind": "transient", "step": 0},
            "seed": 1,
        }
    )
    inj = Injector(model, [spec]).attach()
    abft = ABFTDetector(model, ABFTConfig(kinds=("linear",))).attach()
    inj.set_position(0)
    _loss(model, _batch(0)).backward()
    events = abft.check(0)
    assert inj.records and events
    assert events[0].module == target and events[0].gemm == "forward"


def test_a_check_that_fails_never_breaks_the_forward_and_check_raises_it():
    class Broken(torch.nn.Module):  # claims the dispatch contract, returns two values instead of three
        is_dispatch, n_expert = True, 2

        def forward(self, x, experts):
            return x[experts.reshape(-1)], experts.reshape(-1)

    model = torch.nn.Sequential(Broken())
    check = DispatchCheck(model).attach()
    rows, _ = model[0](torch.ones(3, 4), torch.zeros(3, 1, dtype=torch.long))
    assert rows.shape == (3, 4)
    with pytest.raises(RuntimeError, match="dispatch check failed on step 0"):
        check.check(0)
    assert check.check(1) == []  # the error is reported once
