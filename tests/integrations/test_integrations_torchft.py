"""torchft with the guard, through ``examples/torchft_replica_groups.py``: two replica groups (one
process each, gloo on loopback) and torchft's own Rust lighthouse. A permanent forward-GEMM fault
on group 1 is caught by its guard; no group commits a step group 1's guard vetoed, and the
ledger's persistent verdict takes group 1 out of the quorum, after which group 0 trains on alone
to the last step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torchft")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torchft_replica_groups.py"
STEPS, FAULT_STEP = 6, 2


def _example():
    spec = importlib.util.spec_from_file_location("torchft_replica_groups", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports torchft and the guard here: the forked groups inherit them
    return module


@pytest.mark.distributed
def test_a_vetoed_step_is_committed_by_no_replica_group_and_a_persistent_fault_leaves_the_quorum(tmp_path):
    example = _example()
    args = example.parse(["--groups", "2", "--steps", str(STEPS), "--fault-step", str(FAULT_STEP)])
    args.out, args.timeout = str(tmp_path), 60.0
    healthy, faulty = example.run(args)
    together = list(range(FAULT_STEP))
    assert healthy["committed"][:FAULT_STEP] == faulty["committed"] == together  # together until the fault ...
    assert FAULT_STEP not in healthy["committed"]  # ... whose step no group commits (nor the next two)
    assert healthy["param_sha"][: FAULT_STEP + 1] == faulty["param_sha"][: FAULT_STEP + 1]
    verdicts = [(step, verdict) for step, _, verdict, _ in faulty["events"]]
    assert verdicts[0] == (FAULT_STEP, "reproducible") and (FAULT_STEP + 2, "persistent") in verdicts
    assert verdicts[-1] == (FAULT_STEP + 2, "stopped") and "leaves the quorum" in faulty["left"]
    assert healthy["events"] == [] and healthy["left"] is None
    assert set(faulty["quorum_sizes"]) == {2} and healthy["quorum_sizes"][0] == 2  # one quorum until it left
    assert healthy["committed"][-1] == STEPS - 1 and healthy["quorum_sizes"][-1] == 1  # group 0 finishes alone
