"""The rules of rank replay: who replays a suspect rank's step, and what the replays convict.

Pure functions over ranks and replay outcomes (no tensors, no collectives), so the rules can be
read and tested on their own; :class:`~sdcscope.localize.ranks.RankLocalizer` runs the replays
and applies them.

- **Partners** (:func:`replay_peers`): a suspect is replayed on itself and on peers -- two with
  three or more healthy ranks, the other one with two. A peer is never a suspect while a healthy
  rank free of suspicion is left; when every other healthy rank is a suspect (a finding about the
  world makes every rank a candidate), the peers are the least doubtful suspects, and the verdict
  rule below is what keeps a faulty peer from convicting a healthy rank.
- **Verdicts** (:func:`judge_replays`): with two peers a suspect is convicted only by a majority
  -- two peers free of doubt whose replays agree with each other and not with what it sent -- or
  by itself, when its own replay does not reproduce what it sent. A faulty peer is one vote, and a
  peer in doubt (evidence of its own against itself) none. With one peer (two replicas) the
  replay table stands and :func:`settle_two_replicas` re-judges it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sdcscope.detect.events import Event

VERDICTS = ("correct_result", "transient", "persistent", "unverified", "cleared", "ambiguous")
"""What :meth:`RankLocalizer.diagnose` can say about a suspect (``ambiguous`` only with two
healthy replicas: :func:`settle_two_replicas`)."""
NOT_ACCUSED = ("correct_result", "cleared")
"""Verdicts that accuse nobody: the suspect is no suspicion of its device."""
SELF_EVIDENCE = ("abft", "state_checksum", "nonfinite")
"""Detectors whose finding a rank makes on its own computation, without a peer."""
MAJORITY = 2
"""Peers that replay a suspect when there are enough healthy ranks: two that agree outvote one."""


def replay_peers(
    suspect: int, healthy: Sequence[int], suspects: Collection[int] = (), in_doubt: Collection[int] = ()
) -> list[int]:
    """The ranks that replay ``suspect``'s step besides itself: :data:`MAJORITY` of the other
    ``healthy`` ranks (fewer when there are fewer), preferring ranks without evidence against
    themselves (``in_doubt``), then ranks that are no suspect, then the next ranks after
    ``suspect`` cyclically (replays spread over the world). The same on every rank."""
    if suspect not in healthy:
        raise ValueError(f"rank {suspect} is not among the healthy ranks {sorted(healthy)}; it cannot be replayed")
    doubt, suspected = set(in_doubt), set(suspects)

    def preference(r: int) -> tuple[bool, bool, bool, int]:
        return (r in doubt, r in suspected, r < suspect, r)

    return sorted((r for r in set(healthy) if r != suspect), key=preference)[:MAJORITY]


@dataclass(frozen=True)
class Replays:
    """What the replays of one suspect's step showed: the facts its verdict rests on."""

    suspect: int
    peers: tuple[int, ...]
    reproduces: tuple[bool, ...]
    """Per peer: its replay gives what the suspect sent."""
    peers_agree: bool | None = None
    """The two peers' replays give the same gradient (None: fewer than two peers)."""
    self_reproduces: bool = True
    """The suspect's own replay gives what it sent."""


def judge_replays(r: Replays, doubt: Mapping[int, Sequence[str]]) -> tuple[str, str]:
    """``(verdict, reason)`` for one suspect. ``doubt``: per rank, the evidence it holds against
    itself (:func:`own_evidence`, or its own replay not reproducing what it sent).

    A peer reproducing what the suspect sent clears it (two devices computed the same bits:
    ``correct_result``). With one peer the replay table stands (``persistent`` when the suspect
    repeats its gradient, ``transient`` when not; two replicas are re-judged by
    :func:`settle_two_replicas`). With two, a conviction needs a majority: two peers free of doubt
    that agree with each other (``persistent`` / ``transient``); else the suspect's own replay
    disagreeing with what it sent is ``transient``; evidence of its own, or a clean peer's
    disagreement without a majority, is ``unverified`` (a suspicion, no conviction); accused only
    by peers in doubt, it is ``cleared``."""
    if not r.peers:
        return "unverified", "no healthy peer to replay on"
    if any(r.reproduces):
        return "correct_result", "a peer reproduces the gradient: data, not device"
    repeats = "the suspect repeats it" if r.self_reproduces else "its own replay does not repeat it"
    kind = "persistent" if r.self_reproduces else "transient"
    if len(r.peers) == 1:
        return kind, f"its peer computes another gradient; {repeats}"
    witnesses = [p for p in r.peers if not doubt.get(p)]
    if len(witnesses) >= MAJORITY and r.peers_agree:
        return kind, f"two peers without evidence against themselves agree, and not with what it sent; {repeats}"
    if not r.self_reproduces:
        return "transient", "its own replay does not reproduce what it sent"
    if doubt.get(r.suspect):
        return "unverified", "no majority of peers free of doubt, and it holds evidence against itself"
    if witnesses:
        return "unverified", (
            "no majority: a peer free of doubt disagrees, but not two that agree"
            if not r.peers_agree
            else "no majority: one of the two peers that agree holds evidence against itself"
        )
    return "cleared", (
        "accused only by peers in doubt; its own replay reproduces its gradient and no detector of "
        "its own found anything"
    )


