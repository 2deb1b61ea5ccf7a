"""The Guard under conditions real loops create: module buffers, step numbers that restart,
LR backoff with metrics, non-finite gradient norms, and configs with wrongly typed values."""

import math

import pytest
import torch
from torch import nn

from sdcscope._validate import check_bool, check_float, check_non_negative, check_positive
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.guard import Guard, GuardConfig
from sdcscope.mitigate import LRBackoff, LRBackoffConfig, ZClip, ZClipConfig
from sdcscope.workloads import Workload, WorkloadConfig

FAULT = 5


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class MLP(nn.Module):  # no normalization: a garbage batch spikes the loss
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def batch_of(step: int, bad: bool = False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return (x * 1e4 if bad else x), y


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def transient_fault(module: nn.Module, when) -> None:
    """Corrupt one output element of ``module``'s forward once, when ``when()`` holds."""
    fired = []

    def hook(mod, args, out):
        if when() and not fired:
            fired.append(True)
            out = out.clone()
            out[3, 4] += 1000.0
            return out
    module.register_forward_hook(hook)


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def plain_run(steps=10, fault=None, config=None, check=None, guarded=True):
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, config or GuardConfig(), loss_fn=loss_fn).attach() if guarded else None
    now = [None]
    if fault is not None:
        transient_fault(model.fc1, lambda: now[0] == fault)
    for step in range(steps):
        now[0] = step
        batch = batch_of(step)
        opt.zero_grad()
        before = buffers(model)
        if guard is None:
            loss_fn(model, batch).backward()
            opt.step()
            continue
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        applied = guard.optimizer_step(loss)
        if check is not None:
            check(step, applied, before, model)
    return model, guard


# -- A: buffers -----------------------------------------------------------------------------
def test_recompute_restores_buffers_plain_loop():
    golden, _ = plain_run(guarded=False)
    model, guard = plain_run(fault=FAULT)
    (e,) = guard.events
    assert (e["step"], e["verdict"], e["action"]) == (FAULT, "transient", "recompute")
    for k, v in golden.state_dict().items():  # running stats and num_batches_tracked included
        assert torch.equal(v, model.state_dict()[k]), k
    assert int(model.bn.num_batches_tracked) == 10


def test_veto_restores_buffers_plain_loop():
    vetoed = []

    def check(step, applied, before, model):
        if not applied:
            vetoed.append(step)
            for k, v in buffers(model).items():
                assert torch.equal(v, before[k]), k

    plain_run(fault=FAULT, check=check, config=GuardConfig(policy={"rules": {"*:transient": ["veto"]}}))
    assert vetoed == [FAULT]


