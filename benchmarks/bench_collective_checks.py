"""The price and the false-alarm record of the exact collective checks on FSDP2 (fsdp/2) and on
expert parallelism's all-to-alls (ep/2), gloo, CPU.

    python benchmarks/bench_collective_checks.py                       # 2,000 checked + 2,000 unchecked steps
    python benchmarks/bench_collective_checks.py --steps 200 --block 20  # a quick look
    python benchmarks/bench_collective_checks.py --parallel ep --steps 1000 --block 25   # the MoE's all-to-alls

    python benchmarks/bench_collective_checks.py --localize            # who is suspected, on 4 ranks

Two ranks train the GPT (tiny preset) split by ``fully_shard`` (each block, then the root: the
``--parallel fsdp`` layout) in one plain loop. Blocks of ``--block`` steps alternate between the
unchecked loop and the same loop with :class:`~sdcscope.detect.collectives.CollectiveCheck`
attached (every parameter all-gather, forward and backward re-gather, compared exactly; every
gradient reduce-scatter against its rounding bound; one gather of words per step), on the same
model, so both sides see the same machine load. Per pair of blocks the checked / unchecked
ratio of the wall time and of the process CPU time (rank 0's; the other rank's is printed too);
the median over the pairs.

``--parallel ep``: two ranks train the MoE workload (tiny: 4 experts, top-2) with its experts
sharded two per rank (the ``--parallel ep`` layout, through the distributed trainer's own step:
the all-to-alls, the average of the whole parameters' gradients), and the checked blocks attach
the same check, which then digests every all-to-all chunk sent and arrived (dispatch, combine
and both gradient moves of each MoE layer) and compares every link exactly.

The checked steps are clean steps: every finding would be a false event. The script prints the
events, the all-gather links compared (the exact check cannot false-alarm: a clean link carries
the sender's bits, so its digest is the sender's), and the largest reduce-scatter residual as a
fraction of its bound. Last line: ``collective checks fsdp/2: wall ratio W, cpu ratio C; N
events over S clean steps (L links compared, reduce-scatter margin M)`` (``ep/2``: ``(L all-to-all
links compared)``).

``--localize`` instead runs guarded 4-rank jobs through the torchrun job's own code, each with one
all-gather fault on shard rank 2's part of a weight: ``send`` on fsdp/4 (every receiver's copy:
the sender is suspected), ``recv`` on rank 3 of fsdp/4 (one receiver of three: the receiver),
``recv`` on hsdp 2×2 (a shard group of two: the link, both ends), and a ``permanent`` recv fault
(the link keeps failing: the ledger's strikes stop the run, naming the pair). Each transient case
must end bitwise where its clean twin ends. Last line: ``localization: K/N cases suspected as
expected, R/T transient cases repaired bitwise``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sdcscope.detect.collectives import CollectiveCheck, CollectivesConfig
from sdcscope.detect.protocol import CheckView
from sdcscope.engine.dist import DistConfig, init_distributed, shard, spawn
from sdcscope.engine.topology import Topology
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=8, max_corpus_bytes=200_000)


MOE = WorkloadConfig(workload="moe", preset="tiny", batch_size=8, max_corpus_bytes=200_000)


class _Checking:
    """A trainer callback running the check around each step (what the guard does with it)."""

    def __init__(self, check: CollectiveCheck, events: list) -> None:
        self.check, self.events = check, events

    def before_step(self, ctx) -> None:
        self.check.begin_step(ctx.step)

    def before_optimizer_step(self, ctx) -> None:
        self.events.extend(self.check.check(CheckView(ctx.step, ctx.step_loss, ctx.trainer.model)))


def _rank_ep(rank: int, block: int, steps: int, out: str) -> None:
    """``--parallel ep``: the distributed trainer's own steps, checked blocks interleaved."""
    from sdcscope.engine import TrainConfig
    from sdcscope.engine.distributed import DistTrainer

    trainer = DistTrainer(make_workload(MOE), TrainConfig(seed=0), topology=Topology(kind="ep"))
    check = CollectiveCheck(trainer.model, CollectivesConfig())
    events = []
    checking = _Checking(check, events)

    def run(checked: bool) -> tuple[float, float]:
        dist.barrier()
        if checked:
            trainer.callbacks.append(checking)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(block):
            trainer.train_step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if checked:
            trainer.callbacks.remove(checking)
        return wall, cpu

    _interleave(run, check, steps, block, rank, out, events, links=lambda: check.moves.links_compared)


