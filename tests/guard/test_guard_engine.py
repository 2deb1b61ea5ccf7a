"""The Guard in the engine and in a plain loop: detection, replay verdicts, repair, robustness."""

import math

import pytest
import torch

from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

STEP = 12


@pytest.fixture(scope="module")
def gpt():
    return make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=4))


def run(workload, spec=None, guard=True, steps=STEP + 6, config=None):
    trainer = Trainer(workload, TrainConfig(seed=1))
    if spec is not None:
        inj = Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    g = None
    if guard:
        g = Guard(trainer.model, trainer.optimizer, config or GuardConfig(profile="full"))
        trainer.add_callback(g.callback())
    while trainer.step < steps:
        trainer.train_step()
    return trainer, g


@pytest.fixture(scope="module")
def golden(gpt):
    trainer, _ = run(gpt, guard=False)
    return param_sha256(trainer.model)


def flip(site, target, bit, **kw):
    return {
        "site": site,
        "target": target,
        "model": "bitflip",
        "bits": [bit],
        "schedule": {"kind": "transient", "step": STEP},
        "seed": 7,
        **kw,
    }


@pytest.mark.parametrize(
    "site,gemm,target",
    [
        ("gemm.forward", "forward", "blocks.0.attn.q_proj"),
        ("gemm.grad_input", "grad_input", "blocks.1.mlp.fc"),
        ("gemm.grad_weight", "grad_weight", "blocks.0.attn.o_proj"),
        ("gemm.forward", "forward", "blocks.1.attn.score"),
    ],
)
def test_gemm_flip_detected_localized_and_recomputed(gpt, golden, site, gemm, target):
    trainer, g = run(gpt, flip(site, target, 29))
    abft = [e for e in g.events if e["detector"] == "abft"]
    assert abft and all(e["step"] == STEP for e in g.events)
    assert abft[0]["module"] == target and abft[0]["gemm"] == gemm
    assert abft[0]["verdict"] == "transient" and abft[0]["action"] == "recompute"
    assert abft[0]["evidence"]["replay"]["first_differing_grad"] is not None
    # the clean re-execution replaced the corrupted step: the run equals the golden one
    assert param_sha256(trainer.model) == golden


def test_weight_flip_caught_by_state_checksum_and_rolled_back(gpt, golden):
    trainer, g = run(gpt, flip("weight", "blocks.0.mlp.fc.weight", 30))
    (e,) = g.events
    assert (e["detector"], e["verdict"], e["module"], e["action"]) == (
        "state_checksum",
        "corrupt",
        "blocks.0.mlp.fc.weight",
        "rollback",
    )
    assert param_sha256(trainer.model) == golden


def test_adam_state_flip_caught_by_state_checksum(gpt, golden):
    trainer, g = run(gpt, flip("optimizer_state", "blocks.1.attn.k_proj.weight", 30, state_key="exp_avg"))
    (e,) = g.events
    assert e["evidence"]["tensor"] == "blocks.1.attn.k_proj.weight:exp_avg"
    assert param_sha256(trainer.model) == golden


def test_unguarded_flip_derails_guarded_run_does_not(gpt):
    clean, _ = run(gpt, guard=False)
    golden_val = clean.evaluate()["val_loss"]
    for seed in range(8):  # the first exponent flip (random element) that derails the unguarded run
        spec = {**flip("gemm.forward", "blocks.1.mlp.fc", 30), "seed": seed}
        bad, _ = run(gpt, spec, guard=False)
        bad_val = bad.evaluate()["val_loss"]
        if not math.isfinite(bad_val) or abs(bad_val - golden_val) > 0.005 * golden_val:
            break
    else:
        pytest.fail("no derailing flip found")
    good, g = run(gpt, spec)
    assert g.events and abs(good.evaluate()["val_loss"] - golden_val) <= 0.005 * golden_val


def test_clean_run_raises_no_event(gpt):
    trainer, g = run(gpt, steps=120)
    assert g.events == []


def test_plain_loop_api_replays_with_loss_fn(gpt):
    torch.manual_seed(0)
    model = gpt.build_model()
    opt = gpt.build_optimizer(model)
    spec = FaultSpec.from_dict(flip("gemm.grad_input", "blocks.0.mlp.proj", 28))
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=gpt.loss).attach()
    applied = []
    for step in range(STEP + 2):
        inj.set_position(step)
        batch = gpt.batch(0, step)
        opt.zero_grad(set_to_none=True)
        with guard.step(step, batch):
            loss = gpt.loss(model, batch)
            loss.backward()
        applied.append(guard.optimizer_step(loss))
    assert all(applied)
    (e,) = [e for e in guard.events if e["detector"] == "abft"]
    assert e["verdict"] == "transient" and e["module"] == "blocks.0.mlp.proj" and e["gemm"] == "grad_input"


SPIKE = 40


def test_reproducible_data_spike_is_skipped(gpt):
    """A batch of garbage spikes the loss; the replay repeats it exactly (data, not hardware),
    so the policy vetoes the step, skips the batch and backs the learning rate off."""
    torch.manual_seed(0)
    model = gpt.build_model()
    opt = gpt.build_optimizer(model)
    cfg = GuardConfig(profile="full", loss_spike={"warmup": 20, "alarm_z": 5.0}, abft=None)
    guard = Guard(model, opt, cfg, loss_fn=gpt.loss).attach()
    results = []
    for step in range(SPIKE + 2):
        x, y = gpt.batch(0, step)
        if step == SPIKE:
            y = torch.full_like(y, 255)  # every target the rarest byte: a huge loss
        opt.zero_grad(set_to_none=True)
        with guard.step(step, (x, y)):
            loss = gpt.loss(model, (x, y))
            loss.backward()
        results.append(guard.optimizer_step(loss))
    spikes = [e for e in guard.events if e["detector"] == "spike"]
    assert spikes and spikes[0]["step"] == SPIKE and spikes[0]["verdict"] == "reproducible"
    assert "skip_batch" in spikes[0]["action"] and results[SPIKE] is False
    assert SPIKE in guard.skip_batches and guard.backoff.scale(SPIKE + 1) < 1.0


def test_internal_failure_is_an_event_not_a_crash(gpt, monkeypatch):
    trainer, g = run(gpt, steps=0)
    monkeypatch.setattr(g.abft, "check", lambda step=None: 1 / 0)
    trainer.train_step()
    (e,) = g.events
    assert (
        e["detector"] == "guard" and e["verdict"] == "internal_error" and "ZeroDivisionError" in e["evidence"]["error"]
    )
    g.config.strict = True
    with pytest.raises(ZeroDivisionError):
        trainer.train_step()


@pytest.mark.parametrize("rules,action", [({}, "qk_clip"), ({"attention_logit:high": ["none"]}, "report")])
def test_attention_logits_above_qk_clip_follow_the_policy(gpt, rules, action):
    """Logit bounds above qk_clip are findings; the policy decides whether W_q/W_k are rescaled."""
    config = GuardConfig.from_dict({"qk_clip": 1e-3, "policy": {"rules": rules}})
    trainer, g = run(gpt, steps=2, config=config)
    found = [e for e in g.events if e["detector"] == "attention_logit"]
    assert found and {e["action"] for e in found} == {action}
    assert all((e["evidence"]["scale"] < 1.0) == (action == "qk_clip") for e in found)
