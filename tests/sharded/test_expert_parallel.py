"""Expert parallelism (gloo on loopback, two ranks, the torchrun job's own code): the MoE's experts
sharded over the ranks, tokens moved by all-to-all. A clean guarded run raises nothing; a
forward-GEMM flip in an expert is caught by ABFT in its step naming the expert and its rank; a
bit flipped in the token rows that arrived over one link is caught exactly, naming the link,
the layer, the call and the rows; both are repaired and the run ends where the clean one ends,
bit for bit. Misplaced requests are refused before any rank starts."""

from __future__ import annotations

import json

import pytest

from helpers import jobs_world, jsonl_lines, two_rank_job
from sdcscope.engine.dist import spawn
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.workloads import WorkloadConfig

WORKLOAD = WorkloadConfig(workload="moe", preset="tiny", batch_size=2, max_corpus_bytes=100_000, eval_batches=1)
GEMM = {  # expert 3 lives on rank 1 (4 experts over 2 ranks): its fc's Y = XWᵀ, step 1
    "site": "gemm.forward",
    "target": "blocks.1.moe.experts.3.fc",
    "rank": 1,
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 5},
    "schedule": {"kind": "transient", "step": 1},
}
LINK = {  # the token rows rank 0 sent rank 1 in blocks.0's dispatch, as they arrived, step 2
    "site": "comm.all_to_all",
    "target": "blocks.0.moe",
    "rank": 1,
    "source": 0,
    "model": "bitflip",
    "bits": [30],
    "schedule": {"kind": "transient", "step": 2},
}


def _job(out, specs=(), kind="ep", workload=WORKLOAD):
    guard = GuardConfig(profile="minimal", abft={"targets": ["*.experts.*"]})  # ABFT on every expert GEMM
    return two_rank_job(out, kind, 3, specs, guard, workload=workload)


def test_expert_gemm_and_all_to_all_faults_are_caught_named_and_repaired(tmp_path):
    jobs = [_job(tmp_path / "clean").to_dict(), _job(tmp_path / "faulty", [GEMM, LINK]).to_dict()]
    spawn(jobs_world, 2, (jobs,), timeout_s=240)
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    faulty = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert clean["outcome"] == faulty["outcome"] == "completed" and clean["parallel"] == "ep"
    assert jsonl_lines(tmp_path / "clean" / "events.jsonl") == []
    assert not clean["replicas_identical"]  # each rank holds its own experts

    fired = {(r["site"], r["step"], r["rank"]) for r in jsonl_lines(tmp_path / "faulty" / "injections.jsonl")}
    assert fired == {("gemm.forward", 1, 1), ("comm.all_to_all", 2, 1)}
    events = jsonl_lines(tmp_path / "faulty" / "events.jsonl")
    (abft,) = [e for e in events if e["detector"] == "abft"]
    assert (abft["step"], abft["rank"], abft["module"], abft["gemm"]) == (1, 1, GEMM["target"], "forward")
    (link,) = [e for e in events if e["detector"] == "collectives"]
    ev = link["evidence"]
    assert (link["step"], link["module"], ev["collective"], ev["link"], ev["phase"]) == (
        2,
        "blocks.0.moe",
        "all_to_all",
        "0 -> 1",
        "dispatch",
    )
    assert ev["elements"][0] < ev["elements"][1] and ev["sent"] != ev["arrived"]
    assert ev["suspect"] == "link" and ev["suspects"] == [0, 1]  # one remote receiver: either end
    assert all(e["verdict"] == "transient" and e["action"] == "recompute" for e in events)
    # the clean re-executions were kept: every rank ends where the clean run ends, bit for bit
    assert faulty["replica_sha256"] == clean["replica_sha256"]
    ledger = json.loads((tmp_path / "faulty" / "ledger.json").read_text())
    links = {k: v for d in ledger["devices"].values() for k, v in d.get("links", {}).items()}
    assert links["0->1"]["collectives"] == ["all_to_all"]


@pytest.mark.parametrize(
    "kind,workload,specs,match",
    [
        ("ep", WorkloadConfig(workload="gpt", preset="tiny"), [], "shards experts: the gpt workload has none"),
        ("fsdp", WORKLOAD, [], "the moe workload splits its experts only"),
        (
            "fsdp",
            WorkloadConfig(workload="gpt", preset="tiny"),
            [LINK],
            "FSDP2 and tensor parallelism run no all-to-all",
        ),
    ],
)
def test_expert_parallel_requests_that_cannot_run_are_refused_before_any_rank_starts(
    tmp_path, kind, workload, specs, match
):
    from sdcscope.jobs.torchrun import check_job

    with pytest.raises(ValueError, match=match):
        check_job(_job(tmp_path / "run", specs, kind=kind, workload=workload))


def test_an_all_to_all_fault_names_its_source():
    with pytest.raises(ValueError, match="needs source"):
        FaultSpec.from_dict({k: v for k, v in LINK.items() if k != "source"})
    with pytest.raises(ValueError, match="comm.all_to_all phase"):
        FaultSpec.from_dict({**LINK, "phase": "forward"})
