"""FSDP2's collectives checked online (gloo on loopback, two ranks, the torchrun job's own code):
an all-gather that delivered other bits on one rank is caught in its step exactly, its link named
(source -> destination, the call, the parameter, the element range), replayed and repaired bit
for bit; a reduce-scatter fault is caught by the tolerance check; a clean run raises nothing."""

from __future__ import annotations

import json

from helpers import jobs_world, jsonl_lines, two_rank_job
from sdcscope.engine.dist import spawn
from sdcscope.guard import GuardConfig

GATHER = {  # what arrived on rank 1 from rank 0 in blocks.0.mlp.fc's forward all-gather, step 2
    "site": "comm.all_gather",
    "target": "blocks.0.mlp.fc.weight",
    "rank": 1,
    "source": 0,
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 3},
    "schedule": {"kind": "transient", "step": 2},
}
SCATTER = {  # the reduced gradient shard that arrived on rank 0, step 1
    "site": "comm.reduce_scatter",
    "target": "blocks.1.attn.q_proj.weight",
    "rank": 0,
    "model": "bitflip",
    "bits": [29],
    "pattern": {"kind": "element", "index": 7},
    "schedule": {"kind": "transient", "step": 1},
}


def _job(out, specs=()):
    return two_rank_job(out, "fsdp", 3, specs, GuardConfig(profile="minimal")).to_dict()  # no ABFT: the checks alone


def test_fsdp_all_gather_and_reduce_scatter_faults_are_caught_named_and_repaired(tmp_path):
    spawn(jobs_world, 2, ([_job(tmp_path / "clean"), _job(tmp_path / "faulty", [GATHER, SCATTER])],), timeout_s=240)
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    faulty = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert clean["outcome"] == faulty["outcome"] == "completed"
    assert jsonl_lines(tmp_path / "clean" / "events.jsonl") == []

    fired = jsonl_lines(tmp_path / "faulty" / "injections.jsonl")
    assert {(r["site"], r["step"], r["dst"]) for r in fired} == {
        ("comm.all_gather", 2, 1),
        ("comm.reduce_scatter", 1, 0),
    }
    events = jsonl_lines(tmp_path / "faulty" / "events.jsonl")
    assert {e["detector"] for e in events} == {"collectives"}
    (gather,) = [e for e in events if e["evidence"]["collective"] == "all_gather"]
    ev = gather["evidence"]
    assert (gather["step"], gather["module"], ev["link"], ev["src"], ev["dst"], ev["phase"]) == (
        2,
        "blocks.0.mlp.fc.weight",
        "0 -> 1",
        0,
        1,
        "forward",
    )
    assert ev["elements"] == [0, 128] and ev["dim"] == 0  # rank 0's rows of the (256, 64) weight
    assert ev["suspect"] == "link" and ev["suspects"] == [0, 1]  # one remote receiver: either end
    assert ev["sent"] != ev["arrived"]
    (scatter,) = [e for e in events if e["evidence"]["collective"] == "reduce_scatter"]
    assert (scatter["step"], scatter["rank"], scatter["module"]) == (1, 0, "blocks.1.attn.q_proj.weight")
    assert scatter["evidence"]["residual"] > scatter["evidence"]["tolerance"]
    assert all(e["verdict"] == "transient" and e["action"] == "recompute" for e in events)
    # the clean re-executions were kept: the run ends where the clean one ends, bit for bit
    assert faulty["param_sha256"] == clean["param_sha256"]
    ledger = json.loads((tmp_path / "faulty" / "ledger.json").read_text())
    links = {k: v for d in ledger["devices"].values() for k, v in d.get("links", {}).items()}
    assert links["0->1"]["collectives"] == ["all_gather"] and links["0->1"]["suspect"] == "link"
