"""``sdcscope invariants check`` prints a violation of every relation kind (it raised
``KeyError: 'value'`` on an initial-loss or grad-share violation): one recorded trace that
breaks one invariant of each relation, checked offline through the command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import sdcscope.cli.invariants_cmd  # noqa: F401  (registers the commands)
from sdcscope.cli.app import app
from sdcscope.invariants import RELATIONS, Invariant, Precondition, save_invariants
from sdcscope.invariants.traceconfig import TRACE_FILE, TRACE_FORMAT

HEADER = {
    "kind": "header",
    "format": TRACE_FORMAT,
    "rank": 0,
    "model": "Net",
    "optimizer": "AdamW",
    "params": ["a.weight", "b.weight"],
    "trainable": "0x3",
    "in_optimizer": "0x3",
    "watched": ["a.weight", "b.weight"],
    "shapes": [[2], [2]],
    "dtypes": ["float32", "float32"],
    "mode_modules": {"Dropout.training": ["drop"]},
    "schedulers": [],
    "scaler": False,
}
EFFECTS = {"grad": "0x3", "update": "0x3", "cleared": "0x3", "outside": "0x0"}

# relation: (params, precondition, [(what a record adds to a plain step, ...)], words the line shows)
CASES = {
    "Consistent": ({"a": "a.*", "b": "b.*"}, {}, [{"checksums": [1, 2]}], "pairs differ"),
    "EventContain": (
        {"parent": "optimizer.step", "child": "update", "tensors": ["*"]},
        {},
        [{"effects": {**EFFECTS, "update": "0x1"}}],
        "missing: b.weight",
    ),
    "ExclusiveWrite": ({"tensors": ["*"]}, {}, [{"effects": {**EFFECTS, "outside": "0x2"}}], "outside"),
    "APISequence": (
        {"apis": ["zero_grad", "backward", "optimizer.step"]},
        {},
        [
            {
                "calls": [["backward", {"loss": 1.0}], ["optimizer.step", {"lr": 0.1}]],
                "effects": {**EFFECTS, "cleared": None},
            }
        ],
        "missing: zero_grad",
    ),
    "APICount": ({"api": "backward", "counts": [2]}, {}, [{}], "expected [2], observed 1"),
    "APICountRatio": (
        {"api": "backward", "per": "forward", "ratio": 0.5},
        {},
        [{}],
        "expected ratio 0.5",
    ),
    "APIArg": ({"api": "backward", "arg": "loss", "mode": "range", "bounds": [2.0, 3.0]}, {}, [{}], "outside"),
    "APIOutput": (
        {"api": "forward", "output": "out.dtype", "mode": "constant", "value": "bfloat16"},
        {},
        [{}],
        "expected bfloat16, observed float32",
    ),
    "APIArgRatio": (
        {"api": "optimizer.step", "arg": "group1.lr", "base": "lr", "ratio": 1.0},
        {},
        [{"calls": [["forward", {}], ["backward", {"loss": 1.0}], ["optimizer.step", {"lr": 0.1, "group1.lr": 1.0}]]}],
        "expected ratio 1",
    ),
    "MetricBound": ({"metric": "grad_norm", "bounds": [0.0, 1.0]}, {}, [{"metrics": {"grad_norm": 7.0}}], "7 outside"),
    "MetricTrend": (
        {"metric": "val_loss", "direction": "down"},
        {"phase": "eval"},
        [{"phase": "eval", "calls": [], "metrics": {"val_loss": v}} for v in (1.0, 2.0)],
        "worse",
    ),
    "InitialLoss": ({"step": 0, "bounds": [2.0, 3.0]}, {"when": ["backward"]}, [{}], "1 outside [2, 3]"),
    "LossTrend": (
        {"start": 0, "window": 1, "from_step": 0, "max_ratio": 0.5},
        {"when": ["backward"]},
        [{}, {}],
        "not below 0.5 x",
    ),
    "GradShare": (
        {"shares": {"a.weight": [0.9, 1.0]}, "persist": 1},
        {"when": ["optimizer.step"]},
        [{"grad_norms": {"params": "0x3", "norms": [1.0, 1.0]}}],
        "a.weight got 0.707",
    ),
    "LRSchedule": (
        {"start": 0, "max_peak": 1, "min_steps": 1},
        {"when": ["optimizer.step"]},
        [{"calls": [["optimizer.step", {"lr": lr}]]} for lr in (0.1, 0.2, 0.3)],
        "still rising",
    ),
    "Causal": (
        {"tolerance": 0.01},
        {"when": ["forward"]},
        [{"calls": [["forward", {"causal_leak": 0.5, "causal_cut": 2, "causal_pos": 1, "causal_len": 4}]]}],
        "replacing the tokens",
    ),
}


def _record(step: int, **changes) -> dict:
    rec = {
        "step": step,
        "phase": "train",
        "calls": [
            ["zero_grad", {}],
            ["forward", {"training": True, "out.dtype": "float32"}],
            ["backward", {"loss": 1.0}],
            ["optimizer.step", {"lr": 0.1}],
        ],
        "effects": EFFECTS,
        "metrics": {},
    }
    return {**rec, **changes}


def test_every_relation_kind_has_a_case():
    assert set(CASES) == set(RELATIONS)


@pytest.mark.parametrize("relation", sorted(CASES))
def test_check_prints_a_violation_of_each_relation_kind(relation, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line
    params, precondition, changes, words = CASES[relation]
    inv = Invariant(id=f"case.{relation}", relation=relation, params=params, precondition=Precondition(**precondition))
    save_invariants([inv], tmp_path / "inv.yaml")
    records = [_record(step, **c) for step, c in enumerate(changes)]
    (tmp_path / TRACE_FILE).write_text("\n".join(json.dumps(r) for r in [HEADER, *records]) + "\n")
    r = CliRunner().invoke(app, ["invariants", "check", str(tmp_path), "-i", str(tmp_path / "inv.yaml"), "--no-events"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert r.exit_code == 1, r.output
    row = next(line for line in r.output.splitlines() if f"case.{relation}" in line)
    assert words in row, r.output
