"""The guard over split training (shards and pipeline stages): topology × fault → detected / step /
named / repaired / final-equal, and the guard's cost ratio per topology (gloo on CPU).

    python benchmarks/bench_sharded_matrix.py                      # 2-rank FSDP2, TP, EP and pp, 12 steps
    python benchmarks/bench_sharded_matrix.py --full               # + FSDP2 on 4, FSDP×TP, HSDP, FSDP×EP, fsdp+pp 2×2
    python benchmarks/bench_sharded_matrix.py --only ep/2 fsdp+ep/4 --steps 300   # expert parallel, 300 steps
    python benchmarks/bench_sharded_matrix.py --steps 300 --only pp/2 fsdp+pp/4   # the pipeline's 300-step rows
    python benchmarks/bench_sharded_matrix.py --steps 300 --full   # the issue's 300-step rows

Each row runs the GPT (tiny preset) sharded with ``--parallel`` semantics through the torchrun
job's own code (``run_job`` on spawned gloo ranks), guarded, with one fault on a chosen rank, and
compares the final full parameters with the clean guarded run's (``--profile``, default ``full``:
every GEMM every step). ``named``: an event names the fault's rank and layer (a GEMM fault:
ABFT's check of that GEMM; under tensor parallelism the rank's local shard GEMM; an all-to-all
fault: the link into the rank, in the MoE layer); in a pipeline also the rank's stage, and for
``comm.p2p`` (a corrupted send/recv into the rank from its neighbouring stage) the link. The
expert-parallel topologies (``ep/2``, ``fsdp+ep/4``) train the MoE workload (tiny) with their own
rows (:func:`ep_faults`); pipeline rows train 2 micro-batches a step (1F1B). The cost ratio
is the guarded clean run's training-loop time (summary.json) over the unguarded one's (each run
once per repeat, interleaved; median), measured on a shared, loaded machine: the ratios are
pessimistic. The figure on the last line is the median guard-cost ratio over topologies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from sdcscope.engine import TrainConfig
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.guard.config import PROFILES
from sdcscope.workloads import WorkloadConfig
from sdcscope.workloads.gpt import gpt_preset, stage_blocks

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000)
MOE = WorkloadConfig(workload="moe", preset="tiny", batch_size=2, max_corpus_bytes=200_000)
TOPOLOGIES = {"fsdp/2": ("fsdp", 2), "tp/2": ("tp", 2), "ep/2": ("ep", 2), "pp/2": ("pp", 2)}
FULL = {
    "fsdp/4": ("fsdp", 4),
    "fsdp+tp/4": ("fsdp+tp", 4),
    "hsdp/4": ("hsdp", 4),
    "fsdp+ep/4": ("fsdp+ep", 4),
    "fsdp+pp/4": ("fsdp+pp", 4),
}
EXPERT_PARALLEL = ("ep", "fsdp+ep")
"""Topologies of the MoE workload (tiny: 4 experts, top-2), with their own fault rows (:func:`ep_faults`)."""


def _stage(kind: str, nproc: int, rank: int) -> tuple[int, int, int] | None:
    """``(the rank's pipeline stage, stages, ranks per stage)`` of a pipeline topology, else None."""
    topo = Topology(kind=kind, inner=2)
    if not topo.pipeline:
        return None
    degrees = topo.degrees(nproc)
    dp = degrees.get("dp", 1)
    return rank // dp, degrees["pp"], dp


def faults(kind: str, step: int, rank: int, nproc: int = 2) -> dict[str, dict]:
    """One fault per row, on ``rank`` at ``step``, in an MLP linear: under tensor parallelism the
    forward GEMM of the colwise ``fc`` (its output features split) and the dX of the rowwise
    ``proj`` (its input features split), each this rank's local shard GEMM; in a pipeline a block
    of the rank's own stage, and a corrupted send/recv into the rank (``comm.p2p``)."""
    where = _stage(kind, nproc, rank)
    block = 0 if where is None else stage_blocks(gpt_preset(WORKLOAD.preset).n_layer, where[1])[where[0]][0]
    gemm = f"blocks.{block}.mlp.fc"
    dx = f"blocks.{block}.mlp.proj" if kind in ("tp", "fsdp+tp") else gemm
    flip = {"model": "bitflip", "rank": rank, "pattern": {"kind": "element", "index": 5}, "seed": 1}
    when = {"kind": "transient", "step": step}
    return {
        "gemm.forward": {**flip, "site": "gemm.forward", "target": gemm, "bits": [30], "schedule": when},
        "gemm.grad_input": {**flip, "site": "gemm.grad_input", "target": dx, "bits": [30], "schedule": when},
        "weight": {**flip, "site": "weight", "target": gemm, "bits": [30], "schedule": when},
        "optimizer_state": {
            **flip,
            "site": "optimizer_state",
            "target": gemm,
            "bits": [30],
            "schedule": when,
            "state_key": "exp_avg_sq",
        },
        "param_grad": {**flip, "site": "param_grad", "target": gemm, "bits": [30], "schedule": when},
        # a broken unit: the ledger's strikes make the site persistent and the guard stops the run
        "permanent": {
            **flip,
            "site": "gemm.forward",
            "target": gemm,
            "bits": [26],
            "schedule": {"kind": "permanent", "start": step},
        },
        **({} if where is None else {"comm.p2p": _p2p(rank, *where, when)}),
    }


def _p2p(rank: int, stage: int, stages: int, dp: int, when: dict) -> dict:
    """A flipped bit in what arrived on ``rank`` from its neighbouring stage: the activation from
    the previous stage (the first stage: the gradient from the next one), micro-batch 1."""
    forward = stage > 0
    sender = stage - 1 if forward else stage + 1
    boundary = stage_blocks(gpt_preset(WORKLOAD.preset).n_layer, stages)[min(stage, sender)][-1]
    return {
        "site": "comm.p2p",
        "target": f"blocks.{boundary}",
        "rank": rank,
        "source": sender * dp + rank % dp,
        "phase": "forward" if forward else "backward",
        "model": "bitflip",
        "bits": [22],
        "pattern": {"kind": "element", "index": 4100},
        "schedule": {**when, "micro_batch": 1},
    }


def ep_faults(kind: str, nproc: int, step: int, rank: int) -> dict[str, dict]:
    """The expert-parallel rows, on ``rank`` at ``step``: a forward-GEMM flip in one of the
    experts the rank owns (ABFT names the expert), a flip in that expert's weight shard (the
    state checksums), a flip in the token rows that arrived on the rank from its expert-parallel
    peer (the exact all-to-all check names the link), the same link's gradient move in backward,
    and a link that stays broken (the ledger's suspect pair stops the run)."""
    ep = nproc if kind == "ep" else 2  # the mesh is (dp, ep) with ep = inner = 2: rank = dp·ep + coordinate
    coord, per = rank % ep, 4 // ep
    expert = f"blocks.0.moe.experts.{coord * per + per - 1}.fc"
    peer = rank - coord if coord else rank + 1
    flip = {"model": "bitflip", "rank": rank, "pattern": {"kind": "element", "index": 5}, "seed": 1}
    when = {"kind": "transient", "step": step}
    link = {**flip, "site": "comm.all_to_all", "target": "blocks.0.moe", "source": peer, "bits": [30]}
    link["pattern"] = {"kind": "element", "index": "random"}  # the chunk's rows vary with the routing
    return {
        "expert gemm.fwd": {**flip, "site": "gemm.forward", "target": expert, "bits": [30], "schedule": when},
        "expert weight": {**flip, "site": "weight", "target": expert, "bits": [30], "schedule": when},
        "a2a dispatch": {**link, "schedule": when},
        "a2a combine_grad": {**link, "phase": "combine_grad", "schedule": when},
        "a2a permanent": {**link, "schedule": {"kind": "permanent", "start": step}},
    }


def _rank(rank: int, world: int, job: dict) -> None:
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DistConfig(backend="gloo", timeout_s=120))
    run_job(Job.from_dict(job))  # a guard's stop ends every rank cleanly: summary outcome "stopped"


