"""The Guard on loops that stray from the README's: a quarantine rule in one process, parameters
outside the guard's optimizer, a GradScaler, permanent memory faults under rollback, no loss,
ZClip across a rollback and on sparse gradients, parameter groups added mid-run, and step
numbers that skip."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.guard.guard import SOLO_QUARANTINE
from sdcscope.inject import Injector
from sdcscope.mitigate import ZClip, ZClipConfig


def batch_of(step: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=g) * scale, torch.randint(0, 4, (16,), generator=g)


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def guarded_step(guard, model, step, batch, *, loss_fn=ce, pass_loss=True, **kw) -> bool:
    guard.optimizer.zero_grad()
    with guard.step(step, batch):
        loss = loss_fn(model, batch)
        loss.backward()
    return guard.optimizer_step(loss if pass_loss else None, **kw)


def flip_once(module: nn.Module, when) -> None:
    """A transient fault: one output element of ``module`` corrupted once, when ``when()`` holds."""
    fired = []

    def hook(mod, args, out):
        if when() and not fired:
            fired.append(True)
            out = out.clone()
            out[3, 2] += 1000.0
            return out
    module.register_forward_hook(hook)


# -- 1. quarantine in a single process ----------------------------------------------------------------
def test_a_quarantine_rule_in_one_process_vetoes_the_step_and_says_why():
    """No other rank can carry on: the step is void, as under DDP, and the event says so."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    config = GuardConfig(policy={"rules": {"nonfinite:reproducible": ["quarantine", "skip_batch"]}})
    guard = Guard(model, opt, config, loss_fn=ce).attach()
    x, y = batch_of(0)
    x[0, 0] = math.nan
    before = params(model)
    assert not guarded_step(guard, model, 0, (x, y))
    assert same(before, params(model)) and guard.skip_batches == {0} and guard.discarded_steps == 1
    assert {e["action"] for e in guard.events} == {"veto, skip_batch"}
    assert all(e["evidence"]["quarantine"] == SOLO_QUARANTINE for e in guard.events)
    assert guarded_step(guard, model, 1, batch_of(1))   # and training goes on


# -- 2. a replay clears every gradient of the model ---------------------------------------------------
def test_a_reproducible_spike_stays_reproducible_when_the_optimizer_holds_only_the_head():
    """The backbone still requires grad but is not in the optimizer: a replay must not add its
    gradient to the first pass's (doubled, it looked like a transient fault and was applied)."""
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), 0.05)
    guard = Guard(model, opt, GuardConfig(), loss_fn=ce).attach()
    for step in range(4):
        model.zero_grad()
        assert guarded_step(guard, model, step, batch_of(step))
    model.zero_grad()
    bad = batch_of(4, scale=1e4)   # a gross outlier of the data: the same on every run
    assert not guarded_step(guard, model, 4, bad)
    assert {(e["detector"], e["verdict"], e["action"]) for e in guard.events} == {
        ("spike", "reproducible", "veto, skip_batch, lr_backoff")}   # the loss and the gradient norm
    left = model[0].weight.grad.clone()   # the veto clears the optimizer's gradients only
    model.zero_grad()
    ce(model, bad).backward()
    assert torch.equal(left, model[0].weight.grad)   # one backward's gradient, not two


def test_a_recomputed_step_gives_a_second_optimizer_the_clean_gradient():
    """A second optimizer (stepped in after_step, rolled back as ``stateful``) uses the gradients
    of the recomputed step, not the faulty pass's plus the replay's."""
    def run(fault: bool):
        model = mlp()
        opt = torch.optim.SGD(model[2].parameters(), 0.1)
        opt_body = torch.optim.SGD(model[0].parameters(), 0.1)
        guard = Guard(model, opt, GuardConfig(), loss_fn=ce, stateful=[opt_body]).attach()
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
    assert events == [] and {(e["step"], e["verdict"], e["action"]) for e in events_fault} == \
        {(3, "transient", "recompute")}
    assert same(clean, repaired)


# -- 3. GradScaler ----------------------------------------------------------------------------------------
def amp_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(batch[0]).float(), batch[1])


INIT_SCALE = 2.0 ** 24   # the first steps overflow in fp16: the scaler backs off


