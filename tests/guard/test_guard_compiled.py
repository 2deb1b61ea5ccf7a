"""The guard on a ``torch.compile``d model (the engine's trainer with ``compile=True``, inductor): the
``full`` profile's ABFT checks every Linear inside the graph and an armed injector corrupts GEMMs
inside it, with no graph break; a forward, a dX and a dW bit flip are each caught in their step with
the layer and the GEMM named, and recomputed, so training ends bitwise where the clean compiled run
ends (the same compiled program from the same state, its faults disarmed: inductor may fuse a
different graph -- one without the injector's ops -- into a different rounding of the same sums)."""

import pytest
import torch
import torch._dynamo

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.inject import Injector
from sdcscope.jobs.assemble import guard_trainer
from sdcscope.workloads import WorkloadConfig, make_workload

FAULTS = {  # step: (site, layer)
    1: ("gemm.forward", "blocks.1.mlp.fc"),
    2: ("gemm.grad_input", "blocks.0.attn.q_proj"),
    3: ("gemm.grad_weight", "blocks.1.attn.o_proj"),
}
STEPS = 5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def specs():
    return [
        FaultSpec.from_dict(
            {
                "site": site,
                "target": layer,
                "model": "bitflip",
                "bits": [30],
                "pattern": {"kind": "element", "index": "random"},
                "schedule": {"kind": "transient", "step": step},
                "seed": step,
            }
        )
        for step, (site, layer) in FAULTS.items()
    ]


def train(trainer, guard, injector):
    for _ in range(STEPS):
        trainer.train_step()
    return list(guard.events), [p.detach().clone() for p in trainer.model.parameters()], list(injector.records)


def test_compiled_guard_catches_and_repairs_gemm_faults_without_graph_breaks():
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=4))
    trainer = Trainer(workload, TrainConfig(seed=0, compile=True))
    # three transient faults on one device in a few steps would make the ledger call it faulty: here
    # each is one event to repair. Metrics off: their probe tier, a flag their hooks read, compiles a
    # second variant of the graph (twice this test's compile time) and checks nothing
    guard = guard_trainer(trainer, GuardConfig(profile="full", ledger={"max_suspicions": 4}, metrics=None))
    injector = Injector(trainer.model, specs(), trainer.optimizer, graph=True, warn_unfired=False).attach()
    trainer.add_callback(injector.callback())
    callback = guard.callback(trainer)
    trainer.add_callback(callback)
    start = trainer.snapshot()
    breaks = torch._dynamo.explain(trainer.model)(workload.batch(0, 0)[0])
    assert (breaks.graph_count, breaks.graph_break_count) == (1, 0)

    events, params, records = train(trainer, guard, injector)
    assert sorted((r["step"], r["site"], r["module"]) for r in records) == sorted((s, *f) for s, f in FAULTS.items())
    caught = {(e["step"], e["module"], e["gemm"], e["action"]) for e in events if e["detector"] == "abft"}
    assert caught == {(step, layer, site.split(".")[1], "recompute") for step, (site, layer) in FAULTS.items()}
    assert all(e["evidence"]["replay"]["verdict"] == "transient" for e in events if e["detector"] == "abft")

    # the golden run: the same compiled program from the same state, its faults disarmed
    trainer.restore(start)
    callback.prime(trainer)  # the guard's checksums of the restored state
    guard.events.clear()
    injector.armed = False
    clean_events, golden, _ = train(trainer, guard, injector)
    injector.detach()
    guard.close()
    assert clean_events == []
    assert all(torch.equal(a, b) for a, b in zip(params, golden))
