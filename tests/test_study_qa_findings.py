"""Study-room defects found by QA on end-to-end campaigns, each with a regression test."""

from __future__ import annotations

import pytest

from sdcscope.study import init_campaign, load_campaign, plan_campaign
from sdcscope.study.guarded import first_detection
from sdcscope.study.report import _permanent, _pvf_section

from test_study_spec import BASE


def test_two_spellings_of_one_pattern_or_schedule_are_one_fault_space_point():
    spec = load_campaign(BASE.replace(
        'bits: ["0-3", 30]', 'bits: [30]\n  patterns: [{kind: element}, {kind: element, index: random}]\n'
        '  schedules: [{kind: transient}, {kind: transient}]'))
    assert len(spec.faults.patterns) == 1 and len(spec.faults.schedules) == 1
    plan = plan_campaign(spec)
    assert len({t.key for t in plan}) == len(plan)   # every trial can be stored under its own key


def test_planning_errors_name_the_spec_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE.replace('targets: ["blocks.0.attn.*_proj", head]', "targets: [blocks.9.nothing]"))
    with pytest.raises(ValueError, match=rf"{path.name}'.*blocks.9.nothing"):
        init_campaign(tmp_path / "c", path)
    assert not (tmp_path / "c").exists()


def test_detection_latency_counts_from_the_step_the_fault_first_fired():
    records = [{"step": 11, "when": None}, {"step": 13, "when": None}, {"step": 10, "when": "eval"}]
    events = [{"step": 9, "detector": "loss_spike"}, {"step": 11, "detector": "abft"}]
    assert first_detection(events, records) == (11, events[1])   # the step-9 event came before the fault
    assert first_detection(events[:1], records) == (11, None)
    assert first_detection(events, []) == (None, None)


def _row(site, pattern, loss_fault):
    return {"site": site, "target": "blocks.0.attn.q_proj", "pattern": pattern, "model": "bitflip", "bit": 30,
            "swizzle": 0, "inject_step": 4, "val_loss_fault": loss_fault, "val_loss": 2.0,
            "val_acc": None, "val_acc_fault": None}


def test_permanent_fault_groups_never_mix_sites_or_patterns():
    rows = [_row("weight", "element", 5.0), _row("gemm.forward", "element", 3.0), _row("weight", "row", 4.0)]
    groups = _permanent(rows, {4: {"val_loss": 1.9, "val_acc": None}})
    assert sorted((g["group"], g["n"], g["loss_fault"]) for g in groups) == [
        ("gemm.forward blocks.0.attn.q_proj element bitflip b30", 1, 3.0),
        ("weight blocks.0.attn.q_proj element bitflip b30", 1, 5.0),
        ("weight blocks.0.attn.q_proj row bitflip b30", 1, 4.0)]


def test_a_pvf_table_without_fired_trials_says_why_it_is_empty():
    table = _pvf_section([{"site": "gemm.grad_input", "effect": "not_fired"}], "site")
    assert table["rows"] == [] and "no trial's fault fired" in table["note"]