def test_rollback_restores_buffers():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, GuardConfig(snapshots={"every": 4}), loss_fn=loss_fn).attach()
    saved = {}
    step = 0
    while step < 7:
        if step == 4:
            saved = buffers(model)
        if step == 6 and guard.rolled_back_to is None and not guard.events:
            with torch.no_grad():
                model.fc1.weight.view(-1).view(torch.int32)[7] ^= 1 << 30
        batch = batch_of(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
        if guard.rolled_back_to is not None:
            assert guard.rolled_back_to == 4
            for k, v in buffers(model).items():
                assert torch.equal(v, saved[k]), k
            break
        step += 1
    assert [e["action"] for e in guard.events] == ["rollback"]


class TinyWorkload(Workload):
    """A tiny workload for the engine; data position ``bad`` holds a garbage batch."""

    net, bad = BNNet, None

    def build_model(self):
        return self.net()

    def batch(self, seed, step, micro_batch=0):
        return batch_of(1000 * seed + step, bad=step == self.bad)

    def loss(self, model, batch):
        return loss_fn(model, batch)

    def evaluate(self, model):
        return {}


def engine_run(guard_config=None, fault=None, bad=None, steps=10, net=BNNet):
    work = TinyWorkload(WorkloadConfig(workload="cnn", warmup=0, grad_clip=0.0))
    work.net, work.bad = net, bad
    trainer = Trainer(work, TrainConfig(seed=1))
    if fault is not None:
        transient_fault(trainer.model.fc1, lambda: trainer.step == fault)
    guard = None
    if guard_config is not None:
        guard = Guard(trainer.model, trainer.optimizer, guard_config)
        trainer.add_callback(guard.callback())
    rows = [trainer.train_step() for _ in range(steps)]
    return trainer, guard, rows


def test_recompute_restores_buffers_engine():
    golden, _, _ = engine_run()
    trainer, guard, _ = engine_run(GuardConfig(), fault=FAULT)
    (e,) = guard.events
    assert (e["step"], e["verdict"], e["action"]) == (FAULT, "transient", "recompute")
    for k, v in golden.model.state_dict().items():
        assert torch.equal(v, trainer.model.state_dict()[k]), k


def test_veto_restores_buffers_engine():
    class Check:
        def before_step(self, ctx):
            self.before = buffers(ctx.trainer.model)

        def after_step(self, ctx):
            if ctx.skip_update:
                self.vetoed = ctx.step
                for k, v in buffers(ctx.trainer.model).items():
                    assert torch.equal(v, self.before[k]), k

    trainer = Trainer(TinyWorkload(WorkloadConfig(workload="cnn", warmup=0, grad_clip=0.0)), TrainConfig(seed=1))
    transient_fault(trainer.model.fc1, lambda: trainer.step == FAULT)
    guard = Guard(trainer.model, trainer.optimizer, GuardConfig(policy={"rules": {"*:transient": ["veto"]}}))
    check = Check()
    trainer.add_callback(guard.callback())
    trainer.add_callback(check)
    for _ in range(FAULT + 2):
        trainer.train_step()
    assert check.vetoed == FAULT


# -- B: LR backoff with step numbers that go back -----------------------------------------
def test_lr_backoff_scale_stays_within_floor_and_one():
    b = LRBackoff(LRBackoffConfig(factor=0.5, recover_steps=10))
    b.trigger(55)
    assert b.scale(50) == 0.5 and b.scale(0) == 0.5  # before the trigger: the floor
    assert b.scale(60) == 0.75 and b.scale(65) == 1.0 and b.scale(10_000) == 1.0


def spike_config(**kw):
    return GuardConfig(abft=None, grad_spike=None, loss_spike={"warmup": 8},
                       lr_backoff={"factor": 0.5, "recover_steps": 10}, **kw)


def test_epoch_restart_keeps_recovering_lr():
    """A per-epoch ``enumerate`` restarts the step at 0 after a backoff: the LR keeps recovering
    over the steps taken, stays positive and ends exactly at the base LR."""
    torch.manual_seed(0)
    model = MLP()
    base = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=base)
    guard = Guard(model, opt, spike_config(), loss_fn=loss_fn).attach()
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    for epoch in range(2):
        for step in range(20):
            batch = batch_of(step, bad=epoch == 0 and step == 15)
            opt.zero_grad()
            with guard.step(step, batch):
                loss = loss_fn(model, batch)
                loss.backward()
            guard.optimizer_step(loss)
            assert opt.param_groups[0]["lr"] == base  # the base LR is never changed
    assert [(e["step"], e["action"]) for e in guard.events] == [(15, "veto, skip_batch, lr_backoff")]
    # 39 updates (step 15 of epoch 0 vetoed); the LR recovers over the 10 steps taken after it
    assert len(used) == 39 and all(0 < lr <= base for lr in used)
    assert used[15] == pytest.approx(base * 0.55)  # epoch 0, step 16
    assert used[19] == pytest.approx(base * 0.75)  # epoch 1, step 0
    assert used[24:] == [base] * 15


# -- C: metrics while the LR is backed off -------------------------------------------------
class Rows:
    def __init__(self):
        self.rows = {}

    def write(self, step, row):
        self.rows[step] = row

    def close(self):
        pass


@pytest.mark.parametrize("source", ["optimizer", "copy"])
def test_plain_loop_metrics_use_the_backed_off_lr(source):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, spike_config(metrics={"update_ratio": source, "stats_every": 1}),
                  loss_fn=loss_fn).attach()
    sink = Rows()
    guard.metrics.sinks.append(sink)
    deltas = {}
    for step in range(20):
        batch = batch_of(step, bad=step == 15)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        old = [p.detach().clone() for p in model.parameters()]
        guard.optimizer_step(loss)
        d = sum(float((p.detach() - o).pow(2).sum()) for p, o in zip(model.parameters(), old))
        n = sum(float(p.detach().pow(2).sum()) for p in model.parameters())
        deltas[step] = math.sqrt(d / n)
    assert 15 not in sink.rows and guard.backoff.scale(16) < 1
    for step in (16, 17):
        row = sink.rows[step]
        assert row["lr"] == pytest.approx(0.05 * guard.backoff.scale(step))
        assert row["update_ratio"] == pytest.approx(deltas[step], rel=1e-3)


