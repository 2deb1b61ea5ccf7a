"""The Guard in plain training loops: gradient clipping through ``before_step``, gradient
accumulation through ``step_fn``, policy rules merged over the defaults and validated, and a
non-scalar loss refused as a usage error."""

import tempfile

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    FAULT_STEP,
    ce,
    deep_mlp,
    guarded_train,
    loop_batch,
    make_loop,
    mlp,
    params,
    random_flip,
    same,
    weight_fault_run,
)
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector

STEPS, ACC = 6, 3


# -- 1. gradient clipping: before_step ------------------------------------------------------------
def clipped_run(guarded: bool, fault: bool, config: GuardConfig | None = None):
    model, opt, inj = make_loop(fault)
    calls = []

    def clip():
        calls.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())

    guard = (
        Guard(model, opt, config or GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
        if guarded
        else None
    )
    for step in range(STEPS):
        batch = loop_batch(step)
        opt.zero_grad()
        inj.set_position(step)
        if guard is None:
            ce(model, batch).backward()
            clip()
            opt.step()
            continue
        with guard.step(step, batch):
            loss = ce(model, batch)
            loss.backward()
        guard.optimizer_step(loss, before_step=clip)
    events = guard.events if guard else []
    if guard:
        guard.close()
    return params(model), events, calls


def test_clipping_in_before_step_survives_a_recompute():
    twin, _, twin_norms = clipped_run(False, False)
    got, events, norms = clipped_run(True, True)
    assert [(e["step"], e["detector"], e["verdict"], e["action"]) for e in events] == [
        (FAULT_STEP, "abft", "transient", "recompute")
    ]
    assert same(twin, got)  # the recomputed step was clipped like the clean twin's
    assert norms == twin_norms  # clip saw the recomputed gradients, once per applied step


def test_before_step_is_not_run_on_a_vetoed_step():
    config = GuardConfig(profile="full", policy={"rules": {"*:transient": ["veto"]}})
    _, events, norms = clipped_run(True, True, config)
    assert events[0]["action"] == "veto"
    assert len(norms) == STEPS - 1


def test_before_step_must_be_callable():
    model, opt, _ = make_loop(False)
    guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce).attach()
    before = params(model)
    with guard.step(0, loop_batch(0)):
        loss = ce(model, loop_batch(0))
        loss.backward()
    with pytest.raises(TypeError, match="before_step must be a callable.*got 1.0"):
        guard.optimizer_step(loss, before_step=1.0)
    assert same(before, params(model)) and guard.events == []
    guard.close()


# -- 2. gradient accumulation: step_fn ------------------------------------------------------------
def accum_run(guarded: bool, fault: bool):
    model, opt, inj = make_loop(fault, micro_batch=1)
    at = {"step": 0}

    def step_fn(m, micro_batches):
        total = 0.0
        for k, mb in enumerate(micro_batches):
            inj.set_position(at["step"], k)
            loss = ce(m, mb) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        return total

    guard = (
        Guard(model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), step_fn=step_fn).attach()
        if guarded
        else None
    )
    for step in range(STEPS):
        at["step"] = step
        mbs = [loop_batch(10 * step + k) for k in range(ACC)]
        opt.zero_grad()
        if guard is None:
            step_fn(model, mbs)
            opt.step()
            continue
        with guard.step(step, mbs):
            loss = step_fn(model, mbs)
        assert guard.optimizer_step(loss)
    events = guard.events if guard else []
    if guard:
        guard.close()
    return params(model), events


def test_step_fn_replays_every_micro_batch():
    twin, _ = accum_run(False, False)
    got, events = accum_run(True, True)
    assert [(e["step"], e["detector"], e["verdict"], e["action"]) for e in events] == [
        (FAULT_STEP, "abft", "transient", "recompute")
    ]
    assert same(twin, got)


def test_step_fn_and_loss_fn_are_exclusive_and_callable():
    model, opt, _ = make_loop(False)
    with pytest.raises(ValueError, match="loss_fn or step_fn, not both"):
        Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce, step_fn=lambda m, b: ce(m, b))
    with pytest.raises(TypeError, match="step_fn must be a callable or None, got 'train'"):
        Guard(model, opt, GuardConfig(profile="full"), step_fn="train")


