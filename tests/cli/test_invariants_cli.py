"""``sdcscope invariants trace|infer|check``: the workflow end to end, exit codes and errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

import sdcscope.cli.invariants_cmd  # noqa: F401  (registers the commands)
from helpers import one_line_error
from sdcscope.cli.app import app
from sdcscope.engine import read_jsonl
from sdcscope.invariants import load_invariants

runner = CliRunner()
TRACE = ["invariants", "trace", "--steps", "6", "--batch-size", "4", "--eval-every", "3"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def inv_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for seed, lr in ((1, "3e-3"), (2, "2e-3")):
        r = invoke(*TRACE, "--seed", seed, "--lr", lr, "--out", root / f"ref{seed}")
        assert r.exit_code == 0, r.output
        assert (root / f"ref{seed}" / "trace.jsonl").is_file()
    r = invoke("invariants", "infer", root / "ref1", root / "ref2", "--out", root / "inv.yaml")
    assert r.exit_code == 0, r.output
    assert "APISequence" in r.output and "wrote" in r.output
    return root / "inv.yaml"


def test_online_and_offline_checks_of_a_clean_run_pass(inv_file, tmp_path):
    run = tmp_path / "run"
    r = invoke(*TRACE, "--seed", 0, "--out", run, "--invariants", inv_file)
    assert r.exit_code == 0, r.output
    assert "no invariant violations" in r.output
    r = invoke("invariants", "check", "--invariants", inv_file, run)
    assert r.exit_code == 0, r.output
    assert "no violations" in r.output


def test_violations_exit_1_with_a_table_and_idempotent_events(inv_file, tmp_path):
    run = tmp_path / "run"
    assert invoke(*TRACE, "--seed", 0, "--out", run).exit_code == 0
    entries = yaml.safe_load(inv_file.read_text())
    for e in entries:
        if e["id"] == "arg.train.clip_grad_norm_.max_norm":
            e["params"]["value"] = 2.0  # the user edits the file: clipping should be at 2
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(entries))
    for _ in range(2):
        r = invoke("invariants", "check", "-i", edited, run)
        assert r.exit_code == 1, r.output
        assert "arg.train.clip_grad_norm_.max_norm" in r.output
    events = read_jsonl(run / "events.jsonl")
    assert len(events) == 1 and events[0]["verdict"] == "arg.train.clip_grad_norm_.max_norm"
    assert events[0]["evidence"]["expected"] == 2.0 and events[0]["evidence"]["observed"] == 1.0


def test_the_guards_online_check_sees_the_step_metrics(inv_file, tmp_path):
    """``train --invariants`` checks through the guard: the metric bounds too, not only calls."""
    entries = yaml.safe_load(inv_file.read_text())
    (loss,) = [e for e in entries if e["id"] == "metric.train.loss"]
    loss["params"]["bounds"] = [100.0, 200.0]
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(entries))
    run = tmp_path / "run"
    r = invoke("train", "--steps", 3, "--batch-size", 4, "--out", run, "--invariants", edited)
    assert r.exit_code == 0, r.output
    assert [e["verdict"] for e in read_jsonl(run / "events.jsonl")] == ["metric.train.loss"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("- relation: Invariantz\n  params: {}\n", "unknown relation 'Invariantz'; allowed: Consistent"),
        (
            "- id: upd\n  relation: EventContain\n  params: {parent: optimizer.step, child: update, "
            "tensors: ['blocks.0.atn.*']}\n",
            "'blocks.0.atn.*' matches no tensor",
        ),
        ("- [not, a, mapping]\n", "must be a mapping"),
    ],
)
def test_bad_invariant_files_fail_with_one_line_and_exit_2(inv_file, tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    r = invoke("invariants", "check", "-i", bad, inv_file.parent / "ref1")
    assert r.exit_code == 2
    assert message in r.output and len(r.output.strip().splitlines()) == 1


def test_missing_runs_fail_with_exit_2(tmp_path):
    r = invoke("invariants", "infer", tmp_path / "nope", "--out", tmp_path / "x.yaml")
    assert r.exit_code == 2 and "no trace at" in r.output
    r = invoke("invariants", "infer", tmp_path, "--out", tmp_path / "x.yaml", "--margin", "0.5")
    assert r.exit_code == 2 and "margin" in r.output


def test_importing_the_command_module_does_not_import_torch():
    code = "import sys, sdcscope.cli.invariants_cmd; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A tiny traced run (trace.jsonl), as `invariants infer` and `check` need."""
    run = tmp_path_factory.mktemp("qa") / "tr"
    r = invoke("invariants", "trace", "--steps", 2, "--batch-size", 2, "--out", run)
    assert r.exit_code == 0, r.output
    return run


def test_an_empty_invariants_list_is_refused_naming_the_file(tmp_path, traced):
    empty = tmp_path / "inv.yaml"
    empty.write_text("[]\n")
    with pytest.raises(ValueError, match=rf"invariants file '{empty}' holds no invariants"):
        load_invariants(empty)
    before = _files(traced)
    line = one_line_error(invoke("invariants", "check", traced, "-i", empty))
    assert f"'{empty}' holds no invariants" in line
    assert _files(traced) == before  # events.jsonl untouched
    line = one_line_error(
        invoke("train", "--steps", 1, "--batch-size", 2, "--invariants", empty, "--out", tmp_path / "r")
    )
    assert f"'{empty}' holds no invariants" in line
    assert not (tmp_path / "r").exists()


def test_infer_refuses_an_existing_out_file_unless_forced(tmp_path, traced):
    out = tmp_path / "inv.yaml"
    out.write_text("# my hand-edited invariants\n")
    for run in (traced, tmp_path / "nope"):  # refused before the runs are even read
        line = one_line_error(invoke("invariants", "infer", run, "--out", out, "--min-support", 1))
        assert f"--out '{out}' already exists" in line and "--force" in line, line
    assert out.read_text() == "# my hand-edited invariants\n"
    r = invoke("invariants", "infer", traced, "--out", out, "--min-support", 1, "--force")
    assert r.exit_code == 0, r.output
    assert len(load_invariants(out)) > 0
    assert "--force" in invoke("invariants", "infer", "--help").output


def test_infer_refuses_an_out_it_cannot_write_before_inference(tmp_path):
    (tmp_path / "od").mkdir()
    (tmp_path / "f").write_text("x")
    nope = tmp_path / "nope"  # no run: any inference would fail on it, so the --out check came first
    line = one_line_error(invoke("invariants", "infer", nope, "--out", tmp_path / "od"))
    assert f"--out '{tmp_path / 'od'}' is a folder; give a file" in line
    line = one_line_error(invoke("invariants", "infer", nope, "--out", tmp_path / "f" / "inv.yaml"))
    assert f"'{tmp_path / 'f'}' is a file, not a folder" in line
    line = one_line_error(invoke("invariants", "infer", nope, "--out", "/proc/qa_sdcscope/inv.yaml"))
    assert "--out '/proc/qa_sdcscope/inv.yaml' cannot be written: '/proc' refuses new files" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "od"] and not any((tmp_path / "od").iterdir())
