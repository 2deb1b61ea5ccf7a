"""torchft replica groups under the guard: a permanent fault on one group, on CPU (gloo, loopback).

    python examples/torchft_replica_groups.py --groups 3 --steps 60 --fault-step 20 --out runs/ft

Starts torchft's Rust lighthouse and one process per replica group (a small MLP, each group its
own data, the guard with every GEMM checked: profile ``full``). From ``--fault-step`` on, one
element of the last Linear's forward GEMM output of group ``--fault-group`` has its exponent bit 30
flipped at every step. That group's guard vetoes the step (ABFT: the checksum fails again on
replay), no group commits it, and after the ledger's strikes (3 by default) the verdict is
``persistent``: the group shares its veto for that step, then leaves the quorum; the others train
on without it to the last step. Prints each group's committed steps and quorum sizes; each
group's ``events.jsonl`` and device ledger are in ``OUT/group<r>/`` (the ledger outlives the run:
with the same ``--out`` again, the faulty group's first finding is already ``persistent``). The
test ``tests/integrations/test_integrations_torchft.py`` runs it with 2 groups and 6 steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import sys
import time
from datetime import timedelta
from pathlib import Path
from queue import Empty

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.coordination import LighthouseServer

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.integrations.torchft import FTGuard


def _loss(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _sha(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def group(replica: int, args: argparse.Namespace, address, start, results) -> None:
    """One replica group's training: its model, guard, injector and torchft manager."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights in every group
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model, opt, GuardConfig.from_dict({"profile": "full"}), run_dir=f"{args.out}/group{replica}", loss_fn=_loss
    )
    fault = {
        "site": "gemm.forward",
        "target": "2",
        "model": "bitflip",
        "bits": [30],
        "pattern": {"kind": "element", "index": 1},
        "schedule": {"kind": "permanent", "start": args.fault_step},
        "seed": 1,
    }
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=args.timeout / 4)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t),
        min_replica_size=1,
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        replica_id=f"group{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=address.get(timeout=args.timeout),
        hostname="127.0.0.1",
        timeout=t,
        quorum_timeout=t,
        connect_timeout=t,
        init_sync=False,  # seeded alike
    )
    ft = FTGuard(guard, manager)
    start.wait(args.timeout)  # every manager heartbeats before the first quorum: it holds every group
    t0, hashes, sizes = time.perf_counter(), [], []
    specs = [FaultSpec.from_dict(fault)] if replica == args.fault_group else []
    with Injector(model, specs, opt) as inj:
        gen = torch.Generator().manual_seed(100 + replica)  # each group its own data
        for step in range(args.steps):
            batch = (torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen))
            inj.set_position(step)
            ft.begin(step, batch)
            loss = _loss(model, batch)
            loss.backward()
            ft.step(loss)
            sizes.append(manager.num_participants())
            hashes.append(_sha(model))
            if ft.left:
                break
    if not ft.left:
        manager.shutdown(wait=False)
    guard.close()
    results.put(
        {
            "group": replica,
            "committed": ft.committed,
            "left": ft.left,
            "quorum_sizes": sizes,
            "param_sha": hashes,
            "events": [(e["step"], e["detector"], e["verdict"], e["action"]) for e in guard.events],
            "seconds": round(time.perf_counter() - t0, 3),
        }
    )


def run(args: argparse.Namespace) -> list[dict]:
    """Every group's result, by group; a group's process that dies without one fails the run."""
    ctx = multiprocessing.get_context("fork")  # forked before the lighthouse's threads start
    start, address, results = ctx.Barrier(args.groups), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=group, args=(r, args, address, start, results)) for r in range(args.groups)]
    for p in procs:
        p.start()
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10, heartbeat_timeout_ms=300
    )
    got: list[dict] = []
    try:
        for _ in procs:
            address.put(lighthouse.address())
        deadline = time.monotonic() + args.timeout
        while len(got) < len(procs) and time.monotonic() < deadline:
            try:
                got.append(results.get(timeout=0.2))
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a replica group's process failed (exit codes {dead})") from None
        if len(got) < len(procs):
            raise RuntimeError(f"not every replica group finished within {args.timeout} s")
    finally:
        for p in procs:
            p.join(args.timeout)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return sorted(got, key=lambda r: r["group"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3, help="replica groups (processes)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-group", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a hung group fails the run")
    ap.add_argument("--out", default="runs/torchft")
    args = ap.parse_args(argv)
    if args.groups < 2 or not 0 <= args.fault_group < args.groups or not 0 <= args.fault_step < args.steps:
        ap.error("need --groups >= 2, 0 <= --fault-group < --groups and 0 <= --fault-step < --steps")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = run(args)
    for r in out:
        c = r["committed"]
        print(
            f"group {r['group']}: committed {len(c)} of {args.steps} steps (first missing: "
            f"{next((s for s in range(args.steps) if s not in c), None)}), quorum sizes "
            f"{sorted(set(r['quorum_sizes']))}, {r['seconds']} s; left: {r['left'] or 'no'}"
        )
    finished = {r["param_sha"][-1] for r in out if not r["left"]}
    print(f"the groups that finished hold {'the same' if len(finished) == 1 else 'DIFFERENT'} weights")
    (Path(args.out) / "groups.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
