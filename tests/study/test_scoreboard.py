"""The detector scoreboard: the truth and verdict formats are validated with clear errors; the
scorer's recall, false positives, localization and latency per fault class; ``sdcscope score`` on
a guarded campaign scores its profile and an external callable on the same trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcscope.cli.app import app
from sdcscope.study import init_campaign, run_campaign
from sdcscope.study.score import run_callable, score
from sdcscope.study.scoreboard import TRUTH_FORMAT, VERDICT_FORMAT, load_rows, validate_rows

ROOT = Path(__file__).resolve().parents[2]


def truth(trial, step=5, layer="fc1", element=7, site="weight", schedule="transient"):
    return {
        "format": TRUTH_FORMAT,
        "trial": trial,
        "fault": True,
        "step": step,
        "site": site,
        "model": "bitflip",
        "pattern": "element",
        "schedule": schedule,
        "bit": 30,
        "rank": 0,
        "layer": layer,
        "element": element,
    }


def clean(trial):
    return {"format": TRUTH_FORMAT, "trial": trial, "fault": False}


def verdict(trial, step, layer=None, element=None, detector="d"):
    return {
        "format": VERDICT_FORMAT,
        "trial": trial,
        "detector": detector,
        "step": step,
        "verdict": "x",
        "rank": 0,
        "layer": layer,
        "element": element,
    }


@pytest.mark.parametrize(
    "row, fmt, words",
    [
        ({**clean("c"), "step": 3}, TRUTH_FORMAT, "a clean trial (fault false) has no step"),
        ({**truth("t"), "layers": "fc1"}, TRUTH_FORMAT, "unknown field(s) ['layers']"),
        ({**truth("t"), "step": -1}, TRUTH_FORMAT, "field 'step' = -1"),
        ({**truth("t"), "element": [1, "a"]}, TRUTH_FORMAT, "field 'element'"),
        ({**verdict("t", 2), "format": TRUTH_FORMAT}, VERDICT_FORMAT, "this file must hold 'sdcscope.verdict/1'"),
        ({**verdict("t", 2), "step": None}, VERDICT_FORMAT, "field 'step' is required"),
    ],
)
def test_bad_rows_are_refused_naming_line_and_field(row, fmt, words):
    with pytest.raises(ValueError) as err:
        validate_rows([truth("ok") if fmt == TRUTH_FORMAT else verdict("ok", 1), row], fmt, "f.jsonl")
    assert "f.jsonl, line 2" in str(err.value) and words in str(err.value), str(err.value)


def test_recall_false_positives_localization_and_latency_per_class(tmp_path):
    rows = [truth("a"), truth("b"), truth("c", step=None), truth("d", schedule="permanent"), clean("e"), clean("f")]
    said = [
        verdict("a", 4),  # before the fault: a false verdict (its later one still detects it)
        verdict("a", 6, layer="fc1", element=7),
        verdict("b", 5, layer="fc2", element=[0, 7]),  # wrong layer; a multi-index and a flat one: not compared
        verdict("c", 9),  # the fault never fired: false
        verdict("e", 1),  # clean trial: false
    ]
    path = tmp_path / "truth.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = score(load_rows(path, TRUTH_FORMAT), validate_rows(said, VERDICT_FORMAT), detectors=["silent"])
    transient = scores["d"]["weight x bitflip x element x transient"]
    assert (transient["trials"], transient["fired"], transient["detected"], transient["recall"]) == (3, 2, 2, 1.0)
    assert transient["false"] == 2 and transient["fp_rate"] == pytest.approx(2 / 3)
    assert (transient["layer"], transient["element"], transient["localized"]["element"]) == (0.5, 1.0, 1)
    assert (transient["latency_median"], transient["latency_max"]) == (0.5, 1)
    assert scores["d"]["weight x bitflip x element x permanent"]["recall"] == 0.0
    assert scores["d"]["clean"]["fp_rate"] == 0.5 and scores["d"]["all"]["fired"] == 3
    assert scores["silent"]["all"]["recall"] == 0.0 and scores["silent"]["clean"]["false"] == 0


@pytest.mark.parametrize(
    "shape, said, same",
    [
        ([4, 8], [2, 5], True),  # 21 = 2 x 8 + 5: the whole shape known
        ([4, 8], [2, 6], False),
        ([8], [None, None, 5], True),  # only the trailing width known (a Linear's output): its column
        ([8], [None, None, 6], False),
        ([8], [1, None, 5], None),  # a leading coordinate the truth cannot place
        (None, [2, 5], None),  # no shape: a flat index and a multi-index do not compare
    ],
)
def test_a_flat_index_is_compared_with_a_multi_index_on_the_known_shape(shape, said, same):
    row = {**truth("t", element=21), "shape": shape}
    m = score(validate_rows([row], TRUTH_FORMAT), [verdict("t", 5, element=said)])["d"]["all"]
    assert m["element"] == (None if same is None else float(same))


def test_a_callable_detector_is_run_per_trial_and_its_verdicts_validated():
    rows = {"t1": [{"step": 0, "loss": 1.0}, {"step": 1, "loss": None}], "t2": [{"step": 0, "loss": 1.0}]}

    def nonfinite(steps):
        return [{"step": s["step"], "verdict": "nan"} for s in steps if s["loss"] is None]

    assert [(v["trial"], v["step"], v["detector"]) for v in run_callable(nonfinite, "nf", rows)] == [("t1", 1, "nf")]
    with pytest.raises(ValueError, match="field 'step' is required"):
        run_callable(lambda steps: [{"verdict": "x"}], "bad", rows)


SPEC = """
name: scored
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [3]
horizon: 3
faults: {sites: [gemm.forward], targets: [blocks.0.mlp.fc], bits: [30]}
baseline: {seeds: [5, 6]}
guard: {profile: full}
"""


def test_score_a_guarded_campaign_and_an_external_detector(tmp_path, monkeypatch):
    (tmp_path / "spec.yaml").write_text(SPEC)
    init_campaign(tmp_path / "c", tmp_path / "spec.yaml")
    run_campaign(tmp_path / "c", workers=0)
    assert (tmp_path / "c" / "trials" / "trial-0" / "injections.jsonl").is_file()
    monkeypatch.setenv("COLUMNS", "300")
    zscore = f"{ROOT / 'examples' / 'zscore_detector.py'}:detect"
    r = CliRunner().invoke(
        app, ["score", str(tmp_path / "c"), "--detector", zscore, "--json", str(tmp_path / "s.json")]
    )
    assert r.exit_code == 0, r.output
    scores = json.loads((tmp_path / "s.json").read_text())["scores"]
    assert set(scores) == {"full", "detect"}
    full = scores["full"]["gemm.forward x bitflip x element(index=random) x transient"]
    # ABFT in the fault's step, in the right layer and column (its flat index unravelled by the Linear's width)
    assert (full["recall"], full["layer"], full["element"], full["latency_max"]) == (1.0, 1.0, 1.0, 0)
    assert scores["full"]["clean"]["trials"] == 2 and scores["full"]["clean"]["false"] == 0
    assert "full" in r.output and "gemm.forward x bitflip" in r.output


def test_a_run_directory_and_jsonl_files_are_scored_through_the_command(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    fault = {"site": "weight", "model": "bitflip", "bits": [30], "pattern": {"kind": "element"}}
    (run / "config.json").write_text(json.dumps({"faults": [{**fault, "schedule": {"kind": "permanent"}}]}))
    (run / "injections.jsonl").write_text(
        json.dumps(
            {"step": 4, "rank": 0, "site": "weight", "when": "train", "module": "fc.weight", "spec": 0, "index": [9]}
        )
        + "\n"
    )
    events = [
        {"step": 4, "detector": "guard", "verdict": "stalled", "module": None, "rank": 0, "index": None},
        {"step": 5, "detector": "state_checksum", "verdict": "corrupt", "module": "fc.weight", "rank": 0, "index": [9]},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    other = tmp_path / "other.jsonl"  # another tool's verdicts on the same trial
    other.write_text(json.dumps(verdict("run", 4, layer="fc.bias")) + "\n")
    monkeypatch.setenv("COLUMNS", "300")
    r = CliRunner().invoke(
        app, ["score", str(run), str(other), "--json", str(tmp_path / "s.json"), "--export", str(tmp_path / "rows")]
    )
    assert r.exit_code == 0, r.output
    scores = json.loads((tmp_path / "s.json").read_text())["scores"]
    ours = scores["sdcscope"]["weight x bitflip x element x permanent"]  # the guard's own notice is no finding
    assert (ours["recall"], ours["latency_max"], ours["layer"], ours["element"], ours["rank"]) == (
        1.0,
        1,
        1.0,
        1.0,
        1.0,
    )
    assert (scores["d"]["all"]["recall"], scores["d"]["all"]["layer"]) == (1.0, 0.0)
    assert load_rows(tmp_path / "rows" / "truth.jsonl", TRUTH_FORMAT)[0]["element"] == 9
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**verdict("run", 1), "step": "one"}) + "\n")
    r = CliRunner().invoke(app, ["score", str(run), str(bad)])
    assert r.exit_code == 2 and "bad.jsonl, line 1: field 'step'" in " ".join(r.output.split())
