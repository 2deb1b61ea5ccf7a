"""The Guard's replay verdicts: a finding that vanishes on replay is transient and recomputed, a
reproducible one (a data spike) is skipped, with or without a loss, whatever the optimizer holds."""

from __future__ import annotations

import torch
from torch import nn

from helpers import ReluMLP, batch_of, ce, flip_once, guarded_step, mlp, params, same, spike_batch
from sdcscope.guard import Guard, GuardConfig

FAULT = 5


def test_a_checksum_mismatch_that_vanishes_on_replay_is_transient_even_when_masked():
    """A flip to a huge negative value that ReLU masks leaves loss and gradients unchanged: the
    replay then differs in nothing but the ABFT finding, which did not recur: a transient fault,
    recomputed (vetoing the step would make a harmless fault cost an update)."""
    torch.manual_seed(0)
    model = ReluMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    fired = []

    def flip(module, args, out):
        if not fired and guard.session.step == FAULT:
            fired.append(True)
            out = out.clone()
            out[0, 3] = -4e36
            return out

    events = []
    guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=loss_fn, on_event=events.append).attach()
    model.fc1.register_forward_hook(flip, prepend=True)
    stepped = []
    for step in range(FAULT + 2):
        batch = spike_batch(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        stepped.append(guard.optimizer_step(loss))
    assert all(stepped) and fired
    assert [(e["detector"], e["module"], e["gemm"], e["verdict"], e["action"]) for e in events] == [
        ("abft", "fc1", "forward", "transient", "recompute")
    ]


# -- 2. a replay clears every gradient of the model ---------------------------------------------------
def test_a_reproducible_spike_stays_reproducible_when_the_optimizer_holds_only_the_head():
    """The backbone still requires grad but is not in the optimizer: a replay must not add its
    gradient to the first pass's (doubled, it looked like a transient fault and was applied)."""
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), 0.05)
    guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce).attach()
    for step in range(4):
        model.zero_grad()
        assert guarded_step(guard, model, step, batch_of(step))
    model.zero_grad()
    bad = batch_of(4, scale=1e4)  # a gross outlier of the data: the same on every run
    assert not guarded_step(guard, model, 4, bad)
    assert {(e["detector"], e["verdict"], e["action"]) for e in guard.events} == {
        ("spike", "reproducible", "veto, skip_batch, lr_backoff")
    }  # the loss and the gradient norm
    left = model[0].weight.grad.clone()  # the veto clears the optimizer's gradients only
    model.zero_grad()
    ce(model, bad).backward()
    assert torch.equal(left, model[0].weight.grad)  # one backward's gradient, not two


def test_a_recomputed_step_gives_a_second_optimizer_the_clean_gradient():
    """A second optimizer (stepped in after_step, rolled back as ``stateful``) uses the gradients
    of the recomputed step, not the faulty pass's plus the replay's."""

    def run(fault: bool):
        model = mlp()
        opt = torch.optim.SGD(model[2].parameters(), 0.1)
        opt_body = torch.optim.SGD(model[0].parameters(), 0.1)
        guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce, stateful=[opt_body]).attach()
        now = [None]
        if fault:
            flip_once(model[2], lambda: now[0] == 3)
        for step in range(6):
            now[0] = step
            opt_body.zero_grad()
            assert guarded_step(guard, model, step, batch_of(step), after_step=opt_body.step)
        return params(model), guard.events

    clean, events = run(False)
    repaired, events_fault = run(True)
    assert events == [] and {(e["step"], e["verdict"], e["action"]) for e in events_fault} == {
        (3, "transient", "recompute")
    }
    assert same(clean, repaired)


# -- 5. no loss given -------------------------------------------------------------------------------------
def test_without_a_loss_the_replay_compares_gradients_and_a_data_spike_stays_reproducible():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce).attach()
    for step in range(4):
        assert guarded_step(guard, model, step, batch_of(step), pass_loss=False)
    assert not guarded_step(guard, model, 4, batch_of(4, scale=1e4), pass_loss=False)
    [event] = guard.events
    assert (event["detector"], event["verdict"]) == ("spike", "reproducible") and guard.skip_batches == {4}
    assert event["evidence"]["replay"]["loss_first"] is None
