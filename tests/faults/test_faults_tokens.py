"""Token faults of an MoE dispatch: ``drop`` zeroes one slot's row, ``duplicate`` puts the next
slot's row in its place; both need site ``dispatch`` and a whole-row pattern."""

from __future__ import annotations

import pytest
import torch

from sdcscope.faults import FaultSpec, FaultSpecError, apply_spec, fault_generator


def _spec(model: str, **kw) -> FaultSpec:
    return FaultSpec(site="dispatch", target="d", model=model, schedule={"kind": "transient", "step": 0}, **kw)


@pytest.mark.parametrize("model", ["drop", "duplicate"])
def test_token_fault_rewrites_exactly_one_slot(model):
    rows = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    clean = rows.clone()
    result = apply_spec(_spec(model, pattern={"kind": "row", "index": 4}), rows, torch.Generator())
    want = torch.zeros(4) if model == "drop" else clean[0]  # the last slot's next is the first
    assert torch.equal(rows[4], want) and torch.equal(rows[:4], clean[:4])
    assert result.index.tolist() == [16, 17, 18, 19]
    assert torch.equal(result.before, clean[4]) and torch.equal(result.after, want)


def test_token_fault_default_pattern_is_one_random_slot():
    spec = _spec("drop")
    assert spec.pattern.kind == "row" and spec.pattern.index == "random"
    rows = torch.ones(6, 3)
    apply_spec(spec, rows, fault_generator(spec, 0, 0, "d", 0))
    assert int((rows == 0).all(1).sum()) == 1


def test_token_models_are_refused_off_the_dispatch_site_and_off_whole_rows():
    with pytest.raises(ValueError, match="needs site 'dispatch'"):
        FaultSpec(site="activation", target="d", model="drop", schedule={"kind": "transient", "step": 0})
    with pytest.raises(ValueError, match="pattern kind 'row'"):
        _spec("duplicate", pattern={"kind": "column"})
    with pytest.raises(FaultSpecError, match="dispatched rows"):
        apply_spec(_spec("drop"), torch.ones(4), torch.Generator())