def amp_run(mode: str | None, fault_at: int | None = None, steps: int = 10):
    """``mode``: None (unguarded AMP), "loss_fn" or "step_fn"; returns (params, scales, guard)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

    def step_fn(m, batch):
        loss = amp_loss(m, batch)
        scaler.scale(loss).backward()
        return loss.detach()

    guard = None if mode is None else Guard(model, opt, GuardConfig(), scaler=scaler,
                                            **{mode: amp_loss if mode == "loss_fn" else step_fn}).attach()
    now = [None]
    if fault_at is not None:
        flip_once(model[2], lambda: now[0] == fault_at)
    scales = []
    for step in range(steps):
        now[0] = step
        batch = batch_of(step)
        opt.zero_grad()
        if guard is None:
            scaler.scale(amp_loss(model, batch)).backward()
            scaler.step(opt)
            scaler.update()
        else:
            with guard.step(step, batch):
                loss = amp_loss(model, batch)
                scaler.scale(loss).backward()
            guard.optimizer_step(loss)
        scales.append(scaler.get_scale())
    return params(model), scales, guard


@pytest.mark.parametrize("mode", ["loss_fn", "step_fn"])
def test_a_gradscaler_overflow_is_a_skipped_step_not_a_fault(mode):
    plain, plain_scales, _ = amp_run(None)
    got, scales, guard = amp_run(mode)
    assert plain_scales[0] < INIT_SCALE   # the run did overflow
    assert scales == plain_scales and same(plain, got)
    assert guard.events == [] and guard.discarded_steps == 0 and not guard.stalled


@pytest.mark.parametrize("mode", ["loss_fn", "step_fn"])
def test_a_transient_fault_under_a_gradscaler_is_recomputed_from_a_scaled_replay(mode):
    clean, clean_scales, _ = amp_run(mode)
    repaired, scales, guard = amp_run(mode, fault_at=7)
    assert {(e["step"], e["verdict"], e["action"]) for e in guard.events} == {(7, "transient", "recompute")}
    assert scales == clean_scales and same(clean, repaired)


def test_the_scaler_rolls_back_with_the_model_and_a_veto_lets_it_go_on():
    """A weight flip at step 6 rolls back to the snapshot of step 4, scale included (it grows
    every step here); a vetoed transient fault at step 8 still ends the scaler's step (the next
    one may unscale again)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    config = GuardConfig(snapshots={"every": 4}, policy={"rules": {"*:transient": ["veto"]}})
    guard = Guard(model, opt, config, loss_fn=amp_loss, scaler=scaler).attach()
    assert guard.stateful == [scaler]
    now, scale_at, step = [None], {}, 0
    flip_once(model[2], lambda: now[0] == 8)
    while step < 10:
        now[0] = step
        scale_at.setdefault(step, scaler.get_scale())
        if step == 6 and guard.rolled_back_to is None and not guard.events:
            with torch.no_grad():
                model[2].weight.view(-1).view(torch.int32)[0] ^= 1 << 22
        opt.zero_grad()
        with guard.step(step, batch_of(step)):
            loss = amp_loss(model, batch_of(step))
            scaler.scale(loss).backward()
        guard.optimizer_step(loss)
        if guard.rolled_back_to is not None:
            assert guard.rolled_back_to == 4 and scaler.get_scale() == scale_at[4] < scale_at[6]
            step = 4
            continue
        step += 1
    assert [(e["step"], e["verdict"], e["action"]) for e in guard.events] == [(6, "corrupt", "rollback"),
                                                                             (8, "transient", "veto")]


def test_the_scaler_is_checked():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        Guard(model, opt, scaler=object())
    guard = Guard(model, opt, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="plain loop's optimizer_step"):
        guard.callback()


