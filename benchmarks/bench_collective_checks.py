"""The price and the false-alarm record of the exact collective checks on FSDP2 (fsdp/2, gloo, CPU).

    python benchmarks/bench_collective_checks.py                       # 2,000 checked + 2,000 unchecked steps
    python benchmarks/bench_collective_checks.py --steps 200 --block 20  # a quick look

Two ranks train the GPT (tiny preset) split by ``fully_shard`` (each block, then the root: the
``--parallel fsdp`` layout) in one plain loop. Blocks of ``--block`` steps alternate between the
unchecked loop and the same loop with :class:`~sdcscope.detect.collectives.CollectiveCheck`
attached (every parameter all-gather, forward and backward re-gather, compared exactly; every
gradient reduce-scatter against its rounding bound; one gather of words per step), on the same
model, so both sides see the same machine load. Per pair of blocks the checked / unchecked
ratio of the wall time and of the process CPU time (rank 0's; the other rank's is printed too);
the median over the pairs.

The checked steps are clean steps: every finding would be a false event. The script prints the
events, the all-gather links compared (the exact check cannot false-alarm: a clean link carries
the sender's bits, so its digest is the sender's), and the largest reduce-scatter residual as a
fraction of its bound. Last line: ``collective checks fsdp/2: wall ratio W, cpu ratio C; N
events over S clean steps (L links compared, reduce-scatter margin M)``.
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


def _rank(rank: int, size: int, steps: int, block: int, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    init_distributed(DistConfig(backend="gloo", timeout_s=300))
    wl = make_workload(WORKLOAD)
    torch.manual_seed(0)
    model = wl.build_model()
    topology = Topology(kind="fsdp")
    topology.apply(model, topology.build_mesh(size, "cpu"), wl)
    opt = wl.build_optimizer(model)
    check = CollectiveCheck(model, CollectivesConfig())
    step, events, rows = 0, [], []

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

    run(False)  # warm-up (FSDP2's lazy init, allocator)
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
        "links": check.links_compared,
        "margin": check.scatter_margin,
        "checked_steps": len(rows) * block,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="checked steps (as many unchecked ones interleaved)")
    ap.add_argument("--block", type=int, default=50, help="steps per timed block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, 2, (args.steps, args.block, args.threads, out), timeout_s=7200)
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
    print(
        f"collective checks fsdp/2: wall ratio {wall:.3f}, cpu ratio {cpu:.3f}; {len(events)} events over "
        f"{steps} clean steps ({links} links compared, reduce-scatter margin {margin:.2e})"
    )


if __name__ == "__main__":
    main()
