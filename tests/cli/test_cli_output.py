"""What the CLI writes where: ``python -m sdcscope``, ``--json`` (one object on stdout, nothing
else), a guard detection as one WARNING log line on stderr, ``-q``, and piped lines never wrapped."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from helpers import CAMPAIGN_SPEC
from sdcscope.cli import app
from sdcscope.common.io import read_jsonl

FAULT = """
- site: gemm.forward
  target: fc2
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: random}
  schedule: {kind: transient, step: 1}
  seed: 1
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_python_m_sdcscope_help():
    done = subprocess.run([sys.executable, "-m", "sdcscope", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m sdcscope" in done.stdout and "--quiet" in done.stdout and "--install-completion" in done.stdout


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """``train --json --guard`` of the CNN with a GEMM bit flip at step 1: (result, run directory)."""
    root = tmp_path_factory.mktemp("json")
    (root / "fault.yaml").write_text(FAULT)
    out = root / ("a-run-directory-whose-name-is-long-enough-to-wrap-at-eighty-columns-" * 2)
    result = invoke("train", "-w", "cnn", "-n", "3", "--guard", "--faults", root / "fault.yaml", "-o", out, "--json")
    return result, out


def test_train_json_is_the_only_stdout_and_parses(faulty):
    result, out = faulty
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    got = json.loads(line)
    summary = json.loads((out / "summary.json").read_text())
    assert {k: got[k] for k in summary} == summary
    assert got["run_dir"] == str(out) and got["faults_fired"] == 1
    assert got["guard_events"] == len(read_jsonl(out / "events.jsonl")) >= 1


def test_a_detection_is_one_warning_line_on_stderr(faulty):
    result, out = faulty
    events = read_jsonl(out / "events.jsonl")
    lines = [x for x in result.stderr.splitlines() if "guard event:" in x]
    assert len(lines) == len(events)
    for line, e in zip(lines, events):
        assert "WARNING" in line
        for key, value in (("step", e["step"]), ("detector", e["detector"]), ("verdict", e["verdict"])):
            assert f"{key}={value}" in line
        assert f"layer={e['module']}" in line and f"action={e['action']}" in line and "gemm=" in line


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_prints_no_summary_and_no_warnings(tmp_path, where):
    """``-q`` is taken where users type it: before the subcommand or after it."""
    (tmp_path / "fault.yaml").write_text(FAULT)
    args = ["train", "-w", "cnn", "-n", "2", "--guard", "--faults", tmp_path / "fault.yaml", "-o", tmp_path / "r"]
    result = invoke(*(["-q", *args] if where == "before" else [*args, "-q"]))
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and "guard event" not in result.stderr
    assert read_jsonl(tmp_path / "r" / "events.jsonl")  # the detection happened, silently


def test_verbose_after_the_subcommand_logs_debug_lines(tmp_path):
    result = invoke("train", "-w", "cnn", "-n", "1", "-o", tmp_path / "r", "-vv")
    assert result.exit_code == 0, result.output
    assert "DEBUG sdcscope." in result.stderr, result.stderr
    shown = invoke("campaign", "status", tmp_path / "none", "--verbose")  # a nested command too
    assert shown.exit_code == 2 and "No such option" not in shown.output, shown.output


def test_a_guarded_train_states_its_abft_coverage_bound(tmp_path):
    """The default (balanced) profile's rotation, in the closing lines: the CNN's 5 GEMM layers
    dealt into 20 slots (0 or 1 a step), every one checked within 20 steps."""
    result = invoke("train", "-w", "cnn", "-n", "1", "--guard", "-o", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "guard: ABFT checks every GEMM layer within 20 steps (0-1 of 5 a step)" in result.stdout.splitlines()
    result = invoke("train", "-w", "cnn", "-n", "1", "-o", tmp_path / "plain")
    assert "ABFT" not in result.stdout


def test_piped_output_keeps_lines_whole(tmp_path):
    out = tmp_path / ("a-run-directory-whose-name-is-long-enough-to-wrap-at-eighty-columns-" * 2)
    result = invoke("train", "-w", "cnn", "-n", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert any(line.startswith("run directory: ") and str(out) in line for line in result.stdout.splitlines())


def test_inject_and_campaign_status_json_parse(tmp_path):
    (tmp_path / "fault.yaml").write_text(FAULT)
    result = invoke(
        "inject", "--spec", tmp_path / "fault.yaml", "-o", tmp_path / "inj", "-w", "cnn", "-n", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got == {**json.loads((tmp_path / "inj" / "comparison.json").read_text()), **got}
    assert got["injections"] == 1 and got["out"] == str(tmp_path / "inj")
    (tmp_path / "c.yaml").write_text(CAMPAIGN_SPEC)
    assert invoke("campaign", "init", tmp_path / "c", "--spec", tmp_path / "c.yaml").exit_code == 0
    result = invoke("campaign", "status", tmp_path / "c", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["done"] == 0 and got["outcomes"] == {} and got["trials"] >= 1
