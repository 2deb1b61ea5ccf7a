"""The Guard's policy and its actions: rules merged over the defaults, unknown names refused,
a quarantine rule in one process, and ZClip on sparse and non-finite gradients."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import batch_of, ce, guarded_step, make_loop, mlp, params, same, weight_fault_run
from sdcscope.detect import ABFTDetector, NonFiniteDetector, SpikeDetector, StateChecksum
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.actions import SOLO_QUARANTINE
from sdcscope.mitigate import DEFAULT_RULES, PolicyConfig, ZClip, ZClipConfig
from sdcscope.mitigate.policy import VERDICTS


# -- 7. ZClip on sparse gradients; the guard's own errors do not hold snapshots back --------------------------
class SparseLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8, sparse=True), nn.Linear(8, 20)

    def forward(self, x):
        return self.head(self.emb(x))


def lm_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).reshape(-1, 20), batch[:, 1:].reshape(-1))


# -- 1. quarantine in a single process ----------------------------------------------------------------
def test_a_quarantine_rule_in_one_process_vetoes_the_step_stops_and_says_why():
    """No other rank can carry on: the step is void, as under DDP, training stops cleanly, and the
    event says so."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    config = GuardConfig(policy={"rules": {"nonfinite:reproducible": ["quarantine", "skip_batch"]}})
    guard = Guard(model, opt, config, loss_fn=ce).attach()
    x, y = batch_of(0)
    x[0, 0] = math.nan
    before = params(model)
    assert not guarded_step(guard, model, 0, (x, y))
    assert same(before, params(model)) and guard.skip_batches == {0} and guard.discarded_steps == 1
    *findings, stopped = guard.events
    assert {e["action"] for e in findings} == {"veto, stop, skip_batch"}
    assert all(e["evidence"]["quarantine"] == SOLO_QUARANTINE for e in findings)
    assert (stopped["detector"], stopped["verdict"], stopped["action"]) == ("guard", "stopped", "stop")
    assert guard.stopped and "nonfinite: reproducible" in guard.stop_reason


def test_zclip_clips_sparse_gradients():
    torch.manual_seed(0)
    model = SparseLM()
    opt = torch.optim.SGD(model.parameters(), 0.5)
    guard = Guard(
        model, opt, GuardConfig(zclip={"max_grad_norm": 0.01}, snapshots={"every": 3}), loss_fn=lm_loss
    ).attach()
    gen = torch.Generator().manual_seed(1)
    used = []

    def measure():
        used.append(
            math.sqrt(
                model.head.weight.grad.square().sum()
                + model.head.bias.grad.square().sum()
                + model.emb.weight.grad.coalesce().values().square().sum()
            )
        )

    for step in range(7):
        assert guarded_step(
            guard, model, step, torch.randint(0, 20, (4, 6), generator=gen), loss_fn=lm_loss, before_step=measure
        )
    assert guard.events == [] and max(used) <= 0.01 + 1e-6
    assert guard.ring.latest().step == 6


def test_zclip_scales_a_sparse_gradient_in_place():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 2])).sum().backward()
    grad = emb.weight.grad
    norm, limit = ZClip(ZClipConfig(max_grad_norm=0.5)).clip_([emb.weight])
    assert norm == pytest.approx(math.sqrt(15.0)) and limit == 0.5  # rows 2·1 and 1·1, three columns
    assert emb.weight.grad is grad and grad.coalesce().values().norm().item() == pytest.approx(0.5, rel=1e-5)


# -- 3. policy rules --------------------------------------------------------------------------------
def test_policy_rules_merge_over_defaults():
    rules = GuardConfig.from_dict({"policy": {"rules": {"abft:transient": ["veto"]}}}).policy.rules
    assert rules["abft:transient"] == ["veto"]
    assert {k: v for k, v in rules.items() if k != "abft:transient"} == DEFAULT_RULES
    empty = GuardConfig.from_dict({"policy": {"defaults": False, "rules": {"*:*": "veto"}}}).policy
    assert empty.rules == {"*:*": ["veto"]} and empty.actions_for("state_checksum", "corrupt") == ["veto"]
    again = GuardConfig.from_dict(GuardConfig(policy={"rules": {"spike:*": ["report"]}}).to_dict()).policy
    assert again.rules == {**DEFAULT_RULES, "spike:*": ["report"]}


