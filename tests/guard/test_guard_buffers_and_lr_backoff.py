"""What the Guard puts back besides parameters and optimizer state: module buffers (BatchNorm statistics)
after a recompute, veto or rollback, in a plain loop and under the engine; and the LR back-off action, its
bounds, step numbers that restart, and the learning rate the metrics report."""

import math

import pytest
import torch
from torch import nn

from helpers import ReluMLP, ce, flip_once, spike_batch
from sdcscope.engine import TrainConfig, Trainer
from sdcscope.guard import Guard, GuardConfig
from sdcscope.mitigate import LRBackoff, LRBackoffConfig
from sdcscope.workloads import Workload, WorkloadConfig

FAULT = 5


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def plain_run(steps=10, fault=None, config=None, check=None, guarded=True):
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, config or GuardConfig(profile="full"), loss_fn=ce).attach() if guarded else None
    now = [None]
    if fault is not None:
        flip_once(model.fc1, lambda: now[0] == fault, index=(3, 4))
    for step in range(steps):
        now[0] = step
        batch = spike_batch(step)
        opt.zero_grad()
        before = buffers(model)
        if guard is None:
            ce(model, batch).backward()
            opt.step()
            continue
        with guard.step(step, batch):
            loss = ce(model, batch)
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

    plain_run(fault=FAULT, check=check, config=GuardConfig(profile="full", policy={"rules": {"*:transient": ["veto"]}}))
    assert vetoed == [FAULT]


def test_rollback_restores_buffers():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, GuardConfig(profile="full", snapshots={"every": 4}), loss_fn=ce).attach()
    saved = {}
    step = 0
    while step < 7:
        if step == 4:
            saved = buffers(model)
        if step == 6 and guard.rolled_back_to is None and not guard.events:
            with torch.no_grad():
                model.fc1.weight.view(-1).view(torch.int32)[7] ^= 1 << 30
        batch = spike_batch(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = ce(model, batch)
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
        return spike_batch(1000 * seed + step, bad=step == self.bad)

    def loss(self, model, batch):
        return ce(model, batch)

    def evaluate(self, model):
        return {}


def engine_run(guard_config=None, fault=None, bad=None, steps=10, net=BNNet):
    work = TinyWorkload(WorkloadConfig(workload="cnn", warmup=0, grad_clip=0.0))
    work.net, work.bad = net, bad
    trainer = Trainer(work, TrainConfig(seed=1))
    if fault is not None:
        flip_once(trainer.model.fc1, lambda: trainer.step == fault, index=(3, 4))
    guard = None
    if guard_config is not None:
        guard = Guard(trainer.model, trainer.optimizer, guard_config)
        trainer.add_callback(guard.callback())
    rows = [trainer.train_step() for _ in range(steps)]
    return trainer, guard, rows


def test_recompute_restores_buffers_engine():
    golden, _, _ = engine_run()
    trainer, guard, _ = engine_run(GuardConfig(profile="full"), fault=FAULT)
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
    flip_once(trainer.model.fc1, lambda: trainer.step == FAULT, index=(3, 4))
    guard = Guard(
        trainer.model, trainer.optimizer, GuardConfig(profile="full", policy={"rules": {"*:transient": ["veto"]}})
    )
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
    return GuardConfig(
        abft=None, grad_spike=None, loss_spike={"warmup": 8}, lr_backoff={"factor": 0.5, "recover_steps": 10}, **kw
    )


def test_epoch_restart_keeps_recovering_lr():
    """A per-epoch ``enumerate`` restarts the step at 0 after a backoff: the LR keeps recovering
    over the steps taken, stays positive and ends exactly at the base LR."""
    torch.manual_seed(0)
    model = ReluMLP()
    base = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=base)
    guard = Guard(model, opt, spike_config(), loss_fn=ce).attach()
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    for epoch in range(2):
        for step in range(20):
            batch = spike_batch(step, bad=epoch == 0 and step == 15)
            opt.zero_grad()
            with guard.step(step, batch):
                loss = ce(model, batch)
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
    model = ReluMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, spike_config(metrics={"update_ratio": source, "stats_every": 1}), loss_fn=ce).attach()
    sink = Rows()
    guard.metrics.sinks.append(sink)
    deltas = {}
    for step in range(20):
        batch = spike_batch(step, bad=step == 15)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = ce(model, batch)
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
    trainer, guard, rows = engine_run(spike_config(), bad=bad, steps=16, net=ReluMLP)
    assert [(e["step"], e["action"]) for e in guard.events] == [(bad, "veto, skip_batch, lr_backoff")]
    base = trainer.workload.config.lr
    assert rows[bad - 1]["lr"] == base
    assert guard.backoff.scale(bad + 1) < 1
    assert rows[bad + 1]["lr"] == pytest.approx(base * guard.backoff.scale(bad + 1))


# -- D: ZClip and non-finite norms ----------------------------------------------------------
NORMS = [1, 1.1, 0.9, 1.05, 0.95, 1, 1.02]