@pytest.mark.parametrize("every, target", [(100, 0), (2, 2)])
def test_rollback_restores_the_loops_scheduler_with_the_model(every, target):
    """The first snapshot and the periodic ones (taken when their step begins, after the loop's
    ``scheduler.step()`` of the step before) hold the scheduler in step with the model."""
    model, opt, inj = make_loop(True, site="weight")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    guard = Guard(
        model,
        opt,
        GuardConfig(profile="full", snapshots={"every": every}),
        run_dir=tempfile.mkdtemp(),
        loss_fn=ce,
        stateful=[sched],
    ).attach()
    weight_fault_run(guard, model, opt, inj, stepped=sched.step, stop_at_rollback=True)
    assert [(e["detector"], e["action"]) for e in guard.events] == [("state_checksum", "rollback")]
    assert guard.rolled_back_to == target
    lr = 0.1 / (1 + target)
    assert sched.last_epoch == target and sched.get_last_lr() == [lr] and opt.param_groups[0]["lr"] == lr
    sched.step()  # the schedule goes on from the restored step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / (2 + target))


def test_stateful_items_need_state_dicts():
    model, opt, _ = make_loop(False)
    with pytest.raises(TypeError, match=r"stateful items need state_dict\(\) and load_state_dict\(\).*42"):
        Guard(model, opt, stateful=[42])


# -- 4. a non-scalar loss ---------------------------------------------------------------------------
def test_vector_loss_is_a_clear_usage_error_before_any_change():
    model, opt, _ = make_loop(False)
    guard = Guard(model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
    x, y = loop_batch(0)
    before = params(model)
    with guard.step(0, (x, y)):
        per = F.cross_entropy(model(x), y, reduction="none")
        per.mean().backward()
    msg = r"loss must be a scalar \(0-d or 1 element\), got shape \[8\]; reduce it"
    with pytest.raises(ValueError, match=msg):
        guard.optimizer_step(per)
    with pytest.raises(ValueError, match=msg):
        guard.session.decide(per, None)
    assert same(before, params(model)) and guard.events == []
    assert guard.optimizer_step(per.mean().reshape(1))  # one element is fine; the guard still works
    assert not same(before, params(model)) and guard.events == []
    guard.close()


def test_step_fn_returning_a_vector_fails_the_replay_not_the_run():
    model, opt, inj = make_loop(True)

    def step_fn(m, batch):  # per-sample losses: a usage error the replay reports
        per = F.cross_entropy(m(batch[0]), batch[1], reduction="none")
        per.mean().backward()
        return per.detach()

    guard = Guard(model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), step_fn=step_fn).attach()
    for step in range(FAULT_STEP + 1):
        opt.zero_grad()
        inj.set_position(step)
        with guard.step(step, loop_batch(step)):
            loss = step_fn(model, loop_batch(step)).mean()
        assert guard.optimizer_step(loss) == (step != FAULT_STEP)
    guard.close()
    (error,) = [e for e in guard.events if e["detector"] == "guard"]
    assert "step_fn's return value must be a scalar" in error["evidence"]["error"]
    assert [(e["detector"], e["verdict"], e["action"]) for e in guard.events if e["detector"] == "abft"] == [
        ("abft", "unverified", "veto")
    ]


@pytest.mark.parametrize("loss, error", [("1.5", TypeError), ([1.0, 2.0], ValueError)])
def test_loss_that_is_no_number_is_refused(loss, error):
    model, opt, _ = make_loop(False)
    guard = Guard(model, opt, GuardConfig(profile="full")).attach()
    with guard.step(0, loop_batch(0)):
        ce(model, loop_batch(0)).backward()
    with pytest.raises(error, match="loss must be a scalar"):
        guard.optimizer_step(loss)
    guard.close()


