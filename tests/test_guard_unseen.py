"""The Guard and its ABFT detector on models, dtypes and loops the other tests leave out: a float64
default dtype, a GradScaler whose overflow a fault caused, and the errors a wrong nested config
value gives."""

import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector


def batch_of(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 12, generator=g)
    return x, x[:, :4].argmax(1)


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def flip(site: str, step: int, bit: int) -> FaultSpec:
    return FaultSpec(site=site, target="2", model="bitflip", bits=(bit,),
                     pattern={"kind": "element", "index": "random"},
                     schedule={"kind": "transient", "step": step}, seed=1)


def train(model, opt, guard, inj, steps, loss_fn=ce, scale=None):
    for step in range(steps):
        if inj is not None:
            inj.set_position(step)
        batch = batch_of(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            (loss if scale is None else scale(loss)).backward()
        guard.optimizer_step(loss)
    return [(e["step"], e["detector"], e["verdict"], e.get("module"), e.get("gemm"), e["action"])
            for e in guard.events]


# -- 1. a model built under torch.set_default_dtype(torch.float64) ---------------------------------
@pytest.mark.parametrize("fault", [False, True])
def test_abft_checks_a_model_built_under_a_float64_default_dtype(fault):
    """ABFT's fused judgement built its result vector in the default dtype: under a float64
    default every check raised (an ``internal_error`` event each step, no GEMM checked)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        inj = Injector(model, [flip("gemm.forward", 3, 62)], opt).attach() if fault else None
        guard = Guard(model, opt, GuardConfig(metrics=None), run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
        events = train(model, opt, guard, inj, 5)
        guard.close()
    finally:
        torch.set_default_dtype(old)
    assert guard.abft.checks_run > 0
    assert [e for e in events if e[1] == "abft"] == ([(3, "abft", "transient", "2", "forward", "recompute")]
                                                      if fault else [])
    assert not [e for e in events if e[1] == "guard"]


# -- 2. a fault whose huge value overflows downstream under a GradScaler ---------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_fault_that_overflows_downstream_under_a_gradscaler_is_found_and_recomputed(dtype):
    """A flip of dX's top exponent bit gives a finite, huge dX that overflows the gradients of the
    layers below: the guard took it for the scaler's own overflow and skipped the step without
    an event (and backed the scale off). ABFT's finite mismatch shows a fault: it is replayed
    and recomputed like any other; the scaler's natural overflows stay silent."""
    def amp_ce(model, batch):
        with torch.autocast("cpu", dtype=dtype):
            return ce(model, batch)

    def run(fault: bool):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        inj = Injector(model, [flip("gemm.grad_input", 5, 14)], opt).attach() if fault else None
        guard = Guard(model, opt, GuardConfig(), run_dir=tempfile.mkdtemp(), loss_fn=amp_ce,
                      scaler=scaler).attach()
        events = train(model, opt, guard, inj, 7, loss_fn=amp_ce, scale=scaler.scale)
        guard.close()
        if inj is not None:
            (rec,) = inj.records
            assert abs(rec["after"][0]) > 1e4   # finite: the flip itself is no overflow
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), events, guard

    clean, clean_scale, clean_events, _ = run(False)
    got, scale, events, guard = run(True)
    assert clean_events == []
    assert (5, "abft", "transient", "2", "grad_input", "recompute") in events
    assert {e[0] for e in events} == {5} and {e[5] for e in events} == {"recompute"}
    assert guard.discarded_steps == 0 and scale == clean_scale
    assert all(torch.equal(a, b) for a, b in zip(clean, got))


# -- 3. nested config errors name their section ----------------------------------------------------
@pytest.mark.parametrize("data,needle", [
    ({"abft": {"c": -1}}, r"^guard abft: c=-1 must be a finite number > 0"),
    ({"abft": {"every": 0}}, r"^guard abft: every=0 must be a positive integer"),
    ({"abft": {"checksums": "diag"}}, r"^guard abft: unknown checksums 'diag'; allowed: both, row, column"),
    ({"loss_spike": {"window": 0}}, r"^guard loss_spike: window=0"),
    ({"grad_spike": {"window": 0}}, r"^guard grad_spike: window=0"),
    ({"metrics": {"stats_every": -1}}, r"^guard metrics: stats_every=-1"),
    ({"abft": {"chcksums": "both"}}, r"^unknown abft key 'chcksums' \(did you mean 'checksums'\?\)"),
    ({"snapshots": {"every": 0}}, r"^snapshot every=0"),
])
def test_a_bad_nested_config_value_names_its_section(data, needle):
    with pytest.raises(ValueError, match=needle):
        GuardConfig.from_dict(data)


def test_a_guard_used_without_attach_attaches_at_its_first_step():
    """``guard.step()`` on a guard never attached: ABFT's hooks (registered on attach) would be
    missing and every GEMM unchecked while the other detectors ran; the first step attaches."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, GuardConfig(), run_dir=tempfile.mkdtemp(), loss_fn=ce)
    inj = Injector(model, [flip("gemm.forward", 3, 30)], opt).attach()
    events = train(model, opt, guard, inj, 5)
    assert guard.abft.checks_run > 0
    assert [(s, d, m, g) for s, d, _, m, g, _ in events if d == "abft"] == [(3, "abft", "2", "forward")]


def test_the_default_guard_under_a_float64_default_dtype_raises_no_internal_error():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = Guard(model, opt, GuardConfig(), run_dir=tempfile.mkdtemp(), loss_fn=ce).attach()
        assert train(model, opt, guard, None, 3) == []   # stable rank (step 0) included
    finally:
        torch.set_default_dtype(old)
