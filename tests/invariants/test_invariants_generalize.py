"""LossTrend judged at the references' progress: a run with a lower learning rate or a longer
warm-up is judged later (once its summed learning rates catch up), and a loss that does not
improve is still reported (synthetic traces: loss = exp(-lr summed over the steps so far))."""

from __future__ import annotations

import dataclasses
import math

from sdcscope.invariants import InferConfig, Trace, check_trace, infer_invariants

STEPS = 24


def trace(lrs, *, rate=1.0, stuck=False):
    """A run whose loss falls as exp(-rate x the learning rates summed before the step)."""
    records, tau = [], 0.0
    for step, lr in enumerate(lrs):
        loss = 4.0 if stuck else 4.0 * math.exp(-rate * tau)
        calls = [["backward", {"loss": loss}], ["optimizer.step", {"lr": lr}]]
        records.append({"step": step, "phase": "train", "calls": calls, "metrics": {}})
        tau += lr
    return Trace(header={"kind": "header", "params": ["w"]}, records=records, source="synthetic")


def warm(peak, steps_up):
    return [peak * min(1.0, (s + 1) / steps_up) for s in range(STEPS)]


def trend():
    refs = [trace([0.03] * STEPS), trace([0.02] * STEPS)]
    (inv,) = infer_invariants(refs, InferConfig(relations=("LossTrend",)))
    return inv


def test_the_slowest_references_progress_at_the_learned_step_is_learned():
    inv = trend()
    # The first judged window (steps 4..7, from step 0 on) starts after 4 steps at 0.02.
    assert inv.params["from_step"] == 0 and math.isclose(inv.params["from_lr_sum"], 4 * 0.02)


def test_a_lower_learning_rate_or_a_longer_warm_up_is_judged_at_the_same_progress():
    inv = trend()
    for lrs in ([0.007] * STEPS, warm(0.02, 16), warm(0.007, 20)):
        assert check_trace(trace(lrs), [inv]) == []
    # Judged by steps alone (the learned sum taken away), the slow run looks stuck.
    by_steps = dataclasses.replace(inv, params={**inv.params, "from_lr_sum": 0.0})
    assert [e["verdict"] for e in check_trace(trace([0.007] * STEPS), [by_steps])][:1] == ["trend.train.loss"]


def test_a_loss_that_does_not_improve_is_reported_once_the_progress_is_due():
    inv = trend()
    (fast,) = check_trace(trace([0.03] * STEPS, stuck=True), [inv], every_step=False)
    (slow,) = check_trace(trace([0.01] * STEPS, stuck=True), [inv], every_step=False)
    assert fast["step"] == 2 * 4 - 1 and slow["step"] > fast["step"]
