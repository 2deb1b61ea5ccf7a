"""Persistent faults: repeats at one site become ``persistent`` through the device ledger, the policy
escalates instead of repairing forever, and every loop driving the guard stops, saying why."""

import json

import torch

from helpers import ce, learnable_batch, mlp
from sdcscope.engine import Run, TrainConfig
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.jobs.assemble import FaultyRun
from sdcscope.workloads import WorkloadConfig


def test_a_stuck_weight_bit_stops_the_engine_run_with_a_persistent_verdict_naming_the_element(tmp_path):
    """Before: roll back, the bit sticks again, roll back ... until 4x the step budget."""
    stuck = {
        "site": "weight",
        "target": "blocks.0.attn.q_proj.weight",
        "model": "stuck_at_1",
        "bits": [30],
        "pattern": {"kind": "element", "index": 21},
        "schedule": {"kind": "permanent", "start": 2},
    }
    workload = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000, eval_batches=1)
    run = Run(tmp_path / "run", workload, TrainConfig(seed=0))
    config = GuardConfig(snapshots={"every": 1}, metrics=None, stall_after=20)
    summary = FaultyRun(run, [FaultSpec.from_dict(stuck)], config).train(30)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    found = [e for e in events if e["detector"] == "state_checksum"]
    assert len(found) == config.ledger.strikes  # strikes - 1 rollbacks, then the verdict
    assert [e["verdict"] for e in found] == ["corrupt"] * (len(found) - 1) + ["persistent"]
    last = found[-1]
    assert last["action"] == "rollback, veto, stop" and last["evidence"]["elements"] == [21]
    assert last["evidence"]["ledger"]["site"] == "state:blocks.0.attn.q_proj.weight[21]"
    assert events[-1]["detector"] == "guard" and events[-1]["verdict"] == "stopped"
    assert summary["outcome"] == "stalled" and "persistent fault at state:" in summary["stop_reason"]
    assert summary["steps"] == 2 < 30  # stopped at the fault's step, within stall_after
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    (device,) = ledger["devices"].values()
    assert ledger["format"] == "sdcscope-ledger/2" and device["faulty"]
    assert device["sites"]["state:blocks.0.attn.q_proj.weight[21]"]["persistent"]


def test_a_recurring_gemm_fault_at_one_site_gets_fewer_than_strikes_recomputes(tmp_path):
    """An intermittent fault that a replay never meets: each finding alone is 'transient' (a
    recompute); at one site, the ledger stops recomputing after ``strikes`` findings."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "2",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": 5},
            "schedule": {"kind": "intermittent", "p": 1.0, "start": 1},
        }
    )
    inj = Injector(model, [spec], opt).attach()
    guard = Guard(
        model, opt, GuardConfig(profile="full", metrics=None, ledger={"strikes": 3}), run_dir=tmp_path, loss_fn=ce
    ).attach()
    for step in range(12):
        inj.set_position(step)
        opt.zero_grad()
        batch = learnable_batch(step)
        with guard.step(step, batch):
            loss = ce(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
        if guard.stopped:
            break
    abft = [e for e in guard.events if e["detector"] == "abft"]
    assert [e["action"] for e in abft] == ["recompute", "recompute", "veto, stop"]
    assert abft[-1]["verdict"] == "persistent" and abft[-1]["evidence"]["ledger"]["site"] == "abft:2:forward:col=1"
    assert step == 3 and guard.stopped and "abft:2:forward:col=1" in guard.stop_reason
    assert guard.state_verified  # every finding was repaired or its step discarded


def test_a_finding_let_through_taints_the_state_until_a_rollback_before_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = Guard(
        model,
        opt,
        GuardConfig(
            profile="full", metrics=None, snapshots={"every": 2}, policy={"rules": {"*:transient": ["report"]}}
        ),
        loss_fn=ce,
    ).attach()
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "2",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": 5},
            "schedule": {"kind": "transient", "step": 3},
        }
    )
    inj = Injector(model, [spec], opt).attach()
    verified = []
    for step in range(6):
        inj.set_position(step)
        opt.zero_grad()
        batch = learnable_batch(step)
        with guard.step(step, batch):
            loss = ce(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
        verified.append(guard.state_verified)
    assert verified == [True, True, True, False, False, False]  # let through at step 3; later snapshots hold it
    older, newer = list(guard.ring._ring)
    assert older.step <= 3 < newer.step
    guard.session.rolled_back(newer)
    assert not guard.state_verified
    guard.session.rolled_back(older)  # a rollback to a snapshot from before the finding
    assert guard.state_verified