def test_events_file_exists_from_attach_on_a_clean_run(tmp_path):
    model, opt, _ = make_loop(False)
    guard = Guard(model, opt, GuardConfig(profile="full"), run_dir=tmp_path, loss_fn=ce).attach()
    for step in range(3):
        opt.zero_grad()
        with guard.step(step, loop_batch(step)):
            loss = ce(model, loop_batch(step))
            loss.backward()
        guard.optimizer_step(loss)
    guard.close()
    assert guard.events == [] and (tmp_path / "events.jsonl").read_text() == ""


def test_weight_edits_in_after_step_are_no_corruption(tmp_path):
    """WGAN-style weight clipping after the update: done in after_step, the state checksums take
    the clipped weights as the truth; done after optimizer_step, they flag them (as they must:
    the guard cannot tell an edit of the user's from a memory fault)."""

    def clip_weights():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)

    for inside in (True, False):
        model, opt, _ = make_loop(False)
        guard = Guard(model, opt, GuardConfig(profile="full"), loss_fn=ce).attach()
        for step in range(3):
            opt.zero_grad()
            with guard.step(step, loop_batch(step)):
                loss = ce(model, loop_batch(step))
                loss.backward()
            guard.optimizer_step(loss, after_step=clip_weights if inside else None)
            if not inside:
                with torch.no_grad():
                    clip_weights()
        flagged = {e["detector"] for e in guard.events}
        assert flagged == (set() if inside else {"state_checksum"}), guard.events
    with pytest.raises(TypeError, match="after_step must be a callable"):
        guard.optimizer_step(loss, after_step="clip")


# -- stall: a fault the guard cannot repair ---------------------------------------------------------
def test_a_plain_loop_learns_that_its_guard_discards_every_step(tmp_path):
    """A permanent fault the replay reproduces (a stuck exponent bit in a Linear's output) makes
    the guard discard every step: after ``stall_after`` of them in a row it reports one
    ``guard: stalled`` event and :attr:`Guard.stalled` tells the loop; an applied step ends it."""
    model, opt, _ = make_loop(False)
    spec = FaultSpec(
        site="gemm.forward",
        target="2",
        model="stuck_at_1",
        bits=(30,),
        pattern={"kind": "element", "index": [0, 0]},
        schedule={"kind": "permanent", "start": 0},
    )
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(model, opt, GuardConfig(profile="full", stall_after=3), run_dir=tmp_path, loss_fn=ce).attach()
    seen = []
    for step in range(5):
        batch = loop_batch(step)
        with guard.step(step, batch):
            loss = ce(model, batch)
            loss.backward()
        assert not guard.optimizer_step(loss)
        seen.append(guard.stalled)
    assert seen == [False, False, True, True, True] and guard.discarded_steps == 5
    stalls = [e for e in guard.events if e["verdict"] == "stalled"]
    assert [(e["detector"], e["step"], e["evidence"]["consecutive_discarded"]) for e in stalls] == [("guard", 2, 3)]
    inj.detach()
    batch = loop_batch(9)
    with guard.step(5, batch):
        loss = ce(model, batch)
        loss.backward()
    assert guard.optimizer_step(loss) and not guard.stalled and guard.discarded_steps == 5


def test_an_optimizer_the_guard_cannot_drive_is_refused_before_any_step():
    model = mlp()
    with pytest.raises(ValueError, match="cannot drive LBFGS: its step.closure. re-evaluates"):
        Guard(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got dict"):
        Guard(model, {"lr": 0.1})


def test_a_guard_used_without_attach_attaches_at_its_first_step():
    """``guard.step()`` on a guard never attached: ABFT's hooks (registered on attach) would be
    missing and every GEMM unchecked while the other detectors ran; the first step attaches."""
    torch.manual_seed(0)
    model = deep_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=ce)
    inj = Injector(model, [random_flip("gemm.forward", step=3, bit=30)], opt).attach()
    events = guarded_train(model, opt, guard, inj, 5)
    assert guard.abft.checks_run > 0
    assert [(s, d, m, g) for s, d, _, m, g, _ in events if d == "abft"] == [(3, "abft", "2", "forward")]
