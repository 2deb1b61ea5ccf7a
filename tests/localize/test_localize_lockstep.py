"""Lock-step localization: every single flip in a forward or backward GEMM is named exactly."""

import pytest
import torch

from sdcscope.engine import TrainConfig, Trainer
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector, is_gemm
from sdcscope.localize import diff, first_divergence, lockstep, replica
from sdcscope.workloads import WorkloadConfig, make_workload

STEP = 3
DIRECTION = {
    "gemm.forward": ("forward", "forward"),
    "gemm.grad_input": ("backward", "grad_input"),
    "gemm.grad_weight": ("backward", "grad_weight"),
}


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    workload = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, eval_batches=1))
    trainer = Trainer(workload, TrainConfig())
    for _ in range(STEP):
        trainer.train_step()
    batch = workload.batch(0, STEP)
    yield trainer, batch
    torch.set_num_threads(threads)


def _fns(trainer, batch, spec):
    model = trainer.model

    def healthy():
        trainer.workload.loss(model, batch).backward()

    def faulty():
        with Injector(model, [spec], trainer.optimizer) as injector:
            injector.set_position(STEP, 0)
            healthy()
            faulty.records = injector.records

    return healthy, faulty


GEMMS = [
    "blocks.0.attn.q_proj",
    "blocks.0.attn.k_proj",
    "blocks.0.attn.v_proj",
    "blocks.0.attn.o_proj",
    "blocks.0.attn.score",
    "blocks.0.attn.context",
    "blocks.0.mlp.fc",
    "blocks.0.mlp.proj",
    "blocks.1.attn.q_proj",
    "blocks.1.attn.k_proj",
    "blocks.1.attn.v_proj",
    "blocks.1.attn.o_proj",
    "blocks.1.attn.score",
    "blocks.1.attn.context",
    "blocks.1.mlp.fc",
    "blocks.1.mlp.proj",
    "head",
]


def test_grid_covers_every_gemm(setup):
    trainer, _ = setup
    assert sorted(GEMMS) == sorted(n for n, m in trainer.model.named_modules() if n and is_gemm(m))


@pytest.mark.parametrize("site", sorted(DIRECTION))
def test_first_divergence_names_module_and_direction(setup, site):
    trainer, batch = setup
    for k, target in enumerate(GEMMS):
        bit = (3, 17, 29)[k % 3]  # mantissa low, mantissa high, exponent
        spec = FaultSpec(
            site=site, target=target, model="bitflip", bits=[bit], schedule={"kind": "transient", "step": STEP}, seed=k
        )
        healthy, faulty = _fns(trainer, batch, spec)
        d = first_divergence(healthy, faulty, trainer.model)
        assert len(faulty.records) == 1, (site, target)
        direction, gemm = DIRECTION[site]
        assert d is not None, (site, target)
        assert (d.module, d.direction, d.gemm) == (target, direction, gemm), (site, target, d)
        assert d.count == 1 and d.magnitude > 0
        rec = faulty.records[0]
        assert d.suspect == pytest.approx(rec["after"][0]) and d.reference == pytest.approx(rec["before"][0])


def test_lockstep_sync_confines_mismatch_to_the_faulty_module(setup):
    trainer, batch = setup
    spec = FaultSpec(
        site="gemm.forward",
        target="blocks.0.mlp.fc",
        model="bitflip",
        bits=[30],
        schedule={"kind": "transient", "step": STEP},
        seed=5,
    )
    healthy, faulty = _fns(trainer, batch, spec)
    synced = lockstep(healthy, faulty, trainer.model, sync=True)
    assert [(e.module, e.direction) for e in synced.mismatched] == [("blocks.0.mlp.fc", "forward")]
    e = synced.mismatched[0]
    assert e.count == 1 and e.frequency == 1 / e.numel and e.severity > 1
    assert synced.by_module() == {
        "blocks.0.mlp.fc": {"forward": {"frequency": e.frequency, "severity": e.severity, "magnitude": e.magnitude}}
    }
    free = lockstep(healthy, faulty, trainer.model, sync=False)
    assert free.first.module == "blocks.0.mlp.fc" and len(free.mismatched) > 10  # the error spreads


def test_lockstep_restores_grads_and_rng(setup):
    trainer, batch = setup
    model = trainer.model
    marker = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, m in zip(model.parameters(), marker):
        p.grad = m
    rng = torch.get_rng_state()
    spec = FaultSpec(
        site="gemm.grad_input",
        target="head",
        model="bitflip",
        bits=[30],
        schedule={"kind": "transient", "step": STEP},
        seed=1,
    )
    lockstep(*_fns(trainer, batch, spec), model)
    assert all(p.grad is m for p, m in zip(model.parameters(), marker))
    assert torch.equal(torch.get_rng_state(), rng)
    for p in model.parameters():
        p.grad = None


def test_higher_precision_reference(setup):
    trainer, batch = setup
    model, loss = trainer.model, trainer.workload.loss
    ref = replica(model)
    assert next(ref.parameters()).dtype == torch.float64

    def reference():
        loss(ref, batch).backward()

    def suspect():
        loss(model, batch).backward()

    assert first_divergence(reference, suspect, ref, model, atol=1e-5, rtol=1e-3) is None
    spec = FaultSpec(
        site="gemm.forward",
        target="blocks.1.attn.v_proj",
        model="bitflip",
        bits=[30],
        schedule={"kind": "transient", "step": STEP},
        seed=2,
    )
    _, faulty = _fns(trainer, batch, spec)
    d = first_divergence(reference, faulty, ref, model, atol=1e-5, rtol=1e-3)
    assert (d.module, d.direction) == ("blocks.1.attn.v_proj", "forward")


def test_diff_exact_and_tolerant():
    a = torch.tensor([1.0, 0.0, float("nan"), 2.0])
    b = torch.tensor([1.0, -0.0, float("nan"), 2.0 + 1e-6])
    exact = diff(b, a)
    assert exact.count == 2 and sorted(exact.index) == [[1], [3]]  # -0.0 and the ulp differ bitwise
    assert diff(b, a, atol=1e-5).count == 0
    shape = diff(torch.zeros(3), torch.zeros(4))
    assert shape.count == 3 and shape.magnitude == float("inf")
