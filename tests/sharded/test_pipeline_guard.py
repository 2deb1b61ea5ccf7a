"""A guarded pipeline (``--parallel pp``, two stages, gloo on loopback, the torchrun job's own
code): a clean run raises nothing; a forward-GEMM flip on the second stage and a corrupted
activation on the link 0 -> 1 are each caught in their step, the stage, layer and link named
(collective, tensor, phase, micro-batch, element range), replayed through the whole schedule and
repaired, so the run ends bit for bit where the clean run ends. The longer matrix (fsdp+pp, a
weight flip, a permanent fault, 300 steps) is benchmarks/bench_sharded_matrix.py."""

from __future__ import annotations

import json

from helpers import jobs_world, jsonl_lines, two_rank_job
from sdcscope.engine.dist import spawn
from sdcscope.engine.topology import Topology
from sdcscope.guard import GuardConfig

GEMM = {  # blocks.1.mlp.fc's Y = X Wᵀ on stage 1 (rank 1), step 1
    "site": "gemm.forward",
    "target": "blocks.1.mlp.fc",
    "rank": 1,
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 5},
    "schedule": {"kind": "transient", "step": 1},
}
P2P = {  # the activation stage 0 sent on (blocks.0's output) as it arrived on rank 1, micro-batch 1 of step 2
    "site": "comm.p2p",
    "target": "blocks.0",
    "rank": 1,
    "source": 0,
    "model": "bitflip",
    "bits": [22],
    "pattern": {"kind": "element", "index": 4100},  # row 1 of the [2, 64, 64] micro-batch
    "schedule": {"kind": "transient", "step": 2, "micro_batch": 1},
}


def _job(out, specs=()):
    return two_rank_job(
        out, Topology(kind="pp", schedule="1f1b"), 3, specs, GuardConfig(profile="full"), grad_accum=2
    ).to_dict()


def test_pipeline_gemm_and_p2p_faults_are_caught_named_and_repaired_bitwise(tmp_path):
    spawn(jobs_world, 2, ([_job(tmp_path / "clean"), _job(tmp_path / "faulty", [GEMM, P2P])],), timeout_s=240)
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    faulty = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert clean["outcome"] == faulty["outcome"] == "completed" and clean["parallel"] == "pp"
    assert jsonl_lines(tmp_path / "clean" / "events.jsonl") == []
    fired = jsonl_lines(tmp_path / "faulty" / "injections.jsonl")
    assert {(r["site"], r["step"], r["rank"], r["micro_batch"]) for r in fired} == {
        ("gemm.forward", 1, 1, 0),
        ("comm.p2p", 2, 1, 1),
    }

    found = jsonl_lines(tmp_path / "faulty" / "events.jsonl")
    assert [(e["step"], e["detector"]) for e in found] == [(1, "abft"), (2, "collectives")]  # each in its step
    gemm, link = found
    assert (gemm["detector"], gemm["rank"], gemm["module"], gemm["gemm"]) == ("abft", 1, "blocks.1.mlp.fc", "forward")
    assert gemm["evidence"]["stage"] == 1
    ev = link["evidence"]
    assert (link["detector"], link["rank"], link["module"]) == ("collectives", 1, "blocks.0")
    assert (ev["collective"], ev["link"], ev["phase"], ev["micro_batch"], ev["stage"]) == (
        "send_recv",
        "0 -> 1",
        "forward",
        1,
        1,
    )
    assert ev["elements"] == [1, 2] and ev["dim"] == 0 and ev["sent"] != ev["arrived"]  # the micro-batch's row 1
    assert ev["suspect"] == "link" and ev["suspects"] == [0, 1]
    # the whole schedule replayed on every rank, the clean re-execution kept: bit for bit the clean end
    assert all(e["verdict"] == "transient" and e["action"] == "recompute" for e in found)
    assert all(e["evidence"]["replay"]["ranks"] == {"0": "transient", "1": "transient"} for e in found)
    assert faulty["replica_sha256"] == clean["replica_sha256"]
    ledger = json.loads((tmp_path / "faulty" / "ledger.json").read_text())
    links = {k: v for d in ledger["devices"].values() for k, v in d.get("links", {}).items()}
    assert links["0->1"]["collectives"] == ["send_recv"] and links["0->1"]["suspect"] == "link"
