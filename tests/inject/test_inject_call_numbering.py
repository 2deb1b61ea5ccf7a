"""The injector's records and ABFT's events number a shared module's calls alike: ``call`` is the
0-based forward call within the micro-batch, and the dX/dW of forward call i are call i; a GEMM with
no work (an MoE expert routed no token) takes no fault and a transient waits for work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdcscope.detect import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector


class Shared(nn.Module):
    """One Linear called twice per forward; ``between`` runs between the two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.between = None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.between is not None:
            self.between()
        return self.lin(h)


def _spec(site, kind="transient", micro_batch=0):
    schedule = (
        {"kind": "transient", "step": 0, "micro_batch": micro_batch}
        if kind == "transient"
        else {"kind": "permanent", "start": 0}
    )
    return FaultSpec.from_dict(
        {
            "site": site,
            "target": "lin",
            "model": "bitflip",
            "bits": [31],
            "pattern": {"kind": "element", "index": 3},
            "schedule": schedule,
        }
    )


def _run(spec, *, micro=1, second_only=False):
    """(injector records, ABFT events) as {(micro_batch, call)}, after one step of ``micro``
    micro-batches; ``second_only``: the injector is armed only from the module's second call on."""
    torch.manual_seed(0)
    model = Shared()
    xs = torch.randn(micro, 4, 6, requires_grad=True)  # dX of the first call exists
    inj = Injector(model, [spec]).attach()
    det = ABFTDetector(model, ABFTConfig(checksums="both")).attach()  # after the injector
    det.begin_step(0)
    for mb in range(micro):
        inj.set_position(0, mb)
        if second_only:
            inj.armed = False
            model.between = lambda: setattr(inj, "armed", True)
        model(xs[mb]).square().sum().backward()
    events = det.check(0)
    inj.close()
    gemm = {"gemm.forward": "forward"}.get(spec.site, spec.site[5:])
    assert events and all(e.module == "lin" and e.gemm == gemm for e in events), events
    return (
        {(r["micro_batch"], r["call"]) for r in inj.records},
        {(e.evidence["micro_batch"], e.evidence["call"]) for e in events},
    )


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight"])
def test_injector_and_abft_number_a_shared_modules_calls_alike(site):
    # a transient fault acts once: on the first forward call, or on the first backward call --
    # the gradient of the second forward call
    first = 0 if site == "gemm.forward" else 1
    records, events = _run(_spec(site))
    assert records == events == {(0, first)}
    # every call: numbered by its forward call, whatever order the backward runs them in
    records, events = _run(_spec(site, "permanent"))
    assert records == events == {(0, 0), (0, 1)}


def test_the_second_forward_call_is_call_1_for_both():
    records, events = _run(_spec("gemm.forward"), second_only=True)
    assert records == events == {(0, 1)}


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_weight"])
def test_calls_are_counted_within_each_micro_batch(site):
    """ABFT counted calls from 1 over every micro-batch since the last check (call 4 here)."""
    first = 0 if site == "gemm.forward" else 1
    records, events = _run(_spec(site, micro_batch=1), micro=2)
    assert records == events == {(1, first)}
    records, events = _run(_spec(site, "permanent"), micro=2)
    assert records == events == {(0, 0), (0, 1), (1, 0), (1, 1)}


# -- a GEMM with no work (an MoE expert routed no token) takes no fault ----------------------------
@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight", "activation"])
def test_an_empty_call_takes_no_fault_and_a_transient_waits_for_work(site):
    torch.manual_seed(0)
    expert = nn.Linear(4, 4)
    net = nn.ModuleDict({"expert": expert})
    spec = FaultSpec.from_dict(
        {
            "site": site,
            "target": "expert",
            "model": "bitflip",
            "bits": [30],
            "seed": 1,
            "schedule": {"kind": "transient", "step": 0},
        }
    )
    inj = Injector(net, [spec]).attach()
    inj.set_position(0)
    x = torch.randn(3, 4, requires_grad=True)
    (expert(x[:0]).sum() + expert(x).square().sum()).backward()  # the first call gets no token
    (rec,) = inj.records
    assert rec["call"] == 1 and rec["count"] == 1
    inj.set_position(1)
    expert(x[:0]).sum().backward()
    assert len(inj.records) == 1
