"""Three ranks, one faulty device: only the faulty rank is quarantined, never a healthy peer that a
faulty replayer accused. Real worlds on gloo: the rank guard under a world finding (every rank a
candidate), and ``sdcscope train --nproc 3 --guard`` with a permanent forward-GEMM bit flip."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import cli_invoke, load_run
from sdcscope.detect import Event
from sdcscope.engine import param_sha256
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig

FAULT_STEP, STEPS = 1, 4
SCENARIOS = {
    # {rank: (its unit's kind, x scale)}: nothing of the rank's own notices; the all-reduced
    # gradient's spike at FAULT_STEP is a world finding, every rank a candidate
    "permanent2": {2: ("permanent", 2.0**20)},
    "permanent1": {1: ("permanent", 2.0**20)},
    "transient2": {2: ("transient", 2.0**20)},
    # two broken units, each rank's own ABFT says so, one suspicion makes a device faulty: two of
    # three ranks convicted at once leave no majority -- none quarantined, the run stops
    "two_at_once": {1: ("permanent", 2.0**20), 2: ("permanent", 2.0**12)},
}


def _data(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _world(rank: int, world: int, root) -> None:
    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for name, broken in SCENARIOS.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        now = {"step": 0, "replaying": False}
        kind, scale = broken.get(rank, (None, 1.0))

        def unit(module, args, out, now=now, kind=kind, scale=scale):  # this rank's unit, maybe broken
            fires = now["step"] >= FAULT_STEP if kind == "permanent" else now["step"] == FAULT_STEP
            if kind is not None and fires and (kind == "permanent" or not now["replaying"]):
                return out * scale
            return out

        net[2].register_forward_hook(unit)
        ddp = DDP(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        ledger = {"max_suspicions": 1} if len(broken) > 1 else {}
        guard = RankGuard(ddp, opt, run_dir=root / name, config=RankGuardConfig(hash_every=2, ledger=ledger))

        def replay(r: int, step: int) -> None:  # rank r's local gradient, on this device
            now["replaying"] = True
            for p in net.parameters():
                p.grad = None
            _loss(net, _data(r, step)).backward()
            now["replaying"] = False

        steps = []
        for step in range(STEPS):
            now["step"] = step
            guard.begin(step)
            opt.zero_grad(set_to_none=True)
            _loss(ddp, _data(rank, step)).backward()
            if len(broken) > 1:  # each broken unit's own check finds it
                found = [Event(step, "abft", "checksum_mismatch", module="2", gemm="forward", rank=rank)]
                local = found if kind is not None and step >= FAULT_STEP else []
            else:
                local = [Event(step, "spike", "spike", rank=rank, evidence={"signal": "grad_norm"})]
                local = local if step == FAULT_STEP else []
            guard.check(step, replay=lambda r: replay(r, step), local_events=local)
            if not guard.veto:
                opt.step()
            guard.end(step)
            steps.append({"veto": guard.veto, "quarantined": sorted(guard.quarantined)})
            if guard.stop:
                break
        guard.close()
        result = {"steps": steps, "stop": guard.stop, "devices": guard.devices, "hash": param_sha256(net)}
        (root / name / f"rank{rank}.json").write_text(json.dumps(result))


def _read(root, name):
    ranks = [json.loads((root / name / f"rank{r}.json").read_text()) for r in range(3)]
    events = [json.loads(line) for line in (root / name / "events.jsonl").read_text().splitlines()]
    ledger = json.loads((root / name / "ledger.json").read_text())["devices"]
    return ranks, events, ledger


def test_the_rank_guard_at_three_ranks_quarantines_only_the_faulty_rank_of_a_world_finding(tmp_path):
    spawn(_world, 3, (tmp_path,), timeout_s=180)

    for name, bad in (("permanent2", 2), ("permanent1", 1)):
        ranks, events, ledger = _read(tmp_path, name)
        healthy = [r for r in range(3) if r != bad]
        assert [s for s in ranks[0]["steps"]] == [s for s in ranks[1]["steps"]] == [s for s in ranks[2]["steps"]]
        assert [s["quarantined"] for s in ranks[0]["steps"]] == [[], [bad], [bad], [bad]], (name, events)
        assert ranks[0]["stop"] is None
        replays = {(e["verdict"], e["rank"]) for e in events if e["detector"] == "rank_replay"}
        assert replays == {("persistent", bad)}, (name, events)
        quarantines = [(e["verdict"], e["rank"]) for e in events if e["detector"] == "quarantine"]
        assert quarantines == [("quarantined", bad)], (name, events)
        assert not any(e["rank"] in healthy for e in events), (name, events)
        faulty = {entry["rank"] for entry in ledger.values() if entry["faulty"]}
        assert faulty == {bad}, (name, ledger)
        assert all(not ledger[ranks[0]["devices"][r]]["suspicions"] for r in healthy)
        assert ranks[healthy[0]]["hash"] == ranks[healthy[1]]["hash"]

    # a transient fault: rank 2 transient (a suspicion), nobody quarantined or accused besides it
    ranks, events, ledger = _read(tmp_path, "transient2")
    assert [s["quarantined"] for s in ranks[0]["steps"]] == [[], [], [], []]
    assert [s["veto"] for s in ranks[0]["steps"]] == [s == FAULT_STEP for s in range(STEPS)]
    assert {(e["verdict"], e["rank"]) for e in events if e["detector"] == "rank_replay"} == {("transient", 2)}
    assert not any(e["rank"] in (0, 1) for e in events) and not any(d["faulty"] for d in ledger.values())
    assert len({r["hash"] for r in ranks}) == 1

    # two faulty ranks of three at once: rank 0 is not accused; ranks 1 and 2 are faulty in the
    # ledger, but no majority is left to trust: none quarantined, the run stops
    ranks, events, ledger = _read(tmp_path, "two_at_once")
    assert [s["quarantined"] for s in ranks[0]["steps"]] == [[], []] and ranks[0]["steps"][-1]["veto"]
    assert ranks[0]["stop"].startswith("ambiguous fault between ranks 1 and 2 at step 1: the ledger calls 2 of 3")
    (stand_down,) = [e for e in events if e["detector"] == "quarantine"]
    assert (stand_down["verdict"], stand_down["action"], stand_down["evidence"]["suspects"]) == (
        "not_quarantined",
        "stop",
        [1, 2],
    )
    assert {(e["verdict"], e["rank"]) for e in events if e["detector"] == "rank_replay"} <= {
        ("unverified", 1),
        ("unverified", 2),
    }
    assert not any(e["rank"] == 0 and e["detector"] == "rank_replay" for e in events), events
    assert {entry["rank"] for entry in ledger.values() if entry["faulty"]} == {1, 2}
    assert not ledger[ranks[0]["devices"][0]]["suspicions"], ledger


# -- the command line: sdcscope train --nproc 3 --guard -----------------------------------------------


@pytest.mark.parametrize("bad", [2, 1])
def test_train_nproc_3_guard_quarantines_only_the_rank_of_a_permanent_forward_gemm_flip(tmp_path, bad):
    faults = tmp_path / "faults.yaml"
    faults.write_text(
        "- {site: gemm.forward, target: blocks.0.mlp.fc, model: bitflip, bits: [30],\n"
        f"   pattern: {{kind: element, index: 5}}, schedule: {{kind: permanent, start: 0}}, rank: {bad}}}\n"
    )
    out = tmp_path / "run"
    code, text = cli_invoke(
        "train", "--nproc", 3, "--guard", "--steps", 3, "--batch-size", 2, "--faults", faults, "--out", out,
        "--timeout", 60,
    )  # fmt: skip
    assert code == 0, text
    summary, events, metrics = load_run(tmp_path, "run")
    healthy = [r for r in range(3) if r != bad]
    assert summary["outcome"] == "completed" and summary["steps"] == 3

    # only the faulty rank quarantined, from the step of the fault on
    assert [m["quarantined"] for m in metrics] == [[bad]] * 3, events
    quarantines = [(e["verdict"], e["rank"]) for e in events if e["detector"] == "quarantine"]
    assert quarantines == [("quarantined", bad)], events
    assert {(e["verdict"], e["rank"]) for e in events if e["detector"] == "rank_replay"} == {("persistent", bad)}
    assert not any(e["rank"] in healthy for e in events), events

    # the two healthy ranks finish with identical parameters
    replicas = summary["replica_sha256"]
    assert replicas[healthy[0]] == replicas[healthy[1]] == summary["param_sha256"]

    # the ledger names the faulty rank's device alone
    ledger = json.loads((out / "ledger.json").read_text())["devices"]
    assert {entry["rank"] for entry in ledger.values() if entry["faulty"]} == {bad}, ledger
    assert all(not entry["suspicions"] for entry in ledger.values() if entry["rank"] in healthy), ledger