def test_an_optimizer_the_guard_cannot_drive_is_refused_before_any_step():
    model = mlp()
    with pytest.raises(ValueError, match="cannot drive LBFGS: its step.closure. re-evaluates"):
        Guard(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        Guard(model, {"lr": 0.1})


# -- 4. a permanent memory fault under rollback ----------------------------------------------------------
def readme_loop(guard, model, inj, steps: int, cap: int) -> int:
    """The README's plain loop: go on from ``rolled_back_to``, stop when ``stalled``; returns the
    steps executed."""
    step = executed = 0
    while step < steps and executed < cap:
        executed += 1
        inj.set_position(step)
        ok = guarded_step(guard, model, step, batch_of(step))
        if guard.stalled:
            break
        step = guard.rolled_back_to if not ok and guard.rolled_back_to is not None else step + 1
    return executed


@pytest.mark.parametrize("site", ["weight", "optimizer_state"])
def test_a_permanent_memory_fault_stalls_the_guard_instead_of_rolling_back_forever(site):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    spec = FaultSpec(site=site, target="2", model="stuck_at_1", bits=[22], pattern={"kind": "element", "index": 3},
                     schedule={"kind": "permanent", "start": 3})
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(stall_after=10), loss_fn=ce).attach()
    executed = readme_loop(guard, model, inj, steps=20, cap=200)
    stalls = [e for e in guard.events if e["verdict"] == "stalled"]
    assert guard.stalled and executed < 30 and len(stalls) == 1
    assert stalls[0]["evidence"]["consecutive_discarded"] >= 10


def test_one_rollback_far_from_its_snapshot_is_a_repair_not_a_stall():
    """A transient weight flip 12 steps after the snapshot: the 12 steps run again, once."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    spec = FaultSpec(site="weight", target="2", model="bitflip", bits=[22], pattern={"kind": "element", "index": 3},
                     schedule={"kind": "transient", "step": 12})
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(stall_after=3), loss_fn=ce).attach()
    executed = readme_loop(guard, model, inj, steps=16, cap=100)
    assert [(e["detector"], e["action"]) for e in guard.events] == [("state_checksum", "rollback")]
    assert not guard.stalled and executed == 16 + 13


# -- 5. no loss given -------------------------------------------------------------------------------------
def test_without_a_loss_the_replay_compares_gradients_and_a_data_spike_stays_reproducible():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    guard = Guard(model, opt, GuardConfig(), loss_fn=ce).attach()
    for step in range(4):
        assert guarded_step(guard, model, step, batch_of(step), pass_loss=False)
    assert not guarded_step(guard, model, 4, batch_of(4, scale=1e4), pass_loss=False)
    [event] = guard.events
    assert (event["detector"], event["verdict"]) == ("spike", "reproducible") and guard.skip_batches == {4}
    assert event["evidence"]["replay"]["loss_first"] is None


# -- 6. the guard's own state rolls back with the model ----------------------------------------------------
def test_zclip_and_the_spike_windows_roll_back_with_the_model():
    """After a rollback the run goes on as if the fault never came: ZClip's statistics (which
    scale the gradients) and the spike detectors' windows are restored with the weights."""
    def run(fault: bool):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), 0.5)
        spec = FaultSpec(site="weight", target="0", model="bitflip", bits=[22],
                         pattern={"kind": "element", "index": 3}, schedule={"kind": "transient", "step": 9})
        inj = Injector(model, [spec] if fault else [], opt).attach()
        config = GuardConfig(zclip={"warmup": 2, "max_grad_norm": 10.0, "z_threshold": 0.3}, snapshots={"every": 4})
        guard = Guard(model, opt, config, loss_fn=ce).attach()
        readme_loop(guard, model, inj, steps=12, cap=40)
        return model, guard

    clean, golden = run(False)
    model, guard = run(True)
    assert [(e["step"], e["action"]) for e in guard.events] == [(9, "rollback")] and guard.rolled_back_to is None
    assert same(params(clean), params(model))
    assert (guard.zclip.mean, guard.zclip.var, guard.zclip.seen) == (golden.zclip.mean, golden.zclip.var,
                                                                     golden.zclip.seen)
    assert guard.loss_spike.seen == golden.loss_spike.seen == 12 and guard.grad_spike.seen == golden.grad_spike.seen


# -- 7. ZClip on sparse gradients; the guard's own errors do not hold snapshots back --------------------------
class SparseLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8, sparse=True), nn.Linear(8, 20)

    def forward(self, x):
        return self.head(self.emb(x))


def lm_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).reshape(-1, 20), batch[:, 1:].reshape(-1))