def own_evidence(events: Iterable[Event], crossrank: str = "crossrank") -> dict[int, list[str]]:
    """Per rank, the rank-local, peer-free findings among ``events`` that speak against its own
    computation: a shared finding of its own ABFT, state checksum or non-finite detector
    (:data:`SELF_EVIDENCE`), or a non-finite gradient of its own before the reduction
    (``crossrank: nonfinite``). A finding about the world (``rank`` None) is no one's."""
    found: dict[int, list[str]] = {}
    for e in events:
        if e.rank is None:
            continue
        if e.detector in SELF_EVIDENCE or (e.detector == crossrank and e.verdict == "nonfinite"):
            where = f" in {e.module}" if e.module else ""
            found.setdefault(e.rank, []).append(f"{e.detector}: {e.verdict}{where}")
    return found


def _settle(e: Event, verdict: str, reason: str) -> None:
    e.evidence = {**e.evidence, "replay_verdict": e.verdict, "reason": reason}
    e.verdict = verdict


def settle_two_replicas(verdicts: Sequence[Event], own: Mapping[int, Sequence[str]]) -> list[Event]:
    """Re-judge ``verdicts`` (:meth:`RankLocalizer.diagnose`'s, one per suspect) of a world of two
    healthy replicas, each the other's peer, in place; ``own``: :func:`own_evidence` of the step.

    A replica is in doubt when it holds rank-local evidence against itself (``own``) or its own
    replay does not reproduce what it sent. A peer's agreement still clears a suspect
    (``correct_result``: two devices computed the same bits), but its disagreement -- an
    accusation -- counts only when the peer is not in doubt; else the suspect's own evidence
    decides: ``transient`` stays (it disagrees with itself), ``unverified`` when it is in doubt by
    its own findings, ``cleared`` when nothing of its own speaks against it. Two ``persistent``
    verdicts left standing mean two clean replicas accusing each other: both ``ambiguous``."""
    doubt = {r: list(v) for r, v in own.items() if v}
    for e in verdicts:
        if e.rank is not None and e.evidence.get("self_reproduces") is False:
            doubt.setdefault(e.rank, []).append("its own replay does not reproduce its gradient")
    for e in verdicts:
        peer = e.evidence.get("peer")
        if e.verdict not in ("persistent", "transient") or peer is None or not doubt.get(peer):
            continue
        e.evidence = {**e.evidence, "peer_in_doubt": list(doubt[peer])}
        if e.evidence.get("self_reproduces") is False:
            continue  # transient: its own replay disagrees with what it sent, no peer needed
        if own.get(e.rank):
            _settle(e, "unverified", "its only peer holds evidence against itself: no trusted replay")
        else:
            _settle(
                e,
                "cleared",
                "accused only by a peer in doubt; its own replay reproduces its gradient and no "
                "detector of its own found anything",
            )
    accused = [e for e in verdicts if e.verdict == "persistent"]
    if len(accused) == 2 and {e.evidence.get("peer") for e in accused} == {e.rank for e in accused}:
        for e in accused:
            _settle(
                e,
                "ambiguous",
                "two replicas accuse each other: each one's replay of the other disagrees, each "
                "reproduces its own gradient and neither holds evidence against itself",
            )
    for e in verdicts:
        if own.get(e.rank):
            e.evidence = {**e.evidence, "own_evidence": list(own[e.rank])}
    return list(verdicts)
