"""Clean multi-rank training (gloo on loopback): deterministic, replicas identical, no events;
the torchrun entry point; a user's own loop with the plain RankGuard API."""

from __future__ import annotations

import json
import socket

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.detect.events import Event
from sdcscope.engine import TrainConfig, param_sha256, read_jsonl
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.distributed import NO_BUFFER_SYNC
from sdcscope.engine.distrun import DistRun
from sdcscope.faults import load_specs
from sdcscope.jobs import launch, make_job
from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000)
STEPS = 8


def _events(out) -> list[tuple]:
    return [(e["step"], e["detector"], e["verdict"], e["rank"]) for e in read_jsonl(out / "events.jsonl")]


def _plain_ddp_hash(rank: int, steps: int) -> str:
    """torch's own DDP (default comm hook) on the same shards, the engine's step recipe."""
    workload = make_workload(WORKLOAD)
    torch.manual_seed(1)
    model = workload.build_model()
    ddp, opt = DDP(model, **NO_BUFFER_SYNC), workload.build_optimizer(model)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        (workload.loss(ddp, workload.batch(1, step, rank)) / 1).backward()
        for group in opt.param_groups:
            group["lr"] = workload.lr_at(step)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), workload.config.grad_clip, foreach=True)
        opt.step()
    return param_sha256(model)


def _user_loop(rank: int, out) -> dict:
    """A user's script: own model, own data, RankGuard's plain-loop API; rank 1's own detector
    raises a local verdict at step 3, which every rank must see and veto."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = RankGuard(ddp, opt, run_dir=out, config=RankGuardConfig(hash_every=2))

    def data(r: int, step: int):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def replay(r: int, step: int) -> None:
        for p in net.parameters():
            p.grad = None
        x, y = data(r, step)
        F.mse_loss(net(x), y).backward()

    vetoed = []
    for step in range(6):
        guard.begin(step)
        opt.zero_grad(set_to_none=True)
        x, y = data(rank, step)
        F.mse_loss(ddp(x), y).backward()
        local = [Event(step, "abft", "checksum_mismatch", module="0", rank=rank)] if (rank, step) == (1, 3) else []
        guard.check(step, replay=lambda r: replay(r, step), local_events=local)
        if not guard.veto:
            opt.step()
        vetoed.append(guard.veto)
        guard.end(step)
    guard.close()
    return {"vetoed": vetoed, "hash": param_sha256(net)}


def _clean_world(rank: int, world: int, root) -> None:
    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for name in ("a", "b"):
        run = DistRun(root / name, WORKLOAD, TrainConfig(seed=1))
        guard = RankGuard(
            run.trainer.ddp, run.trainer.optimizer, run_dir=root / name, config=RankGuardConfig(hash_every=3)
        )
        run.train(STEPS, callbacks=[guard])
        guard.close()
    run = DistRun(root / "c", WORKLOAD, TrainConfig(seed=1))  # a later job, with the fleet's ledger
    guard = RankGuard(run.trainer.ddp, run.trainer.optimizer, run_dir=root / "c", ledger=root / "fleet.json")
    run.train(3, callbacks=[guard])
    guard.close()
    result = {"plain_ddp": _plain_ddp_hash(rank, STEPS), **_user_loop(rank, root / "loop")}
    (root / f"rank{rank}.json").write_text(json.dumps(result))


def test_clean_two_rank_runs_are_deterministic_identical_and_silent(tmp_path):
    bad_device = f"{socket.gethostname()}:cpu:1"  # rank 1's device, judged faulty by an earlier job
    (tmp_path / "fleet.json").write_text(
        json.dumps(
            {
                "format": "sdcscope-ledger/1",
                "devices": {
                    bad_device: {
                        "rank": 1,
                        "faulty": True,
                        "suspicions": [
                            {"step": 7, "detector": "rank_replay", "verdict": "persistent", "module": "head"}
                        ],
                    }
                },
            }
        )
    )
    spawn(_clean_world, 2, (tmp_path,), timeout_s=150)
    a, b = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("a", "b"))
    assert a["replicas_identical"] and a["world_size"] == 2 and a["steps"] == STEPS
    assert a["param_sha256"] == b["param_sha256"]  # rerun: bitwise identical
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plain_ddp"] == a["param_sha256"]  # the guarded hook averages exactly like DDP's
    for name in ("a", "b"):
        assert (tmp_path / name / "events.jsonl").read_text() == ""
        ledger = json.loads((tmp_path / name / "ledger.json").read_text())["devices"]
        assert len(ledger) == 2 and not any(d["suspicions"] or d["faulty"] for d in ledger.values())
    metrics = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(len(m["rank_loss"]) == 2 and not m["skipped"] and m["quarantined"] == [] for m in metrics)
    # the fleet ledger kept rank 1's device out of the later job from its first step
    assert _events(tmp_path / "c") == [(0, "quarantine", "quarantined", 1)]
    assert [m["quarantined"] for m in read_jsonl(tmp_path / "c" / "metrics.jsonl")] == [[1]] * 3
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["replicas_identical"]
    assert len(json.loads((tmp_path / "fleet.json").read_text())["devices"]) == 2
    # the user's own loop: rank 1's local verdict vetoed step 3 on both ranks, replicas stayed equal
    assert ranks[0]["vetoed"] == ranks[1]["vetoed"] == [False, False, False, True, False, False]
    assert ranks[0]["hash"] == ranks[1]["hash"]
    events = read_jsonl(tmp_path / "loop" / "events.jsonl")
    assert [(e["step"], e["detector"], e["rank"], e["action"]) for e in events][0] == (3, "abft", 1, "veto")
    assert any(e["detector"] == "rank_replay" and e["verdict"] == "correct_result" for e in events)


def test_torchrun_entry_point_trains_and_attributes_a_comm_fault(tmp_path):
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "- {site: comm, target: blocks.1.mlp.proj.weight, model: bitflip, bits: [30],\n"
        "   pattern: {kind: element, index: 5}, schedule: {kind: transient, step: 2}, rank: 1}\n"
    )
    out = tmp_path / "run"
    job = make_job(
        out,
        2,
        steps=5,
        workload=WorkloadConfig(batch_size=2, max_corpus_bytes=200_000),
        specs=load_specs(faults),
        dist_config=DistConfig(timeout_s=60),
        hash_every=2,
    )
    rc = launch(job, timeout_s=150)
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas_identical"] and summary["steps"] == 5
    (record,) = read_jsonl(out / "injections.jsonl")
    assert (record["rank"], record["site"], record["phase"], record["step"]) == (1, "comm", "before", 2)
    events = read_jsonl(out / "events.jsonl")
    assert {(e["step"], e["verdict"], e["rank"]) for e in events} == {(2, "grad_outlier", None), (2, "transient", 1)}
    assert [m["skipped"] for m in read_jsonl(out / "metrics.jsonl")] == [False, False, True, False, False]