def run(
    out: Path, kind: str, nproc: int, steps: int, specs: list[dict], guard: bool, profile: str = "full"
) -> tuple[dict, list, float]:
    """One sharded run: ``(summary, events, wall seconds)``; ``profile``: the guard's."""
    from sdcscope.jobs.torchrun import make_job

    job = make_job(
        out,
        nproc,
        steps=steps,
        workload=MOE if kind in EXPERT_PARALLEL else WORKLOAD,
        train=TrainConfig(seed=0, grad_accum=2 if Topology(kind=kind).pipeline else 1),
        dist_config=DistConfig(backend="gloo", timeout_s=120),
        specs=[FaultSpec.from_dict(s) for s in specs],
        guard=GuardConfig(profile=profile) if guard else None,
        parallel=Topology(kind=kind, inner=2),
        crossrank=guard,
    )
    spawn(_rank, nproc, (job.to_dict(),), timeout_s=600)
    summary = json.loads((out / "summary.json").read_text())
    wall = summary["wall_seconds"]  # the training loop's own time (no process start, no final gather)
    path = out / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return summary, events, wall


def judge(events: list[dict], spec: dict, step: int, clean: dict, summary: dict, stage: int | None = None) -> dict:
    """``stage``: the pipeline stage of the fault's rank, which the events must name too."""
    found = [e for e in events if e["detector"] != "guard"]
    first = min((e["step"] for e in found), default=None)
    layer = spec["target"]
    gemm = spec["site"].partition("gemm.")[2] or None  # a GEMM fault: named by ABFT's check of that GEMM
    named = any(
        e.get("rank") == spec["rank"]
        and (e.get("module") or "").startswith(layer)
        and (gemm is None or (e["detector"] == "abft" and e.get("gemm") == gemm))
        and (stage is None or e["evidence"].get("stage") == stage)
        and (  # a link fault: the link source -> rank (an all-to-all's in its call)
            "source" not in spec
            or (
                e["evidence"].get("link") == f"{spec['source']} -> {spec['rank']}"
                if spec["site"] == "comm.p2p"
                else (e["evidence"].get("src"), e["evidence"].get("dst"), e["evidence"].get("phase"))
                == (spec["source"], spec["rank"], spec.get("phase", "dispatch"))
            )
        )
        for e in found
    )
    memory = spec["site"] in ("weight", "optimizer_state")
    if spec["schedule"]["kind"] == "permanent":  # repaired = stopped cleanly, every rank, ledger written
        stop = [e for e in events if e["detector"] == "guard" and e["verdict"] == "stopped"]
        named = named and summary.get("outcome") == "stopped"
        return {
            "detected": bool(found),
            "step": first,
            "named": named,
            "repaired": bool(stop) and summary.get("outcome") == "stopped",
            "final_equal": "n/a",
            "actions": sorted({e.get("action") for e in events}),
        }
    return {
        "detected": bool(found),
        "step": first,
        "in_time": first is not None and step <= first <= step + (1 if memory else 0),
        "named": named,
        "repaired": summary["outcome"] == "completed" and bool(found) and all(e.get("action") for e in found),
        "final_equal": summary["replica_sha256"] == clean["replica_sha256"],  # every rank's (a stage each)
        "actions": sorted({e.get("action") for e in found}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--full", action="store_true", help="add the 4-rank topologies")
    p.add_argument("--repeats", type=int, default=1, help="guarded/unguarded clean pairs per topology")
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--rank", type=int, default=1, help="the rank the faults live on")
    p.add_argument("--only", nargs="*", default=None, help="topologies to run (e.g. hsdp/4 fsdp+tp/4)")
    p.add_argument("--sites", nargs="*", default=None, help="fault rows to run (e.g. gemm.forward comm.p2p permanent)")
    p.add_argument(
        "--profile",
        default="full",
        choices=sorted(PROFILES),
        help="the guard's profile (full: every GEMM every step, so ABFT checks the faulted one)",
    )
    a = p.parse_args()
    topologies = {**TOPOLOGIES, **(FULL if a.full or a.only else {})}
    if a.only:
        unknown = sorted(set(a.only) - set(topologies))
        if unknown:
            p.error(f"unknown topologies {unknown}; allowed: {', '.join(topologies)}")
        topologies = {k: v for k, v in topologies.items() if k in a.only}
    ratios = {}
    print(f"{'topology':10} {'fault':16} {'detected':8} {'step':>4} {'named':6} {'repaired':8} {'final=':6} actions")
    with tempfile.TemporaryDirectory(prefix="sdcscope-sharded-") as tmp:
        root = Path(tmp)
        for label, (kind, nproc) in topologies.items():
            tag = label.replace("/", "_").replace("+", "_")
            walls = {True: [], False: []}
            clean = None
            for r in range(a.repeats):
                for guarded in (False, True):
                    summary, events, wall = run(
                        root / f"{tag}-clean{int(guarded)}-{r}", kind, nproc, a.steps, [], guarded, a.profile
                    )
                    walls[guarded].append(wall)
                    if guarded:
                        clean = summary
                        print(
                            f"{label:10} {'(clean)':16} {'events=' + str(len(events)):8} {'':>4} {'':6} {'':8} {'':6}"
                        )
            ratios[label] = statistics.median(walls[True]) / statistics.median(walls[False])
            where = _stage(kind, nproc, a.rank)
            rows = ep_faults(kind, nproc, a.fault_step, a.rank) if kind in EXPERT_PARALLEL else None
            for site, spec in (rows or faults(kind, a.fault_step, a.rank, nproc)).items():
                if a.sites is not None and site not in a.sites:
                    continue
                summary, events, _ = run(root / f"{tag}-{site}", kind, nproc, a.steps, [spec], True, a.profile)
                j = judge(events, spec, a.fault_step, clean, summary, None if where is None else where[0])
                print(
                    f"{label:10} {site:16} {str(j['detected']):8} {str(j['step']):>4} {str(j['named']):6} "
                    f"{str(j['repaired']):8} {str(j['final_equal']):6} {', '.join(map(str, j['actions']))}",
                    flush=True,
                )
    for label, ratio in ratios.items():
        print(f"guard cost ratio {label}: {ratio:.2f}x (guarded / unguarded wall, median of {a.repeats})")
    print(f"median guard cost ratio over topologies: {statistics.median(ratios.values()):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
