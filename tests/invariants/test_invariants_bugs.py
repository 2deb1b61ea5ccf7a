"""A CI-sized slice of the silent-bugs benchmark (five bugs over two families, with clean twins), and
bugs of a plain loop with gradient accumulation that only call counts, confirmed updates and
repeats within a step reveal."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from helpers import DropoutMLP
from sdcscope.invariants import (
    Invariant,
    InvariantChecker,
    TraceConfig,
    TraceRecorder,
    infer_invariants,
)
from sdcscope.invariants.traceconfig import CONFIRM_EVERY

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "silent_bugs" / "run.py"
SUBSET = {  # bug -> the invariant that must catch it first
    "missing_zero_grad": "contain.step.cleared",
    "clip_wrong_params": "arg.train.clip_grad_norm_.params",
    "wrong_loss_reduction": "arg.train.backward.loss",
    "dropout_at_eval": "arg.eval.forward.Dropout.training",
    "replica_diverges": "consistent.replicas.0.*==replicas.1.*",
}


def load_bench():
    if "silent_bugs_run" not in sys.modules:
        spec = importlib.util.spec_from_file_location("silent_bugs_run", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules["silent_bugs_run"]


def test_references_never_share_seed_and_config_with_checked_runs():
    bench = load_bench()
    for family in bench.FAMILIES.values():
        for ref in family.references:
            assert ref["seed"] < 100 and ref.get("lr") != family.checked["lr"]


def test_subset_is_detected_and_clean_twins_raise_nothing(tmp_path):
    bench = load_bench()
    bugs = [b for b in bench.BUGS if b.name in SUBSET]
    results, _ = bench.run_benchmark(bugs, tmp_path, log=lambda *_: None)
    for r in results:
        assert r.detected, r.bug.name
        assert r.first["verdict"] == SUBSET[r.bug.name], (r.bug.name, r.first)
        assert r.clean_violations == [], (r.bug.name, r.clean_violations)
    by_name = {r.bug.name: r for r in results}
    assert by_name["replica_diverges"].first["step"] == 6
    assert by_name["dropout_at_eval"].first["step"] == 8
    assert "missing_zero_grad" in bench.table(results)
    assert (tmp_path / "gpt_loop" / "invariants.yaml").is_file()


# -- bugs of a plain loop with gradient accumulation that its clean twin does not show -----------
ACCUM = 2


def accum_run(attach, seed, bug=None, steps=8, lr=1e-2, accum=ACCUM):
    """Two micro-batches per step, weights and biases in two param groups, a scheduler, an
    evaluation every 4 steps and a longer one at the end; ``bug`` breaks the loop."""
    torch.manual_seed(seed)
    model = DropoutMLP()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "lr": {"group_lr_zero": 0.0, "group_lr_10x": 10 * lr}.get(bug, lr)}],
        lr=lr,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    tool = attach(model, opt, schedulers=[sched])
    for step in range(steps):
        tool.step_begin(step)
        opt.zero_grad()
        xs = [torch.randn(6, 8) for _ in range(accum)]
        if bug == "repeat_micro":
            xs[1] = xs[0]
        for micro, x in enumerate(xs):
            if bug == "zero_grad_per_micro" and micro:
                opt.zero_grad()
            loss = model(x).pow(2).mean() / accum
            loss.backward(retain_graph=bug == "double_backward")
            if bug == "double_backward":
                loss.backward()
            if bug == "sched_per_micro":
                sched.step()
        if bug == "replay" and step == 3:  # a guard's replay: gradients zeroed, the same batches again
            opt.zero_grad()
            for x in xs:
                (model(x).pow(2).mean() / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if bug == "double_step":
            opt.step()
        if bug == "retrain":  # the same batches trained on again: no replay, it comes after the update
            opt.zero_grad()
            for x in xs:
                (model(x).pow(2).mean() / accum).backward()
            opt.step()
        if bug != "sched_per_micro":
            sched.step()
        tool.step_end()
        if step % 4 == 3 or step == steps - 1:
            model.eval()
            with torch.no_grad():
                for _ in range(3 if step == steps - 1 else 1):
                    tool.log_metrics(val=model(torch.randn(6, 8)).pow(2).mean())
            model.train()
            tool.eval_end()
    tool.detach()
    return tool


@pytest.fixture(scope="module")
def accum_invariants(tmp_path_factory):
    root = tmp_path_factory.mktemp("accum")
    for seed, lr in ((1, 1e-2), (2, 5e-3)):
        accum_run(lambda m, o, **kw: TraceRecorder(m, o, out=root / str(seed), **kw).attach(), seed, lr=lr)
    return infer_invariants([root / "1", root / "2"])


def accum_check(invariants, bug=None, **options):
    return accum_run(
        lambda m, o, **kw: InvariantChecker(m, o, invariants, every_step=True, **kw).attach(),
        seed=7,
        bug=bug,
        lr=7e-3,
        **options,
    ).violations


def test_call_counts_are_learned_for_once_per_step_apis_and_per_forward_for_micro_batch_apis(accum_invariants):
    counts = {i.id: i.params["counts"] for i in accum_invariants if i.relation == "APICount"}
    assert counts == {
        "count.train.zero_grad": [1],
        "count.train.clip_grad_norm_": [1],
        "count.train.optimizer.step": [1],
        "count.train.lr_scheduler.step": [1],
    }
    inv = next(i for i in accum_invariants if i.id == "count.train.optimizer.step")
    assert inv.precondition.when == ("optimizer.step",)  # a step the scaler skipped is not judged
    (ratio,) = [i for i in accum_invariants if i.relation == "APICountRatio"]
    assert (ratio.id, ratio.params) == (
        "count.train.backward.per.forward",
        {"api": "backward", "per": "forward", "ratio": 1.0},
    )


@pytest.mark.parametrize("accum", [1, 3])
def test_another_number_of_micro_batches_is_no_violation(accum_invariants, accum):
    assert accum_check(accum_invariants, accum=accum) == []


@pytest.mark.parametrize("bug", [None, "replay"])
def test_clean_twin_and_a_replayed_step_raise_nothing(accum_invariants, bug):
    assert accum_check(accum_invariants, bug) == []


@pytest.mark.parametrize(
    "bug, api, expected, observed",
    [
        ("double_step", "optimizer.step", 1, 2),
        ("zero_grad_per_micro", "zero_grad", 1, 2),
        ("sched_per_micro", "lr_scheduler.step", 1, 2),
        ("retrain", "optimizer.step", 1, 2),
    ],
)
def test_an_api_called_more_often_than_in_the_references_is_reported(accum_invariants, bug, api, expected, observed):
    hits = [e for e in accum_check(accum_invariants, bug) if e["verdict"] == f"count.train.{api}"]
    assert [e["step"] for e in hits] == list(range(8))
    assert hits[0]["module"] == api
    assert (hits[0]["evidence"]["expected"], hits[0]["evidence"]["observed"]) == ([expected], observed)


def test_a_backward_run_twice_per_micro_batch_is_reported(accum_invariants):
    hits = [
        e
        for e in accum_check(accum_invariants, "double_backward")
        if e["verdict"] == "count.train.backward.per.forward"
    ]
    assert [e["step"] for e in hits] == list(range(8)) and hits[0]["module"] == "backward"
    assert hits[0]["evidence"]["observed"] == {"backward": 4, "forward": 2}


@pytest.mark.parametrize("bug", ["repeat_micro", "retrain"])
def test_a_micro_batch_reused_within_a_step_is_a_repeat(accum_invariants, bug):
    hits = [e for e in accum_check(accum_invariants, bug) if e["verdict"] == "arg.train.forward.input"]
    assert [(e["step"], e["evidence"]["first_seen_step"]) for e in hits] == [(s, s) for s in range(8)]


def test_a_param_group_with_learning_rate_0_is_not_updated(accum_invariants):
    hits = [
        e for e in accum_check(accum_invariants, "group_lr_zero") if e["verdict"] == "contain.optimizer.step.update"
    ]
    assert [e["step"] for e in hits] == list(range(0, 8, CONFIRM_EVERY))  # the confirmed steps
    assert hits[0]["module"] == "fc1.bias" and hits[0]["evidence"]["missing"] == ["fc1.bias", "fc2.bias"]
    lrs = [i.id for i in accum_invariants if i.id.startswith("arg.train.optimizer.step.")]
    assert lrs == [
        "arg.train.optimizer.step.group1.lr",
        "arg.train.optimizer.step.lr",
        "arg.train.optimizer.step.group1.lr.per.lr",
    ]


def test_a_param_group_with_10x_the_learning_rate_breaks_the_learned_ratio_not_the_range(accum_invariants):
    hits = accum_check(accum_invariants, "group_lr_10x")
    assert {e["verdict"] for e in hits} == {"arg.train.optimizer.step.group1.lr.per.lr"}
    assert [e["step"] for e in hits] == list(range(8))
    assert hits[0]["evidence"]["expected_ratio"] == pytest.approx(1.0)
    assert hits[0]["evidence"]["observed_ratio"] == pytest.approx(10.0)


@pytest.mark.parametrize("confirm, updated", [(True, "0x5"), (False, "0xf")])
def test_an_update_is_confirmed_by_the_parameters_bits_only_when_configured(confirm, updated):
    model = DropoutMLP()
    opt = torch.optim.SGD(
        [{"params": [model.fc1.weight, model.fc2.weight]}, {"params": [model.fc1.bias, model.fc2.bias], "lr": 0.0}],
        lr=0.1,
    )
    rec = TraceRecorder(model, opt, config=TraceConfig(confirm_updates=confirm)).attach()
    for step in range(CONFIRM_EVERY + 1):
        rec.step_begin(step)
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        (r,) = rec.step_end()
        assert r["effects"]["update"] == (updated if step % CONFIRM_EVERY == 0 else "0xf")
    rec.detach()
    assert dict(r["calls"])["optimizer.step"] == {"lr": 0.1, "group1.lr": 0.0}


def test_the_checker_reads_parameter_bits_only_for_an_update_invariant():
    model = DropoutMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    count = Invariant(id="c", relation="APICount", params={"api": "optimizer.step", "counts": [1]})
    update = Invariant(
        id="u", relation="EventContain", params={"parent": "optimizer.step", "child": "update", "tensors": ["*"]}
    )
    config = InvariantChecker(model, opt, [count]).recorder.config
    assert (config.confirm_updates, config.input_fingerprint) == (False, True)
    assert InvariantChecker(model, opt, [update]).recorder.config.confirm_updates
