"""torchft with the guard: two replica groups (one process each, gloo on loopback) and torchft's
own Rust lighthouse. A permanent forward-GEMM fault on group 1 is caught by its guard; no group
commits a step group 1's guard vetoed, and the ledger's persistent verdict takes group 1 out of
the quorum, after which group 0 trains on alone to the last step."""

from __future__ import annotations

import hashlib
import multiprocessing
import time
from datetime import timedelta
from queue import Empty

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

from torch.distributed import TCPStore  # noqa: E402 -- imported here, the forked groups inherit them
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

from sdcscope.faults import FaultSpec  # noqa: E402
from sdcscope.guard import Guard, GuardConfig  # noqa: E402
from sdcscope.inject import Injector  # noqa: E402
from sdcscope.integrations.torchft import FTGuard  # noqa: E402

STEPS, FAULT_STEP, FAULTY = 6, 2, 1
TIMEOUT_S = 60  # a hung collective or quorum fails the test instead of blocking it


def _sha(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def _group(replica: int, address, run_dir: str, start, results) -> None:
    """One replica group: a tiny MLP, its guard (every GEMM checked), torchft's manager."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights in every group
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    guard = Guard(model, opt, GuardConfig.from_dict({"profile": "full"}), run_dir=run_dir, loss_fn=loss_fn)
    spec = FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "2",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": 1},
            "schedule": {"kind": "permanent", "start": FAULT_STEP},
            "seed": 1,
        }
    )
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=TIMEOUT_S // 4)
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
        lighthouse_addr=address.get(timeout=TIMEOUT_S),
        hostname="127.0.0.1",
        timeout=t,
        quorum_timeout=t,
        connect_timeout=t,
        init_sync=False,  # seeded alike
    )
    ft = FTGuard(guard, manager)
    start.wait(TIMEOUT_S)  # both managers heartbeat before the first quorum: it holds both groups
    hashes, participants = [], []
    with Injector(model, [spec] if replica == FAULTY else [], opt) as inj:
        gen = torch.Generator().manual_seed(100 + replica)  # each group its own data
        for step in range(STEPS):
            batch = (torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen))
            inj.set_position(step)
            ft.begin(step, batch)
            loss = loss_fn(model, batch)
            loss.backward()
            ft.step(loss)
            participants.append(manager.num_participants())
            hashes.append(_sha(model))
            if ft.left:
                break
    if not ft.left:
        manager.shutdown(wait=False)
    guard.close()
    results.put(
        (replica, ft.committed, ft.left, participants, hashes, [(e["step"], e["verdict"]) for e in guard.events])
    )


def _results(queue, procs):
    """Each group's result, failing at once when a group's process dies without one."""
    deadline = time.monotonic() + TIMEOUT_S
    got = []
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            got.append(queue.get(timeout=0.2))
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a replica group's process failed (exit codes {dead}); its traceback is above"
    assert len(got) == len(procs), f"no result from every group within {TIMEOUT_S} s"
    return [(r[0], r[1:]) for r in got]


@pytest.mark.distributed
def test_a_vetoed_step_is_committed_by_no_replica_group_and_a_persistent_fault_leaves_the_quorum(tmp_path):
    ctx = multiprocessing.get_context("fork")  # forked before the lighthouse's threads start
    start, address, results = ctx.Barrier(2), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_group, args=(r, address, str(tmp_path / f"group{r}"), start, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10, heartbeat_timeout_ms=300
    )
    try:
        for _ in procs:
            address.put(lighthouse.address())
        out = dict(_results(results, procs))
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    (healthy, h_left, h_parts, h_hashes, h_events), (faulty, f_left, f_parts, f_hashes, f_events) = out[0], out[1]
    assert healthy[:FAULT_STEP] == faulty == list(range(FAULT_STEP))  # together until the fault ...
    assert FAULT_STEP not in healthy  # ... whose step no group commits
    assert h_hashes[: FAULT_STEP + 1] == f_hashes[: FAULT_STEP + 1]
    assert f_left and "leaves the quorum" in f_left and h_left is None
    assert (4, "persistent") in f_events and f_events[-1] == (4, "stopped") and not h_events
    assert f_parts == [2] * len(f_parts) and h_parts[0] == 2  # both groups in every quorum until it left
    assert healthy[-1] == STEPS - 1 and h_parts[-1] == 1  # group 0 finishes alone
