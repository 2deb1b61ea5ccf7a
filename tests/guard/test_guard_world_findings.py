"""World-level findings in the one decision loop: the world's replay evidence (every rank's replay,
gathered) gives each finding its verdict, names the rank a world finding is about, and names the
rank and layer where a fault the replay's ABFT caught acts."""

from __future__ import annotations

from sdcscope.detect import Event
from sdcscope.guard.sharded import world_replay
from sdcscope.guard.world import apply_replay


def replay(verdict="transient", differing=0, grad=None, detections=0, caught=None, evidence=None):
    out = {
        "verdict": verdict,
        "differing_grads": differing,
        "first_differing_grad": grad,
        "replay_detections": detections,
    }
    if caught:
        out["detected_in"] = caught
    if evidence:
        out["evidence"] = evidence
    return out


def test_a_world_finding_names_the_one_rank_whose_replay_differs():
    results = [replay("reproducible"), replay("transient", 3, "blocks.1.mlp.fc.weight"), replay("reproducible")]
    world = world_replay(results)
    assert world["verdict"] == "transient" and world["differing_ranks"] == [1]
    spike = Event(7, "spike", "grad_norm_spike", rank=None, evidence={"value": 90.0})
    apply_replay([spike], world)
    assert (spike.rank, spike.module, spike.verdict) == (1, "blocks.1.mlp.fc", "transient")
    assert spike.evidence["finding"] == "grad_norm_spike" and spike.evidence["replay"] is world


def test_a_world_finding_two_ranks_differ_on_stays_about_no_rank():
    world = world_replay([replay("transient", 1, "a.weight"), replay("transient", 2, "b.weight")])
    spike = Event(7, "spike", "loss_spike", rank=None)
    apply_replay([spike], world)
    assert spike.rank is None and spike.module is None and spike.verdict == "transient"


def test_a_nonfinite_seen_everywhere_is_named_where_the_replays_abft_caught_the_gemm():
    """Every rank sees the NaN surface at the norm layer; rank 2's replay ABFT catches the GEMM."""
    results = [replay("reproducible", detections=0), replay("reproducible", detections=0)]
    results.append(replay("reproducible", detections=1, caught=["blocks.0.attn.q_proj"], evidence="again"))
    world = world_replay(results)
    assert world["verdict"] == "reproducible" and world["caught"] == {"2": ["blocks.0.attn.q_proj"]}
    seen = [Event(3, "nonfinite", "nonfinite", rank=r, module="ln_f") for r in range(3)]
    state = Event(3, "state_checksum", "corrupt", rank=0, module="w")
    apply_replay([*seen, state], world)
    assert {(e.rank, e.module) for e in seen} == {(2, "blocks.0.attn.q_proj")}
    assert seen[0].evidence["reported"] == {"rank": 0, "module": "ln_f"}
    assert (state.verdict, state.rank, state.module) == ("corrupt", 0, "w")  # the state decides by itself


def test_a_replay_that_could_not_run_anywhere_leaves_findings_unverified():
    world = world_replay([replay("unverified"), replay("transient", 1, "a.weight")])
    e = Event(1, "abft", "checksum_mismatch", rank=1, module="a")
    apply_replay([e], world)
    assert e.verdict == "unverified" and e.rank == 1 and e.module == "a"
