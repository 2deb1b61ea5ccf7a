"""Sections of the campaign report: permanent-fault groups and PVF tables."""

from __future__ import annotations

from sdcscope.study.report import _permanent, _pvf_section


def _row(site, pattern, loss_fault):
    return {
        "site": site,
        "target": "blocks.0.attn.q_proj",
        "pattern": pattern,
        "model": "bitflip",
        "bit": 30,
        "swizzle": 0,
        "inject_step": 4,
        "val_loss_fault": loss_fault,
        "val_loss": 2.0,
        "val_acc": None,
        "val_acc_fault": None,
    }


def test_permanent_fault_groups_never_mix_sites_or_patterns():
    rows = [_row("weight", "element", 5.0), _row("gemm.forward", "element", 3.0), _row("weight", "row", 4.0)]
    groups = _permanent(rows, {4: {"val_loss": 1.9, "val_acc": None}})
    assert sorted((g["group"], g["n"], g["loss_fault"]) for g in groups) == [
        ("gemm.forward blocks.0.attn.q_proj element bitflip b30", 1, 3.0),
        ("weight blocks.0.attn.q_proj element bitflip b30", 1, 5.0),
        ("weight blocks.0.attn.q_proj row bitflip b30", 1, 4.0),
    ]


def test_a_pvf_table_without_fired_trials_says_why_it_is_empty():
    table = _pvf_section([{"site": "gemm.grad_input", "effect": "not_fired"}], "site")
    assert table["rows"] == [] and "no trial's fault fired" in table["note"]
