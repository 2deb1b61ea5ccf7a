"""LRSchedule: shapes of torch's schedulers recognised; another learning rate or warm-up length
raises nothing, a warm-up that never ends or a scheduler that is never stepped does."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from sdcscope.invariants import InferConfig, InvariantChecker, TraceRecorder, check_trace, infer_invariants
from sdcscope.invariants.relations.schedule import classify, peak_index

STEPS = 12


def lrs(make, n=24):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=1.0), "constant"),
        (lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=40), "linear"),
        (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.95), "exponential"),
        (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30), "cosine"),
        (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=6, gamma=0.5), "step"),
        (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / math.sqrt(s + 1)), "decay"),
    ],
)
def test_shape_of_each_scheduler_is_recognised(make, shape):
    v = lrs(make)
    assert peak_index(v) == 0 and classify([x / v[0] for x in v]) == shape


def test_one_cycle_peaks_after_its_warm_up_then_anneals_as_a_cosine():
    v = lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=40), 40)
    p = peak_index(v)
    assert 8 <= p <= 12 and classify([x / v[p] for x in v[p:]]) == "cosine"


def warm_cosine(s: int, warm: int) -> float:
    """nanoGPT's schedule: a linear warm-up over ``warm`` steps, then a cosine to 0 at ``STEPS``."""
    if s < warm:
        return (s + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (s + 1 - warm) / (STEPS + 1 - warm)))


def run(attach, *, seed=0, lr=0.05, warm=3, stepped=True, start=0, restored=True):
    """A plain loop under ``warm_cosine`` (LambdaLR); returns the attached tool.  ``start``: the
    step a resumed run continues from, with its scheduler ``restored`` (or rebuilt: its warm-up
    starts again)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    offset = start if restored else 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warm_cosine(s + offset, warm))
    tool = attach(model, opt, schedulers=[sched])
    g = torch.Generator().manual_seed(seed)
    for step in range(start, STEPS):
        tool.step_begin(step)
        opt.zero_grad()
        x = torch.randn(16, 6, generator=g)
        nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)).backward()
        opt.step()
        if stepped:
            sched.step()
        tool.step_end()
    return tool


@pytest.fixture(scope="module")
def schedule(tmp_path_factory):
    refs = []
    for seed, lr in ((1, 0.05), (2, 0.03)):
        out = tmp_path_factory.mktemp(f"ref{seed}")
        tool = run(lambda m, o, **kw: TraceRecorder(m, o, out=out, **kw).attach(), seed=seed, lr=lr)
        tool.detach()
        refs.append(out)
    (inv,) = infer_invariants(refs, InferConfig(relations=("LRSchedule",)))
    return inv


def checked(inv, **kw):
    tool = run(lambda m, o, **k: InvariantChecker(m, o, [inv], **k).attach(), **kw)
    tool.detach()  # a warm-up still rising at the end is reported here
    return tool.violations


def test_learns_the_peak_and_the_cosine_shape(schedule):
    floor = warm_cosine(STEPS - 1, 3)  # the last step's fraction of the peak
    assert schedule.params == {
        "start": 0,
        "max_peak": 12,
        "min_steps": STEPS,
        "shape": "cosine",
        "floor": pytest.approx(floor, rel=1e-6),
    }


@pytest.mark.parametrize("kw", [{"lr": 0.2}, {"lr": 0.012, "seed": 7}, {"warm": 1}, {"warm": 8}])
def test_other_learning_rates_and_warm_ups_raise_nothing(schedule, kw):
    assert checked(schedule, **kw) == []


def test_a_warm_up_that_never_ends_is_flagged_when_the_run_ends(schedule, tmp_path):
    found = checked(schedule, warm=1000)  # warm-up counted in tokens, say: the LR rises to the end
    assert [(e["step"], e["evidence"]["rule"]) for e in found] == [(STEPS - 1, "warmup")]
    # offline, from the trace, likewise
    run(lambda m, o, **kw: TraceRecorder(m, o, out=tmp_path, **kw).attach(), warm=1000).detach()
    assert [e["evidence"]["rule"] for e in check_trace(tmp_path, [schedule])] == ["warmup"]


def test_a_warm_up_longer_than_allowed_is_flagged_while_it_runs(schedule):
    strict = dataclasses.replace(schedule, params={**schedule.params, "max_peak": 6})
    found = checked(strict, warm=1000)
    assert [(e["step"], e["evidence"]["rule"]) for e in found] == [(6, "warmup")]


def test_a_scheduler_never_stepped_stalls_the_decay(schedule):
    found = checked(schedule, stepped=False)
    assert {e["evidence"]["rule"] for e in found} == {"stall"} and found[0]["step"] == 2


def test_a_resume_past_the_warm_up_is_judged_on_a_restarted_warm_up_only(schedule):
    strict = dataclasses.replace(schedule, params={**schedule.params, "max_peak": 6})
    assert checked(strict, start=6) == []  # the schedule continues where it was
    found = checked(strict, start=6, restored=False)  # a rebuilt scheduler warms up again
    assert [(e["step"], e["evidence"]["rule"]) for e in found] == [(7, "rise")]
    assert "warm-up restarted" in found[0]["evidence"]["meaning"]
    assert checked(strict, start=3, restored=False) == []  # resumed within the allowed warm-up
