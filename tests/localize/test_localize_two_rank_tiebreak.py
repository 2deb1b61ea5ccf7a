"""Two replicas, each the other's only peer: a faulty replayer accuses its healthy peer as surely as a
healthy one accuses a faulty peer. Rank-local evidence decides first, a doubtful peer's accusation
does not count, and two clean replicas accusing each other are quarantined by no one: the run
stops with both named as suspects in the ledger."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdcscope.common.io import read_jsonl
from sdcscope.detect import Event
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.guard import Guard, GuardConfig
from sdcscope.localize.ranks import own_evidence, settle_two_replicas
from sdcscope.mitigate.quarantine import RankGuard, RankGuardConfig


def replay_verdict(rank: int, verdict: str, *, reproduces: bool = True) -> Event:
    """A verdict as :meth:`RankLocalizer.diagnose` reports it for ``rank``, replayed on its peer."""
    return Event(4, "rank_replay", verdict, rank=rank, evidence={"peer": 1 - rank, "self_reproduces": reproduces})


def settled(verdicts: dict[int, tuple[str, bool]], own: dict[int, list[str]]) -> dict[int, str]:
    events = [replay_verdict(r, v, reproduces=rep) for r, (v, rep) in verdicts.items()]
    return {e.rank: e.verdict for e in settle_two_replicas(events, own)}


ABFT_ON_1 = {1: ["abft: checksum_mismatch in fc"]}


def test_a_permanent_fault_with_its_own_abft_finding_is_blamed_and_its_accusation_of_the_peer_dropped():
    # each rank's replay of the other disagrees and each reproduces itself: only rank 1's own
    # checksum speaks, so rank 1's replay of rank 0 is no evidence
    events = [replay_verdict(0, "persistent"), replay_verdict(1, "persistent")]
    settle_two_replicas(events, ABFT_ON_1)
    assert [(e.rank, e.verdict) for e in events] == [(0, "cleared"), (1, "persistent")]
    assert events[0].evidence["peer_in_doubt"] == ABFT_ON_1[1] and events[0].evidence["replay_verdict"] == "persistent"
    assert events[1].evidence["own_evidence"] == ABFT_ON_1[1] and "peer_in_doubt" not in events[1].evidence


def test_two_clean_replicas_accusing_each_other_are_ambiguous():
    assert settled({0: ("persistent", True), 1: ("persistent", True)}, {}) == {0: "ambiguous", 1: "ambiguous"}


def test_a_replica_that_does_not_reproduce_itself_is_in_doubt_without_any_detector():
    # a transient fault on rank 1: rank 1's replay of rank 0 agrees (it still counts: two devices
    # computed the same bits), rank 0's replay of rank 1 disagrees and rank 1 does not repeat it
    assert settled({0: ("correct_result", True), 1: ("transient", False)}, {}) == {
        0: "correct_result",
        1: "transient",
    }
    # the same, had rank 1's flawed replay disagreed with rank 0: its accusation does not count
    assert settled({0: ("persistent", True), 1: ("transient", False)}, {}) == {0: "cleared", 1: "transient"}


def test_both_replicas_in_doubt_of_their_own_leave_no_trusted_replay():
    both = {0: ["nonfinite: nonfinite in fc"], 1: ABFT_ON_1[1]}
    assert settled({0: ("persistent", True), 1: ("persistent", True)}, both) == {0: "unverified", 1: "unverified"}
    assert settled({0: ("persistent", True), 1: ("transient", False)}, both) == {0: "unverified", 1: "transient"}


def test_only_peer_free_findings_of_a_rank_on_its_own_computation_count_as_its_evidence():
    events = [
        Event(4, "crossrank", "grad_outlier", evidence={"candidates": [0, 1]}),  # symmetric at two ranks
        Event(4, "abft", "checksum_mismatch", module="fc", rank=1),
        Event(4, "spike", "spike", rank=0),  # its own loss: the data may do that
        Event(4, "crossrank", "nonfinite", module="fc", rank=0),  # its own gradient, before the reduction
        Event(4, "nonfinite", "nonfinite", module="fc", evidence={"candidates": [0, 1]}),  # about the world
    ]
    assert own_evidence(events) == {0: ["crossrank: nonfinite in fc"], 1: ["abft: checksum_mismatch in fc"]}


# -- the real rank guard, 2 processes on gloo -------------------------------------------------

FAULT_STEP, STEPS = 2, 4
SCENARIOS = {
    # rank 1's device computes the output layer wrong from FAULT_STEP on, every time it runs it (its
    # own steps and every replay it makes), and its ABFT check says so
    "own": ("permanent", True),
    # the same device, but nothing of its own notices (e.g. the layer was not sampled)
    "silent": ("permanent", False),
    # one wrong forward on rank 1 at FAULT_STEP; its replays are right
    "transient": ("transient", False),
    # the silent permanent fault under the full Guard (its plain-loop API, ABFT off)
    "guard": ("permanent", False),
}


def _data(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _guarded(rank: int, ddp: DDP, opt, out, now: dict) -> dict:
    guard = Guard(ddp, opt, GuardConfig(abft=None), run_dir=out, loss_fn=_loss, rank_batch=_data).attach()
    stepped = []
    for step in range(STEPS):
        now["step"] = step
        opt.zero_grad(set_to_none=True)
        with guard.step(step, _data(rank, step)):
            loss = _loss(ddp, _data(rank, step))
            loss.backward()
        stepped.append(guard.optimizer_step(loss))
        if guard.stopped:
            break
    guard.close()
    return {"stepped": stepped, "stop": guard.stop_reason, "quarantined": guard.ranks.quarantined}


def _world(rank: int, world: int, root) -> None:
    torch.set_num_threads(1)
    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for name, (kind, noticed) in SCENARIOS.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        now = {"step": 0, "replaying": False}

        def device(module, args, out, now=now, kind=kind):  # rank 1's broken unit
            fires = now["step"] >= FAULT_STEP if kind == "permanent" else now["step"] == FAULT_STEP
            if rank == 1 and fires and (kind == "permanent" or not now["replaying"]):
                return out * 2.0**20
            return out

        net[2].register_forward_hook(device)
        ddp = DDP(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        if name == "guard":
            (root / name / f"rank{rank}.json").write_text(json.dumps(_guarded(rank, ddp, opt, root / name, now)))
            continue
        guard = RankGuard(ddp, opt, run_dir=root / name, config=RankGuardConfig(hash_every=2))

        def replay(r: int, step: int) -> None:  # rank r's local gradient, on this device, no collective
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
            found = rank == 1 and noticed and step >= FAULT_STEP
            local = [Event(step, "abft", "checksum_mismatch", module="2", gemm="forward", rank=rank)] if found else []
            guard.check(step, replay=lambda r: replay(r, step), local_events=local)
            if not guard.veto:
                opt.step()
            guard.end(step)
            steps.append({"veto": guard.veto, "quarantined": sorted(guard.quarantined)})
            if guard.stop:
                break
        guard.close()
        result = {"steps": steps, "stop": guard.stop, "devices": guard.devices}
        (root / name / f"rank{rank}.json").write_text(json.dumps(result))


def test_the_rank_guard_blames_the_rank_with_evidence_and_quarantines_no_rank_it_cannot_tell_apart(tmp_path):
    spawn(_world, 2, (tmp_path,), timeout_s=150)

    def run(name):
        ranks = [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0] == ranks[1]  # one world decision
        events = read_jsonl(tmp_path / name / "events.jsonl")
        ledger = json.loads((tmp_path / name / "ledger.json").read_text())["devices"]
        return ranks[0], {(e["detector"], e["verdict"], e["rank"]) for e in events}, events, ledger

    # rank 1's own evidence decides: rank 1 persistent and quarantined, healthy rank 0 not accused
    result, found, events, ledger = run("own")
    assert ("rank_replay", "persistent", 1) in found and ("quarantine", "quarantined", 1) in found
    assert not any(e["rank"] == 0 for e in events) and result["stop"] is None
    assert [s["quarantined"] for s in result["steps"]] == [[], [], [1], [1]]
    assert not ledger[result["devices"][0]]["suspicions"] and ledger[result["devices"][1]]["faulty"]

    # no rank-local evidence: the two accuse each other; neither is quarantined, the run stops
    result, found, events, ledger = run("silent")
    assert ("rank_replay", "ambiguous", 0) in found and ("rank_replay", "ambiguous", 1) in found
    (stand_down,) = [e for e in events if e["detector"] == "quarantine"]
    assert (stand_down["verdict"], stand_down["action"], stand_down["evidence"]["suspects"]) == (
        "not_quarantined",
        "stop",
        [0, 1],
    )
    assert result["stop"].startswith("ambiguous fault between ranks 0 and 1 at step 2")
    assert [s["quarantined"] for s in result["steps"]] == [[], [], []] and result["steps"][-1]["veto"]
    for dev in result["devices"]:  # both named as suspects in the ledger, neither called faulty
        assert not ledger[dev]["faulty"] and [s["verdict"] for s in ledger[dev]["suspicions"]] == ["ambiguous"]

    # a transient fault: rank 1's correct replay of rank 0 clears it, rank 1 is transient
    result, found, events, ledger = run("transient")
    assert ("rank_replay", "transient", 1) in found and all(e["rank"] in (1, None) for e in events)
    assert result["stop"] is None and [s["veto"] for s in result["steps"]] == [s == FAULT_STEP for s in range(STEPS)]

    # the same under the Guard: the step is vetoed, no rank quarantined, the guard stops with the reason
    result, found, events, ledger = run("guard")
    assert ("rank_replay", "ambiguous", 0) in found and ("rank_replay", "ambiguous", 1) in found
    assert ("quarantine", "not_quarantined", None) in found and ("guard", "stopped", None) in found
    assert result["stepped"] == [True, True, False] and result["quarantined"] == []
    assert result["stop"].startswith("ambiguous fault between ranks 0 and 1 at step 2")
    assert not any(d["faulty"] for d in ledger.values())
