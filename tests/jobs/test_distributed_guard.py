"""The Guard under DDP (gloo on loopback): every rank runs its own detectors, the world takes one
decision; ``sdcscope train --nproc 2 --guard``; per-rank timelines in ``sdcscope report``."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from typer.testing import CliRunner

from helpers import at, event_keys, load_run, rank_flip
from sdcscope.cli import app
from sdcscope.detect import CrossRankDetector, Event
from sdcscope.engine import TrainConfig, param_sha256, read_jsonl
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.distrun import DistRun
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.workloads import WorkloadConfig

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000)


SCENARIOS = {
    2: {
        "clean": (6, []),
        # a forward GEMM output corrupted on rank 1 (x 2^8: below the cross-rank statistics): rank 1's
        # own ABFT check finds it, the verdict is shared, a replay calls it transient, both ranks veto
        "abft": (6, [rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(3), bit=26)]),
        # an Adam second moment flipped on rank 1: its state checksum fails, the replicas are compared
        # and restored on both ranks from the last verified state
        "adam": (7, [rank_flip("optimizer_state", "blocks.0.mlp.proj.weight", 1, at(2), state_key="exp_avg_sq")]),
    },
    3: {
        # a permanently broken unit on rank 2: caught (cross-rank and by rank 2's own ABFT), replayed as
        # persistent, quarantined; training goes on with ranks 0 and 1
        "permanent": (6, [rank_flip("gemm.grad_weight", "blocks.0.mlp.fc", 2, {"kind": "permanent", "start": 2})]),
        # the policy may quarantine at once: here every transient ABFT finding excludes its rank
        "policy": (
            4,
            [rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(1), bit=26)],
            {"policy": {"rules": {"abft:transient": ["quarantine"]}}},
        ),
    },
}


def _user_loop(rank: int, out) -> dict:
    """A user's own DDP script with the Guard's plain-loop API; rank 1's device corrupts one
    gradient element of step 3 before the all-reduce (a tensor hook: before DDP's bucket)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def data(r: int, step: int):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def loss_fn(model, batch):
        return F.mse_loss(model(batch[0]), batch[1])

    now = {"step": 0, "fired": False}

    def broken(grad):  # a transient fault: once, at step 3 (a replay computes it right)
        if rank == 1 and now["step"] == 3 and not now["fired"]:
            now["fired"] = True
            grad = grad.clone()
            grad.view(-1)[0] = 3.0e30
        return grad

    net[0].weight.register_hook(broken)
    ddp = DDP(net)
    guard = Guard(
        ddp, opt, GuardConfig(ranks={"hash_every": 2}), run_dir=out, loss_fn=loss_fn, rank_batch=data
    ).attach()
    stepped = []
    for step in range(6):
        now["step"] = step
        opt.zero_grad(set_to_none=True)
        with guard.step(step, data(rank, step)):
            loss = loss_fn(ddp, data(rank, step))
            loss.backward()
        stepped.append(guard.optimizer_step(loss))
    guard.close()
    return {"stepped": stepped, "hash": param_sha256(net)}


def _shared_findings(rank: int) -> list[list]:
    """Local findings as every rank receives them: one that only rank 1 made, one both made alike."""
    detector = CrossRankDetector(nn.Linear(4, 2))
    local = [Event(5, "spike", "spike", rank=rank, evidence={"value": 1.0})]
    if rank == 1:
        local.append(Event(5, "abft", "checksum_mismatch", module="fc", gemm="forward", index=(0, None)))
    return [[e.detector, e.rank, e.evidence.get("candidates"), e.index] for e in detector.check(5, local)]


def _world(rank: int, world: int, root) -> None:
    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for name, (steps, specs, *config) in SCENARIOS[world].items():
        run = DistRun(root / name, WORKLOAD, TrainConfig(seed=0), specs=[FaultSpec.from_dict(s) for s in specs])
        guard = Guard(
            run.trainer.model,
            run.trainer.optimizer,
            GuardConfig.from_dict({"profile": "full", **(config[0] if config else {})}),  # every GEMM checked
            ddp=run.trainer.ddp,
            run_dir=root / name,
        )
        run.train(steps, callbacks=[guard.callback()])
        guard.close()
    if world == 2:
        (root / f"loop.rank{rank}.json").write_text(json.dumps(_user_loop(rank, root / "loop")))
        (root / f"shared.rank{rank}.json").write_text(json.dumps(_shared_findings(rank)))


def test_guard_on_two_ranks_shares_abft_and_state_verdicts_and_stays_silent_when_clean(tmp_path):
    spawn(_world, 2, (tmp_path,), timeout_s=240)

    summary, events, metrics = load_run(tmp_path, "clean")
    assert summary["replicas_identical"] and summary["steps"] == 6
    assert events == [] and (tmp_path / "clean" / "events.jsonl").is_file()
    assert all(not m["skipped"] and m["quarantined"] == [] and m["events"] == 0 for m in metrics)
    assert not list((tmp_path / "clean").glob("events.rank*.jsonl"))
    ledger = json.loads((tmp_path / "clean" / "ledger.json").read_text())["devices"]
    assert len(ledger) == 2 and not any(d["suspicions"] for d in ledger.values())
    config = json.loads((tmp_path / "clean" / "config.json").read_text())
    assert config["world_size"] == 2

    # ABFT on rank 1 alone saw the fault; both ranks vetoed the step, the event names rank 1
    summary, events, metrics = load_run(tmp_path, "abft")
    assert summary["replicas_identical"]
    (abft,) = [e for e in events if e["detector"] == "abft"]
    assert (abft["step"], abft["rank"], abft["verdict"], abft["action"]) == (3, 1, "transient", "veto")
    assert abft["evidence"]["finding"] == "checksum_mismatch" and abft["module"] == "blocks.0.mlp.fc"
    assert abft["evidence"]["replay"]["ranks"] == {"1": "transient"}
    assert (3, "rank_replay", "transient", 1) in event_keys(events, "step", "detector", "verdict", "rank")
    assert {e["step"] for e in events} == {3} and all(e["rank"] is not None for e in events)
    assert [m["skipped"] for m in metrics] == [s == 3 for s in range(6)]

    # a desynchronized replica (Adam state on rank 1) is restored on both ranks; identical at the end
    summary, events, metrics = load_run(tmp_path, "adam")
    assert summary["replicas_identical"]
    found = event_keys(events, "detector", "verdict", "rank", "action")
    assert ("state_checksum", "corrupt", 1, "veto") in found
    (mismatch,) = [e for e in events if e["verdict"] == "replica_mismatch"]
    assert mismatch["action"] == "rollback" and "blocks.0.mlp.proj.weight" in mismatch["evidence"]["params"]
    assert mismatch["step"] <= 2 + GuardConfig().ranks.hash_every
    assert sum(m["skipped"] for m in metrics) == 1

    # a user's own loop: the pre-reduction corruption on rank 1 is attributed to rank 1 by a replay
    # of its batch (rank_batch), both ranks skip the step, replicas stay identical
    loops = [json.loads((tmp_path / f"loop.rank{r}.json").read_text()) for r in (0, 1)]
    assert loops[0]["stepped"] == loops[1]["stepped"] == [True, True, True, False, True, True]
    assert loops[0]["hash"] == loops[1]["hash"]
    events = read_jsonl(tmp_path / "loop" / "events.jsonl")
    found = event_keys(events, "step", "detector", "verdict", "rank")
    assert (3, "rank_replay", "transient", 1) in found and {e["step"] for e in events} == {3}
    assert all(e["action"] == "veto" for e in events)

    # findings travel with the rank that made them; one every rank made alike is about the world
    for r in (0, 1):
        assert json.loads((tmp_path / f"shared.rank{r}.json").read_text()) == [
            ["spike", None, [0, 1], None],
            ["abft", 1, None, [0, None]],
        ]


def test_guard_on_three_ranks_quarantines_a_permanent_fault_and_training_goes_on(tmp_path):
    spawn(_world, 3, (tmp_path,), timeout_s=240)
    summary, events, metrics = load_run(tmp_path, "permanent")
    assert summary["replicas_identical"] and len(summary["replica_sha256"]) == 3
    found = event_keys(events, "step", "detector", "verdict", "rank")
    assert (2, "rank_replay", "persistent", 2) in found
    assert (2, "quarantine", "quarantined", 2) in found
    assert {e["step"] for e in events} == {2} and all(e["rank"] == 2 for e in events if e["detector"] != "crossrank")
    assert [m["skipped"] for m in metrics] == [s == 2 for s in range(6)]
    assert all(m["quarantined"] == [2] for m in metrics[2:])
    assert summary["final_train_loss"] < metrics[0]["loss"]

    summary, events, metrics = load_run(tmp_path, "policy")
    assert summary["replicas_identical"]
    found = event_keys(events, "step", "detector", "verdict", "rank", "action")
    assert (1, "abft", "transient", 1, "quarantine, veto") in found
    assert (1, "quarantine", "quarantined", 1, "quarantine") in found
    assert [m["skipped"] for m in metrics] == [False, True, False, False]
    assert [m["quarantined"] for m in metrics] == [[], [1], [1], [1]]


def test_cli_train_nproc_2_guard_attributes_a_gradient_flip_to_rank_1_and_reports_per_rank_timelines(tmp_path):
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "- {site: param_grad, target: blocks.0.attn.q_proj.weight, model: bitflip, bits: [30],\n"
        "   pattern: {kind: element, index: 5}, schedule: {kind: transient, step: 2}, rank: 1}\n"
    )
    out = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "train",
            "--nproc",
            "2",
            "--guard",
            "--steps",
            "5",
            "--batch-size",
            "2",
            "--faults",
            str(faults),
            "--out",
            str(out),
            "--timeout",
            "60",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "guard: 2 event(s)" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas_identical"] and summary["steps"] == 5
    assert json.loads((out / "config.json").read_text())["guard"]["ranks"]["hash_every"] == 10
    events = read_jsonl(out / "events.jsonl")
    assert {(e["step"], e["detector"], e["verdict"], e["rank"]) for e in events} == {
        (2, "crossrank", "grad_outlier", None),
        (2, "rank_replay", "transient", 1),
    }
    assert [m["skipped"] for m in read_jsonl(out / "metrics.jsonl")] == [False, False, True, False, False]

    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "## Per-rank timelines" in md and "## Timeline of rank 1" in md
    row = next(line for line in md.splitlines() if line.startswith("| rank 1 |"))
    assert "rank_replay:transient ×1" in row and "veto ×1" in row
    assert "| 2 | fault | param_grad | blocks.0.attn.q_proj.weight |" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "per-rank timeline" in html