def test_zclip_clips_sparse_gradients():
    torch.manual_seed(0)
    model = SparseLM()
    opt = torch.optim.SGD(model.parameters(), 0.5)
    guard = Guard(model, opt, GuardConfig(zclip={"max_grad_norm": 0.01}, snapshots={"every": 3}),
                  loss_fn=lm_loss).attach()
    gen = torch.Generator().manual_seed(1)
    used = []

    def measure():
        used.append(math.sqrt(model.head.weight.grad.square().sum() + model.head.bias.grad.square().sum()
                              + model.emb.weight.grad.coalesce().values().square().sum()))
    for step in range(7):
        assert guarded_step(guard, model, step, torch.randint(0, 20, (4, 6), generator=gen), loss_fn=lm_loss,
                            before_step=measure)
    assert guard.events == [] and max(used) <= 0.01 + 1e-6
    assert guard.ring.latest().step == 6


def test_zclip_scales_a_sparse_gradient_in_place():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 2])).sum().backward()
    grad = emb.weight.grad
    norm, limit = ZClip(ZClipConfig(max_grad_norm=0.5)).clip_([emb.weight])
    assert norm == pytest.approx(math.sqrt(15.0)) and limit == 0.5   # rows 2·1 and 1·1, three columns
    assert emb.weight.grad is grad and grad.coalesce().values().norm().item() == pytest.approx(0.5, rel=1e-5)


def test_the_guards_own_errors_do_not_hold_its_snapshots_back(monkeypatch):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = Guard(model, opt, GuardConfig(zclip={}, snapshots={"every": 2}), loss_fn=ce).attach()

    def broken(*a, **kw):
        raise RuntimeError("zclip broke")
    monkeypatch.setattr(guard.zclip, "clip_", broken)
    for step in range(5):
        assert guarded_step(guard, model, step, batch_of(step))
    assert {e["verdict"] for e in guard.events} == {"internal_error"} and len(guard.events) == 5
    assert [s.step for s in guard.ring._ring] == [2, 4]


# -- 8. parameter groups added mid-run --------------------------------------------------------------------
def test_a_rollback_after_add_param_group_restores_a_snapshot_that_fits():
    """Progressive unfreezing: the guard snapshots when the optimizer's groups change, so the
    rollback target holds the new group's state."""
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[2].parameters(), 1e-2)
    spec = FaultSpec(site="weight", target="2", model="bitflip", bits=[22], pattern={"kind": "element", "index": 0},
                     schedule={"kind": "transient", "step": 6})
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(), loss_fn=ce).attach()
    step, rolled = 0, []
    while step < 8:
        if step == 3 and len(opt.param_groups) == 1:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
        inj.set_position(step)
        if not guarded_step(guard, model, step, batch_of(step)) and guard.rolled_back_to is not None:
            rolled.append(guard.rolled_back_to)
            step = guard.rolled_back_to
            continue
        step += 1
    assert rolled == [3] and [(e["detector"], e["action"]) for e in guard.events] == [("state_checksum", "rollback")]


def test_a_snapshot_that_no_longer_fits_is_reported_and_the_step_vetoed():
    """Groups added in the very step whose state is corrupt: no fresh snapshot of a corrupt
    state, and the old one does not fit -- an internal error and a veto, not a crash."""
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), 0.1)
    guard = Guard(model, opt, GuardConfig(), loss_fn=ce).attach()
    assert guarded_step(guard, model, 0, batch_of(0))
    opt.add_param_group({"params": list(model[0].parameters())})
    with torch.no_grad():
        model[2].weight.view(-1).view(torch.int32)[0] ^= 1 << 22
    before = params(model)
    assert not guarded_step(guard, model, 1, batch_of(1))
    assert same(before, params(model)) and len(opt.param_groups) == 2
    assert [(e["verdict"], e["evidence"].get("where")) for e in guard.events] == [("corrupt", None),
                                                                                 ("internal_error", "rollback")]
    assert "does not fit the optimizer" in guard.events[1]["evidence"]["error"]
    with pytest.raises(ValueError, match="does not fit the optimizer"):
        guard.ring.restore_latest(model, opt)


# -- 9. step numbers that skip or restart ---------------------------------------------------------------
@pytest.mark.parametrize("numbering", [lambda i: 4 * i, lambda i: i % 5])
def test_snapshots_follow_the_updates_whatever_the_step_numbers(numbering):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = Guard(model, opt, GuardConfig(snapshots={"every": 3, "keep": 2}), loss_fn=ce).attach()
    for i in range(10):
        assert guarded_step(guard, model, numbering(i), batch_of(i))
    assert [s.step for s in guard.ring._ring] == [numbering(6), numbering(9)]
