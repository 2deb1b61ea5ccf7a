"""A CI-sized slice of the silent-bugs benchmark: five bugs over two families, with clean twins."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "silent_bugs" / "run.py"
SUBSET = {  # bug -> the invariant that must catch it first
    "missing_zero_grad": "sequence.train",
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
    results = bench.run_benchmark(bugs, tmp_path, log=lambda *_: None)
    for r in results:
        assert r.detected, r.bug.name
        assert r.first["verdict"] == SUBSET[r.bug.name], (r.bug.name, r.first)
        assert r.clean_violations == [], (r.bug.name, r.clean_violations)
    by_name = {r.bug.name: r for r in results}
    assert by_name["replica_diverges"].first["step"] == 6
    assert by_name["dropout_at_eval"].first["step"] == 8
    assert "missing_zero_grad" in bench.table(results)
    assert (tmp_path / "gpt_loop" / "invariants.yaml").is_file()
