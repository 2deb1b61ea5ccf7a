"""``sdcscope inject``: golden + faulty runs and their comparison; bad specs refused up front."""

import json

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app

runner = CliRunner()
GOOD = """
- site: gemm.forward
  target: blocks.0.attn.q_proj
  model: bitflip
  bits: [{bit}]
  pattern: {{kind: element, index: random}}
  schedule: {{kind: transient, step: {step}}}
  seed: 1
"""


def _inject(tmp_path, text, *extra):
    spec = tmp_path / "faults.yaml"
    spec.write_text(text)
    return runner.invoke(
        app,
        ["inject", "--spec", str(spec), "--steps", "6", "--batch-size", "2", "--out", str(tmp_path / "exp"), *extra],
    )


def test_inject_writes_both_runs_and_comparison(tmp_path):
    result = _inject(tmp_path, GOOD.format(bit=30, step=2))
    assert result.exit_code == 0, result.output
    exp = tmp_path / "exp"
    for run in ("golden", "faulty"):
        for name in ("config.json", "metrics.jsonl", "summary.json", "injections.jsonl"):
            assert (exp / run / name).is_file(), (run, name)
    records = [json.loads(x) for x in (exp / "faulty" / "injections.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 2 and records[0]["module"] == "blocks.0.attn.q_proj"
    assert set(records[0]) >= {"step", "micro_batch", "rank", "site", "module", "index", "bits", "before", "after"}
    cmp = json.loads((exp / "comparison.json").read_text())
    assert cmp["first_divergence_step"] == 2
    assert cmp["outcome"] in ("crash", "deviation")
    assert len(cmp["loss_diff"]) == 6 and cmp["loss_diff"][:2] == [0.0, 0.0]
    config = json.loads((exp / "faulty" / "config.json").read_text())
    assert config["faults"][0]["bits"] == [30]


def test_a_crashed_faulty_run_is_described_in_words_not_nan():
    """A faulty run that crashed has no val loss and no parameter distance: the line says so
    (it printed ``→ nan (Δ None)`` and a distance ``nan``). The values are compare_runs' own for
    a weight stuck at a huge exponent in an inject of the tiny GPT."""
    from sdcscope.cli.inject_cmd import comparison_line

    crash = {
        "outcome": "crash",
        "injections": 1,
        "first_divergence_step": 2,
        "param_rel_l2": "nan",
        "val_loss_golden": 5.056128084659576,
        "val_loss_faulty": "nan",
        "val_loss_delta": None,
        "steps_faulty": 3,
    }
    line = comparison_line(crash)
    assert "nan" not in line and "None" not in line, line
    assert "the faulty parameters are not finite" in line and "none for the faulty run: it crashed" in line, line
    fine = {**crash, "outcome": "deviation", "param_rel_l2": 0.25, "val_loss_faulty": 5.5, "val_loss_delta": 0.4439}
    assert "distance (rel. L2) 0.25; val loss 5.0561 → 5.5000 (Δ +0.4439)" in comparison_line(fine)
    assert "never left the golden curve" in comparison_line({**fine, "first_divergence_step": None})


BAD = [
    (GOOD.format(bit=40, step=2), ["bit 40", "0..31"]),
    (GOOD.replace("bits: [{bit}]", "bits: [9]\n  format: int8").format(bit=0, step=2), ["bit 9", "0..7"]),
    (
        GOOD.replace("blocks.0.attn.q_proj", "blocks.0.atn.q_proj").format(bit=3, step=2),
        ["blocks.0.atn.q_proj", "blocks.0.attn.q_proj"],
    ),
    (GOOD.replace("gemm.forward", "gemm.fwd").format(bit=3, step=2), ["gemm.fwd", "gemm.forward"]),
    (GOOD.format(bit=3, step=-1), ["step", "-1"]),
    (
        GOOD.replace("{{kind: transient, step: {step}}}", "{{kind: intermittent, p: 1.5}}").format(bit=3),
        ["p", "1.5", "[0, 1]"],
    ),
    ("- site: weight\n  target: [unbalanced\n", ["malformed YAML"]),
    (
        GOOD.replace("bits: [{bit}]", "bits: [{bit}]\n  bits: [30]").format(bit=3, step=2),  # which one?
        ["malformed YAML", "duplicate key 'bits'"],
    ),
    (GOOD.format(bit=3, step=99), ["99", "0..5"]),  # a fault that could never fire
]


@pytest.mark.parametrize("text,needles", BAD)
def test_bad_specs_fail_before_training(tmp_path, text, needles):
    result = _inject(tmp_path, text)
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "error:" in out
    for needle in needles:
        assert needle in out, (needle, out)
    assert not (tmp_path / "exp").exists()


def test_int8_bit_7_is_accepted_by_the_spec():
    from sdcscope.faults import FaultSpec

    spec = FaultSpec.from_dict(
        {
            "site": "weight",
            "target": "x",
            "model": "bitflip",
            "bits": [7],
            "format": "int8",
            "schedule": {"kind": "transient", "step": 0},
        }
    )
    assert list(spec.bits) == [7] and spec.format == "int8"


def test_guard_rolls_back_a_weight_fault_at_the_first_step_to_a_clean_state(tmp_path):
    """The guard's first snapshot and state checksum are taken before the injector acts, so a
    memory fault at step 0 is caught and rolled back to clean weights."""
    spec = (
        "- {site: weight, target: blocks.0.mlp.fc, model: bitflip, bits: [30], "
        "pattern: {kind: element, index: 7}, schedule: {kind: transient, step: 0}}\n"
    )
    result = _inject(tmp_path, spec, "--guard")
    assert result.exit_code == 0, result.output
    cmp = json.loads((tmp_path / "exp" / "comparison.json").read_text())
    assert cmp["guarded"]["outcome"] == "masked", cmp["guarded"]


def test_a_guarded_run_that_stalls_is_compared_step_by_step_and_called_stalled(tmp_path):
    """A stuck bit re-applied after every update: the guard rolls back again and again. Its run is
    compared with golden over the steps it applied (rows of discarded or re-run steps are no step
    of their own), and called stalled, not a deviation of a 1-step model from a 6-step one."""
    result = _inject(
        tmp_path,
        "- {site: weight, target: blocks.1.mlp.fc, model: stuck_at_1, bits: [30], "
        "pattern: {kind: element, index: 7}, schedule: {kind: permanent, start: 2}}\n",
        "--guard",
    )
    assert result.exit_code == 0, result.output
    guarded = json.loads((tmp_path / "exp" / "comparison.json").read_text())["guarded"]
    assert guarded["outcome"] == "stalled"
    steps = guarded["loss_diff_steps"]
    assert steps == sorted(set(steps)) and steps[:2] == [0, 1] and set(guarded["loss_diff"]) == {0.0}


def test_train_counts_checkpoint_faults_among_those_fired(tmp_path):
    spec = tmp_path / "ck.yaml"
    spec.write_text(
        "- {site: checkpoint, target: blocks.0.attn.q_proj, model: bitflip, bits: [30], "
        "pattern: {kind: element, index: 0}, schedule: {kind: transient, step: 2}}\n"
    )
    result = runner.invoke(
        app, ["train", "--faults", str(spec), "--steps", "3", "--batch-size", "2", "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "run" / "injections.jsonl").read_text().splitlines()
    assert lines and f"faults: {len(lines)} fired" in " ".join(result.output.split())  # was: 0 fired


def test_inject_on_the_moe_workload_drops_a_token_and_compares(tmp_path):
    text = """
- site: dispatch
  target: blocks.1.moe.dispatch
  model: drop
  schedule: {kind: transient, step: 2}
  seed: 1
"""
    result = _inject(tmp_path, text, "--workload", "moe")
    assert result.exit_code == 0, result.output
    exp = tmp_path / "exp"
    (record,) = [json.loads(x) for x in (exp / "faulty" / "injections.jsonl").read_text().splitlines()]
    assert (record["step"], record["site"], record["module"]) == (2, "dispatch", "blocks.1.moe.dispatch")
    assert json.loads((exp / "golden" / "config.json").read_text())["workload"]["workload"] == "moe"
    cmp = json.loads((exp / "comparison.json").read_text())
    assert cmp["first_divergence_step"] == 2 and cmp["loss_diff"][:2] == [0.0, 0.0]
