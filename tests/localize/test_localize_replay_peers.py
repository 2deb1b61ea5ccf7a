"""Who replays a suspect rank's step, and what the replays convict, without processes.

A replay partner is never a suspect while a rank free of suspicion is left; at three or more
healthy ranks a suspect is convicted only when two peers without evidence against themselves agree
with each other and not with what it sent (a majority), so a faulty peer cannot convict a healthy
rank. The world here is simulated in one process: ``RankLocalizer.diagnose`` runs once per rank,
the one gather it makes served from every rank's row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sdcscope.localize.ranks as ranks
from sdcscope.detect.signatures import Gathered
from sdcscope.localize.ranks import RankLocalizer, Replays, judge_replays, replay_peers

# -- the partner-choice rule ---------------------------------------------------------------------


def test_a_replay_partner_is_never_a_suspect_while_a_rank_free_of_suspicion_is_left():
    # the next healthy rank after 1 is 2, a suspect: the peers are the non-suspects after 1, cyclically
    assert replay_peers(1, [0, 1, 2, 3], suspects=[1, 2]) == [3, 0]
    assert replay_peers(2, [0, 1, 2, 3], suspects=[1, 2]) == [3, 0]
    assert replay_peers(1, [0, 1, 2, 3, 4], suspects=[1]) == [2, 3]


def test_quarantined_ranks_replay_nothing_and_two_peers_replay_at_three_or_more_healthy_ranks():
    assert replay_peers(0, [0, 2, 3], suspects=[0]) == [2, 3]  # rank 1 quarantined
    assert replay_peers(3, [0, 1, 3], suspects=[3]) == [0, 1]
    assert replay_peers(0, [0, 1], suspects=[0]) == [1]  # two replicas: the other one, the only peer
    assert replay_peers(0, [0, 1], suspects=[0, 1]) == [1]
    assert replay_peers(0, [0], suspects=[0]) == []  # alone: no peer (verdict unverified)


def test_when_every_other_rank_is_a_suspect_the_least_doubtful_peers_replay():
    # a world finding: every rank a candidate; a rank with evidence against itself replays last
    assert replay_peers(2, [0, 1, 2], suspects=[0, 1, 2]) == [0, 1]
    assert replay_peers(0, [0, 1, 2], suspects=[0, 1, 2]) == [1, 2]
    assert replay_peers(0, [0, 1, 2, 3], suspects=[0, 1, 2, 3], in_doubt=[1]) == [2, 3]
    assert replay_peers(2, [0, 1, 2, 3], suspects=[0, 1, 2, 3], in_doubt=[3]) == [0, 1]


def test_replay_peers_refuses_a_suspect_outside_the_healthy_ranks():
    with pytest.raises(ValueError, match="rank 5 is not among the healthy ranks"):
        replay_peers(5, [0, 1, 2])


# -- the verdict rule ----------------------------------------------------------------------------


def facts(suspect, peers, reproduces, agree=None, self_reproduces=True):
    return Replays(suspect, tuple(peers), tuple(reproduces), agree, self_reproduces)


@pytest.mark.parametrize(
    ("replays", "doubt", "verdict"),
    [
        # a peer computes the same bits as the suspect: the data, not the device
        (facts(1, [0, 2], [True, False], agree=False), {}, "correct_result"),
        (facts(1, [2, 0], [False, True], agree=False), {2: ["abft"]}, "correct_result"),
        # two peers free of doubt agree, the suspect sent something else and repeats it
        (facts(2, [0, 1], [False, False], agree=True), {}, "persistent"),
        # ... and does not repeat it
        (facts(2, [0, 1], [False, False], agree=True, self_reproduces=False), {}, "transient"),
        # two peers that agree but one of them is in doubt: no majority of peers free of doubt;
        # the clean one's disagreement is a suspicion
        (facts(0, [1, 2], [False, False], agree=True), {2: ["abft"]}, "unverified"),
        # accused only by peers in doubt, nothing of its own against it
        (facts(0, [1, 2], [False, False], agree=True), {1: ["abft"], 2: ["abft"]}, "cleared"),
        # a suspect accused only by doubtful peers, but with evidence of its own
        (facts(0, [1, 2], [False, False], agree=True), {0: ["abft"], 1: ["abft"], 2: ["abft"]}, "unverified"),
        # one clean peer disagrees, the other is in doubt: a suspicion, no conviction
        (facts(1, [0, 2], [False, False], agree=False), {2: ["nonfinite"]}, "unverified"),
        # two clean peers that disagree with each other and with the suspect: no majority
        (facts(1, [2, 3], [False, False], agree=False), {}, "unverified"),
        # its own replay does not reproduce what it sent: transient without any peer's word
        (facts(1, [2, 3], [False, False], agree=False, self_reproduces=False), {}, "transient"),
        # two replicas: the table as it stands (settle_two_replicas re-judges it)
        (facts(1, [0], [False]), {}, "persistent"),
        (facts(1, [0], [False], self_reproduces=False), {}, "transient"),
        (facts(1, [0], [True]), {}, "correct_result"),
        (facts(1, [], []), {}, "unverified"),
    ],
)
def test_a_suspect_is_convicted_only_by_two_peers_free_of_doubt_that_agree(replays, doubt, verdict):
    got, reason = judge_replays(replays, doubt)
    assert got == verdict, reason
    assert reason


# -- the localizer in a simulated world ----------------------------------------------------------

BATCH = {r: torch.linspace(-1.0, 1.0, 8).view(2, 4) * (r + 1) + 0.25 * r for r in range(4)}


class _Gathered(Exception):
    pass


def device(faulty: dict[int, str]):
    """Rank r's gradient as device d computes it: ``faulty[d]`` ``permanent`` (every time, also in
    replays), ``transient`` (only in its own step) or ``other`` (a permanent fault of another kind)."""

    def grad(d: int, r: int, replay: bool) -> torch.Tensor:
        g = BATCH[r].clone()
        kind = faulty.get(d)
        if kind == "permanent" or (kind == "transient" and not replay):
            g[0, 1] *= 2.0**20
        elif kind == "other":
            g[1, 2] += 3.0
        return g

    return grad


def simulate(monkeypatch, world, faulty, suspects, *, healthy=None, against_self=None) -> dict[int, str]:
    """Each suspect's verdict, as every rank of ``world`` reaches it (asserted identical)."""
    grad = device(faulty)
    healthy = list(range(world)) if healthy is None else healthy
    monkeypatch.setattr(ranks.dist, "get_world_size", lambda group=None: world)
    localizers = []
    for r in range(world):
        monkeypatch.setattr(ranks.dist, "get_rank", lambda group=None, r=r: r)
        torch.manual_seed(0)
        localizers.append(RankLocalizer(nn.Linear(4, 2, bias=False)))
    weight = localizers[0].params[0]
    sent = []
    for r in range(world):
        weight.grad = grad(r, r, replay=False)
        sent.append(localizers[0]._signatures([[0]]))
    p = len(localizers[0].names)
    stacked = torch.stack(sent)
    reported = Gathered(step=3, norm=stacked[:, :p], pre=stacked[:, p:], buckets=[[0]])
    rows: list[torch.Tensor] = []

    def collect(row, group=None):
        rows.append(row.clone())
        raise _Gathered

    def serve(row, group=None):
        return torch.stack(rows)

    verdicts = []
    for phase in (collect, serve):
        monkeypatch.setattr(ranks, "gather_rows", phase)
        for r, loc in enumerate(localizers):

            def replay(s, loc=loc, r=r):
                loc.params[0].grad = grad(r, s, replay=True)

            try:
                events = loc.diagnose(3, reported, sorted(suspects), healthy, replay, against_self)
            except _Gathered:
                continue
            verdicts.append({e.rank: e.verdict for e in events})
    assert len(verdicts) == world and all(v == verdicts[0] for v in verdicts)
    return verdicts[0]