def test_one_rule_keeps_the_weight_rollback():
    config = GuardConfig.from_dict({"policy": {"rules": {"abft:transient": ["veto"]}}})
    model, opt, inj = make_loop(True, site="weight")
    guard = Guard(model, opt, config, run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
    weight_fault_run(guard, model, opt, inj)
    assert [(e["detector"], e["action"]) for e in guard.events] == [("state_checksum", "rollback")]
    assert model[2].weight.abs().max().item() < 10


@pytest.mark.parametrize(
    "rules, match",
    [
        ({"abtf:transient": ["veto"]}, r"unknown detector 'abtf' \(did you mean 'abft'\?\); allowed: abft, "),
        ({"abft:transiant": ["veto"]}, r"unknown verdict 'transiant' for detector 'abft' \(did you mean 'transient'"),
        (
            {"state_checksum:transient": ["veto"]},
            r"verdict 'transient' for detector 'state_checksum'.*allowed: corrupt",
        ),
        (
            {"*:bogus": ["veto"]},
            r"unknown verdict 'bogus'; allowed: transient, reproducible, unverified, persistent, corrupt",
        ),
        ({"abft": ["veto"]}, r"'detector:verdict'"),
        ({"abft:transient": ["vetoo"]}, r"'vetoo'; allowed: none, veto"),
        ({"abft:transient": 3}, r"'abft:transient'.*3.*allowed: none, veto"),
    ],
)
def test_policy_refuses_unknown_names(rules, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GuardConfig.from_dict({"policy": {"rules": rules}})


def test_policy_defaults_flag_is_a_boolean_and_wildcards_stay():
    with pytest.raises(TypeError, match="policy defaults='no' must be a boolean"):
        PolicyConfig(defaults="no")
    policy = PolicyConfig(rules={"*:*": ["report"], "abft:*": ["veto"], "*:corrupt": ["veto"]})
    assert policy.actions_for("abft", "reproducible") == ["veto"]
    assert policy.actions_for("abft", "transient") == ["recompute"]  # the default, more specific
    assert policy.actions_for("spike", "transient") == ["recompute"]


def test_policy_detectors_are_the_detectors_names():
    names = {ABFTDetector.name, NonFiniteDetector.name, SpikeDetector.name, StateChecksum.name}
    assert names | {"attention_logit"} == set(VERDICTS)
    for key in DEFAULT_RULES:  # the defaults pass their own validation
        PolicyConfig(defaults=False, rules={key: ["report"]})


# -- D: ZClip and non-finite norms ----------------------------------------------------------
NORMS = [1, 1.1, 0.9, 1.05, 0.95, 1, 1.02]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_zclip_ignores_nonfinite_norms(bad):
    ref, z = ZClip(ZClipConfig(warmup=5, max_grad_norm=100.0)), ZClip(ZClipConfig(warmup=5, max_grad_norm=100.0))
    for n in NORMS[:3]:
        ref.limit(n), z.limit(n)
    z.limit(bad)  # during warm-up
    for n in NORMS[3:]:
        ref.limit(n), z.limit(n)
    assert z.limit(bad) == 100.0  # after warm-up
    assert (z.mean, z.var, z.seen) == (ref.mean, ref.var, ref.seen)
    assert math.isfinite(z.mean) and z.limit(50.0) == ref.limit(50.0) < 2.0  # still clipping


def test_zclip_leaves_nonfinite_gradients_alone():
    z = ZClip(ZClipConfig(warmup=0))
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, math.nan, 2.0])
    norm, _ = z.clip_([p])
    assert math.isnan(norm) and z.mean is None and p.grad[0] == 1.0 and p.grad[2] == 2.0