def test_engine_logs_the_backed_off_lr():
    bad = 12
    trainer, guard, rows = engine_run(spike_config(), bad=bad, steps=16, net=MLP)
    assert [(e["step"], e["action"]) for e in guard.events] == [(bad, "veto, skip_batch, lr_backoff")]
    base = trainer.workload.config.lr
    assert rows[bad - 1]["lr"] == base
    assert guard.backoff.scale(bad + 1) < 1
    assert rows[bad + 1]["lr"] == pytest.approx(base * guard.backoff.scale(bad + 1))


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


# -- E: config validation --------------------------------------------------------------------
@pytest.mark.parametrize("data,needle", [
    ({"loss_spike": {"two_sided": "no"}}, "two_sided='no'.*allowed: true, false"),
    ({"grad_spike": {"log_space": "no"}}, "log_space='no'"),
    ({"state_checksum": {"optimizer_state": "no"}}, "optimizer_state='no'"),
    ({"nonfinite": {"check_grads": 1}}, "check_grads=1"),
    ({"metrics": {"cosines": "yes"}}, "cosines='yes'"),
    ({"ranks": {"quarantine": "off"}}, "quarantine='off'"),
    ({"qk_clip": True}, "qk_clip=True"),
    ({"strict": "false"}, "strict='false'"),
    ({"lr_backoff": {"factor": "half"}}, "factor='half'.*> 0.0 and < 1.0"),
    ({"lr_backoff": {"factor": True}}, "factor=True"),
    ({"lr_backoff": {"recover_steps": True}}, "recover_steps=True"),
    ({"zclip": {"alpha": "x"}}, "alpha='x'"),
    ({"zclip": {"z_threshold": "x"}}, "z_threshold='x'"),
    ({"zclip": {"max_grad_norm": -1}}, "max_grad_norm=-1.*> 0"),
    ({"loss_spike": {"alarm_z": True}}, "alarm_z=True"),
    ({"snapshots": {"keep": 2.0}}, "keep=2.0"),
    ({"policy": {"rules": {"abft:transient": 5}}}, "'abft:transient'.*5.*allowed: none, veto"),
    ({"policy": {"rules": {"abft:transient": None}}}, "'abft:transient'.*None"),
    ({"invariants": 5}, "invariants=5"),
])
def test_wrongly_typed_config_values_are_refused_by_name(data, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        GuardConfig.from_dict(data)


def test_config_booleans_and_numbers_accepted():
    c = GuardConfig.from_dict({"loss_spike": {"two_sided": True, "alarm_z": 6}, "qk_clip": 50,
                               "state_checksum": {"optimizer_state": False},
                               "policy": {"rules": {"abft:transient": ("recompute", "report")}}})
    assert c.loss_spike.two_sided is True and c.qk_clip == 50 and c.state_checksum.optimizer_state is False
    assert c.policy.actions_for("abft", "transient") == ["recompute", "report"]


@pytest.mark.parametrize("check,value", [
    (check_bool, "no"), (check_bool, 0), (check_bool, None),
    (check_positive, True), (check_positive, "3"), (check_non_negative, False), (check_non_negative, 1.0),
    (check_float, True), (check_float, "0.5"), (check_float, math.nan),
])
def test_validators_refuse_wrong_types_naming_key_and_value(check, value):
    with pytest.raises(ValueError, match=rf"^knob={value!r} must be"):
        check("knob", value)
    check("knob", True if check is check_bool else 1)  # a right value passes


def test_a_checksum_mismatch_that_vanishes_on_replay_is_transient_even_when_masked():
    """A flip to a huge negative value that ReLU masks leaves loss and gradients unchanged: the
    replay then differs in nothing but the ABFT finding, which did not recur: a transient fault,
    recomputed (vetoing the step would make a harmless fault cost an update)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    fired = []

    def flip(module, args, out):
        if not fired and guard._step == FAULT:
            fired.append(True)
            out = out.clone()
            out[0, 3] = -4e36
            return out
    events = []
    guard = Guard(model, opt, GuardConfig(), loss_fn=loss_fn, on_event=events.append).attach()
    model.fc1.register_forward_hook(flip, prepend=True)
    stepped = []
    for step in range(FAULT + 2):
        batch = batch_of(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            loss.backward()
        stepped.append(guard.optimizer_step(loss))
    assert all(stepped) and fired
    assert [(e["detector"], e["module"], e["gemm"], e["verdict"], e["action"]) for e in events] == [
        ("abft", "fc1", "forward", "transient", "recompute")]
