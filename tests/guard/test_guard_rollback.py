"""The Guard's rollback to snapshots: permanent memory faults stall instead of rolling back forever,
ZClip and spike windows roll back with the model, param groups added mid-run, step numbers that skip,
and snapshots taken even when the guard's own checks fail."""

from __future__ import annotations

import pytest
import torch

from helpers import batch_of, ce, guarded_step, mlp, params, same
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector


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
    spec = FaultSpec(
        site=site,
        target="2",
        model="stuck_at_1",
        bits=[22],
        pattern={"kind": "element", "index": 3},
        schedule={"kind": "permanent", "start": 3},
    )
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
    spec = FaultSpec(
        site="weight",
        target="2",
        model="bitflip",
        bits=[22],
        pattern={"kind": "element", "index": 3},
        schedule={"kind": "transient", "step": 12},
    )
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(stall_after=3, snapshots={"every": 50}), loss_fn=ce).attach()
    executed = readme_loop(guard, model, inj, steps=16, cap=100)
    assert [(e["detector"], e["action"]) for e in guard.events] == [("state_checksum", "rollback")]
    assert not guard.stalled and executed == 16 + 13


# -- 6. the guard's own state rolls back with the model ----------------------------------------------------
def test_zclip_and_the_spike_windows_roll_back_with_the_model():
    """After a rollback the run goes on as if the fault never came: ZClip's statistics (which
    scale the gradients) and the spike detectors' windows are restored with the weights."""

    def run(fault: bool):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), 0.5)
        spec = FaultSpec(
            site="weight",
            target="0",
            model="bitflip",
            bits=[22],
            pattern={"kind": "element", "index": 3},
            schedule={"kind": "transient", "step": 9},
        )
        inj = Injector(model, [spec] if fault else [], opt).attach()
        config = GuardConfig(zclip={"warmup": 2, "max_grad_norm": 10.0, "z_threshold": 0.3}, snapshots={"every": 4})
        guard = Guard(model, opt, config, loss_fn=ce).attach()
        readme_loop(guard, model, inj, steps=12, cap=40)
        return model, guard

    clean, golden = run(False)
    model, guard = run(True)
    assert [(e["step"], e["action"]) for e in guard.events] == [(9, "rollback")] and guard.rolled_back_to is None
    assert same(params(clean), params(model))
    assert (guard.zclip.mean, guard.zclip.var, guard.zclip.seen) == (
        golden.zclip.mean,
        golden.zclip.var,
        golden.zclip.seen,
    )
    assert guard.loss_spike.seen == golden.loss_spike.seen == 12 and guard.grad_spike.seen == golden.grad_spike.seen


# -- 8. parameter groups added mid-run --------------------------------------------------------------------
def test_a_rollback_after_add_param_group_restores_a_snapshot_that_fits():
    """Progressive unfreezing: the guard snapshots when the optimizer's groups change, so the
    rollback target holds the new group's state."""
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[2].parameters(), 1e-2)
    spec = FaultSpec(
        site="weight",
        target="2",
        model="bitflip",
        bits=[22],
        pattern={"kind": "element", "index": 0},
        schedule={"kind": "transient", "step": 6},
    )
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
    # the event is written after its action: the failed rollback's report first, then the finding
    # with what was done (the veto behind the rollback)
    assert [(e["verdict"], e["evidence"].get("where"), e["action"]) for e in guard.events] == [
        ("internal_error", "rollback", "report"),
        ("corrupt", None, "veto"),
    ]
    assert "does not fit the optimizer" in guard.events[0]["evidence"]["error"]
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
