"""NonFiniteDetector: loss and gradients, one fused reduction, one sync on a clean step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import MLP, flip_bit
from sdcscope.detect import Event, NonFiniteConfig, NonFiniteDetector


def backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = nn.functional.cross_entropy(model(torch.randn(8, 12, generator=g)), torch.zeros(8, dtype=torch.long))
    loss.backward()
    return loss


def test_clean_step_no_event_and_single_sync(monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    det = NonFiniteDetector(model, rank=0)
    loss = backward(model)
    calls = []
    for name in ("item", "tolist", "__bool__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: calls.append(_n) or _o(self, *a, **k)
        )
    assert det.check(0, loss) == []
    assert len(calls) == 1
    flag = det.flag(loss)
    assert flag.dtype == torch.bool and flag.shape == ()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_named(bad):
    torch.manual_seed(0)
    model = MLP()
    loss = backward(model)
    model.fc2.weight.grad[1, 3] = bad
    events = NonFiniteDetector(model, rank=2).check(5, loss)
    assert len(events) == 1
    ev = events[0]
    assert (ev.step, ev.detector, ev.verdict, ev.module, ev.rank) == (5, "nonfinite", "nonfinite", "fc2", 2)
    assert ev.evidence["what"] == "grad" and ev.evidence["params"] == ["fc2.weight"]
    assert ev.evidence["count"] == 1 and ev.evidence["of"] == 4
    row = json.loads(json.dumps(ev.to_dict(), allow_nan=False))
    assert row["evidence"]["values"][0] in ("nan", "inf", "-inf")
    assert not NonFiniteDetector(model).flag(loss)


def test_huge_but_finite_gradient_is_not_nonfinite():
    torch.manual_seed(0)
    model = MLP()
    loss = backward(model)
    flip_bit(model.fc1.weight.grad, (0, 0), 30)  # finite, ~1e38: a sum of squares would overflow
    assert NonFiniteDetector(model).check(0, loss) == []


def test_nonfinite_loss_and_options():
    model = MLP()
    backward(model)
    events = NonFiniteDetector(model).check(1, torch.tensor(float("nan")))
    assert [e.evidence["what"] for e in events] == ["loss"]
    assert NonFiniteDetector(model, NonFiniteConfig(check_loss=False)).check(1, float("inf")) == []
    assert NonFiniteDetector(MLP()).check(0) == []  # no grads, no loss
    with pytest.raises(TypeError, match="check_grads"):
        NonFiniteConfig(check_grads="yes")


def test_event_validation():
    with pytest.raises(ValueError, match="gemm='fwd'.*forward, grad_input, grad_weight"):
        Event(0, "abft", "checksum_mismatch", gemm="fwd")
    ev = Event(
        3,
        "abft",
        "checksum_mismatch",
        module="fc1",
        gemm="forward",
        index=(1, None),
        evidence={"residual": float("-inf")},
    )
    assert ev.to_dict() == {
        "step": 3,
        "detector": "abft",
        "verdict": "checksum_mismatch",
        "module": "fc1",
        "gemm": "forward",
        "rank": None,
        "index": [1, None],
        "evidence": {"residual": "-inf"},
        "action": None,
    }


def test_the_nonfinite_gradient_nearest_the_output_is_named_first():
    """Gradients flow from the output back: a value gone non-finite in backward leaves the layers
    after it finite, so the last one in forward order is where it entered."""
    torch.manual_seed(0)
    model = MLP()
    loss = backward(model)
    model.fc1.weight.grad[0, 0] = float("nan")
    model.fc2.bias.grad[0] = float("inf")
    (ev,) = NonFiniteDetector(model).check(0, loss)
    assert ev.module == "fc2" and ev.evidence["params"] == ["fc2.bias", "fc1.weight"]