ALL3 = [0, 1, 2]


@pytest.mark.parametrize("bad", [2, 1, 0])
def test_a_world_finding_at_three_ranks_convicts_the_faulty_rank_alone(monkeypatch, bad):
    # every rank a candidate (a non-finite all-reduced gradient): its faulty peer's replay must
    # not convict a healthy rank
    want = {r: "persistent" if r == bad else "correct_result" for r in ALL3}
    assert simulate(monkeypatch, 3, {bad: "permanent"}, ALL3) == want
    own = {bad: ["crossrank: nonfinite in 0"]}  # ... also when the faulty rank's own check says so
    assert simulate(monkeypatch, 3, {bad: "permanent"}, ALL3, against_self=own) == want


def test_a_transient_fault_at_three_ranks_is_transient_on_its_rank_alone(monkeypatch):
    assert simulate(monkeypatch, 3, {2: "transient"}, ALL3) == {
        0: "correct_result",
        1: "correct_result",
        2: "transient",
    }


def test_two_suspects_among_four_ranks_are_replayed_by_the_two_free_of_suspicion(monkeypatch):
    assert simulate(monkeypatch, 4, {2: "permanent"}, [1, 2]) == {1: "correct_result", 2: "persistent"}
    assert simulate(monkeypatch, 4, {1: "permanent"}, [1, 2]) == {1: "persistent", 2: "correct_result"}


def test_two_faulty_ranks_among_four_convict_no_healthy_rank(monkeypatch):
    # no two clean peers agree about a faulty rank: suspicions, never a healthy rank accused
    got = simulate(monkeypatch, 4, {1: "permanent", 3: "other"}, [0, 1, 2, 3])
    assert got == {0: "correct_result", 1: "unverified", 2: "correct_result", 3: "unverified"}


def test_a_quarantined_rank_leaves_two_replicas_and_the_two_replica_rule(monkeypatch):
    own = {1: ["abft: checksum_mismatch in 0"]}
    got = simulate(monkeypatch, 3, {1: "permanent"}, [0, 1], healthy=[0, 1], against_self=own)
    assert got == {0: "cleared", 1: "persistent"}
    assert simulate(monkeypatch, 2, {1: "permanent"}, [0, 1]) == {0: "ambiguous", 1: "ambiguous"}