def _interleave(run, check, steps: int, block: int, rank: int, out: str, events: list, links) -> None:
    """After a warm-up block (FSDP2's lazy init, the allocator), unchecked and checked blocks of
    ``block`` steps alternately; this rank's timings, events, links compared (``links()``) and
    largest reduce-scatter residual written to ``out/rank{rank}.json``."""
    run(False)
    rows = []
    for _ in range(max(1, steps // block)):
        base = run(False)
        check.attach()
        checked = run(True)
        check.detach()
        rows.append({"base": base, "checked": checked})
    record = {
        "rank": rank,
        "rows": rows,
        "events": [e.to_dict() for e in events],
        "links": links(),
        "margin": check.scatter_margin,
        "checked_steps": len(rows) * block,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _rank(rank: int, size: int, steps: int, block: int, threads: int, out: str, parallel: str = "fsdp") -> None:
    torch.set_num_threads(threads)
    init_distributed(DistConfig(backend="gloo", timeout_s=300))
    if parallel == "ep":
        _rank_ep(rank, block, steps, out)
        return
    wl = make_workload(WORKLOAD)
    torch.manual_seed(0)
    model = wl.build_model()
    topology = Topology(kind="fsdp")
    topology.apply(model, topology.build_mesh(size, "cpu"), wl)
    opt = wl.build_optimizer(model)
    check = CollectiveCheck(model, CollectivesConfig())
    step, events = 0, []

    def run(checked: bool) -> tuple[float, float]:
        nonlocal step
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(block):
            if checked:
                check.begin_step(step)
            loss = wl.loss(model, wl.batch(0, step, shard(rank, 1, 0)))
            loss.backward()
            if checked:
                events.extend(check.check(CheckView(step, loss, model)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
        return time.perf_counter() - wall, time.process_time() - cpu

    _interleave(run, check, steps, block, rank, out, events, links=lambda: check.links_compared)


LOCAL_WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000)
FAULT = {
    "site": "comm.all_gather",
    "target": "blocks.1.attn.k_proj.weight",
    "source": 2,
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 1},
    "schedule": {"kind": "transient", "step": 1},
}
CASES = {  # name: (parallel, fault changes, expected suspect, expected suspects)
    "send fsdp/4 (backward re-gather)": (
        "fsdp",
        {"direction": "send", "rank": None, "phase": "backward"},
        "sender",
        [2],
    ),
    "recv fsdp/4, rank 3": ("fsdp", {"rank": 3}, "receiver", [3]),
    "recv hsdp 2x2, rank 3": ("hsdp", {"rank": 3}, "link", [2, 3]),
    "recv fsdp/4, rank 3, permanent": (
        "fsdp",
        {"rank": 3, "schedule": {"kind": "permanent", "start": 1}},
        "receiver",
        [3],
    ),
}


def _job(out: Path, kind: str, specs: list[dict], steps: int):
    from sdcscope.engine import TrainConfig
    from sdcscope.faults import FaultSpec
    from sdcscope.guard import GuardConfig
    from sdcscope.jobs.torchrun import make_job

    return make_job(
        out,
        4,
        steps=steps,
        workload=LOCAL_WORKLOAD,
        train=TrainConfig(seed=0),
        dist_config=DistConfig(backend="gloo", timeout_s=300),
        specs=[FaultSpec.from_dict(s) for s in specs],
        guard=GuardConfig(profile="minimal"),
        parallel=Topology(kind=kind),
    ).to_dict()


def _jobs(rank: int, size: int, jobs: list[dict]) -> None:
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DistConfig(backend="gloo", timeout_s=300))
    for job in jobs:
        run_job(Job.from_dict(job))


def localize(steps: int = 5) -> None:
    """The ``--localize`` cases (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jobs = [_job(root / f"clean-{k}", k, [], steps) for k in ("fsdp", "hsdp")]
        for i, (kind, change, _, _) in enumerate(CASES.values()):
            jobs.append(_job(root / f"case{i}", kind, [{**FAULT, **change}], steps))
        spawn(_jobs, 4, (jobs,), timeout_s=3600)
        clean = {k: json.loads((root / f"clean-{k}" / "summary.json").read_text()) for k in ("fsdp", "hsdp")}
        named = repaired = transient = 0
        for i, (name, (kind, change, suspect, suspects)) in enumerate(CASES.items()):
            run = root / f"case{i}"
            summary = json.loads((run / "summary.json").read_text())
            events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
            links = [e for e in events if e["detector"] == "collectives"]
            got = {(e["evidence"]["suspect"], tuple(e["evidence"]["suspects"])) for e in links}
            ok = bool(links) and got == {(suspect, tuple(suspects))}
            named += ok
            line = f"{name}: {len(links)} link events {sorted(got)}, outcome {summary['outcome']}"
            if change.get("schedule", {}).get("kind") == "permanent":
                ledger = json.loads((run / "ledger.json").read_text())
                pairs = {k: v["count"] for d in ledger["devices"].values() for k, v in d.get("links", {}).items()}
                line += f", ledger links {pairs}, stop: {summary.get('stop_reason')}"
            else:
                transient += 1
                same = summary["param_sha256"] == clean[kind]["param_sha256"]
                repaired += same
                line += f", final state {'==' if same else '!='} clean"
            print(line)
        print(
            f"localization: {named}/{len(CASES)} cases suspected as expected, "
            f"{repaired}/{transient} transient cases repaired bitwise"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="checked steps (as many unchecked ones interleaved)")
    ap.add_argument("--block", type=int, default=50, help="steps per timed block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--localize", action="store_true", help="the 4-rank localization cases instead")
    ap.add_argument(
        "--parallel", choices=("fsdp", "ep"), default="fsdp", help="FSDP2's collectives or the MoE's all-to-alls"
    )
    args = ap.parse_args(argv)
    if args.localize:
        localize()
        return
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, 2, (args.steps, args.block, args.threads, out, args.parallel), timeout_s=7200)
        records = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    ratios = {}
    for rec in records:
        wall = statistics.median(r["checked"][0] / r["base"][0] for r in rec["rows"])
        cpu = statistics.median(r["checked"][1] / r["base"][1] for r in rec["rows"])
        ms = statistics.median(r["base"][0] for r in rec["rows"]) / args.block * 1e3
        ratios[rec["rank"]] = (wall, cpu)
        print(f"rank {rec['rank']}: unchecked {ms:.1f} ms/step; checked/unchecked wall {wall:.3f}x, cpu {cpu:.3f}x")
    events = [e for rec in records for e in rec["events"]]
    for e in events[:20]:
        print("event:", json.dumps(e), file=sys.stderr)
    steps = records[0]["checked_steps"]
    links = records[0]["links"]
    margin = max(rec["margin"] for rec in records)
    wall, cpu = ratios[0]
    what = (
        f"links compared, reduce-scatter margin {margin:.2e}"
        if args.parallel == "fsdp"
        else "all-to-all links compared"
    )
    print(
        f"collective checks {args.parallel}/2: wall ratio {wall:.3f}, cpu ratio {cpu:.3f}; {len(events)} events over "
        f"{steps} clean steps ({links} {what})"
    )


if __name__ == "__main__":
    main()
