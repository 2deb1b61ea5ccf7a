"""The Guard under a GradScaler: an overflow is a skipped step, not a fault; a transient fault is
recomputed from a scaled replay; the scaler is checked and rolls back with the model."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

from helpers import batch_of, ce, deep_mlp, flip_once, guarded_train, mlp, params, random_flip, same
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector


# -- 3. GradScaler ----------------------------------------------------------------------------------------
def amp_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(batch[0]).float(), batch[1])


INIT_SCALE = 2.0**24  # the first steps overflow in fp16: the scaler backs off


def amp_run(mode: str | None, fault_at: int | None = None, steps: int = 10):
    """``mode``: None (unguarded AMP), "loss_fn" or "step_fn"; returns (params, scales, guard)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

    def step_fn(m, batch):
        loss = amp_loss(m, batch)
        scaler.scale(loss).backward()
        return loss.detach()

    guard = (
        None
        if mode is None
        else Guard(
            model, opt, GuardConfig(profile="full"), scaler=scaler, **{mode: amp_loss if mode == "loss_fn" else step_fn}
        ).attach()
    )
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
    assert plain_scales[0] < INIT_SCALE  # the run did overflow
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
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    config = GuardConfig(profile="full", snapshots={"every": 4}, policy={"rules": {"*:transient": ["veto"]}})
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
    assert [(e["step"], e["verdict"], e["action"]) for e in guard.events] == [
        (6, "corrupt", "rollback"),
        (8, "transient", "veto"),
    ]


def test_the_scaler_is_checked():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        Guard(model, opt, scaler=object())
    guard = Guard(model, opt, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="plain loop's optimizer_step"):
        guard.callback()


# -- 2. a fault whose huge value overflows downstream under a GradScaler ---------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_fault_that_overflows_downstream_under_a_gradscaler_is_found_and_recomputed(dtype):
    """A flip of dX's top exponent bit gives a finite, huge dX that overflows the gradients of the
    layers below: the guard took it for the scaler's own overflow and skipped the step without
    an event (and backed the scale off). ABFT's finite mismatch shows a fault: it is replayed
    and recomputed like any other; the scaler's natural overflows stay silent."""

    def amp_ce(model, batch):
        with torch.autocast("cpu", dtype=dtype):
            return ce(model, batch)

    def run(fault: bool):
        torch.manual_seed(0)
        model = deep_mlp()
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        inj = Injector(model, [random_flip("gemm.grad_input", step=5, bit=14)], opt).attach() if fault else None
        guard = Guard(
            model, opt, GuardConfig(profile="full"), run_dir=tempfile.mkdtemp(), loss_fn=amp_ce, scaler=scaler
        ).attach()
        events = guarded_train(model, opt, guard, inj, 7, loss_fn=amp_ce, scale=scaler.scale)
        guard.close()
        if inj is not None:
            (rec,) = inj.records
            assert abs(rec["after"][0]) > 1e4  # finite: the flip itself is no overflow
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), events, guard

    clean, clean_scale, clean_events, _ = run(False)
    got, scale, events, guard = run(True)
    assert clean_events == []
    assert (5, "abft", "transient", "2", "grad_input", "recompute") in events
    assert {e[0] for e in events} == {5} and {e[5] for e in events} == {"recompute"}
    assert guard.discarded_steps == 0 and scale == clean_scale
    assert all(torch.equal(a, b) for a, b in zip(clean, got))
