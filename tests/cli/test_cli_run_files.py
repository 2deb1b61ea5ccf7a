"""Damaged run directories (checkpoint manifest, state file, log lines, JSON files, non-UTF-8 bytes): a
one-line error naming the file, exit code 2, nothing written (never a traceback); a torn last log line is dropped."""

import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from helpers import cli_fails
from sdcscope.cli import app
from sdcscope.common.io import read_jsonl

runner = CliRunner()


def _ok(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    _ok("train", "--steps", 2, "--batch-size", 2, "--out", out)
    return out


@pytest.fixture
def run(base, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


def _resume_fails(run, *needles):
    """``train --resume`` refused, leaving config.json as it was."""
    config = (run / "config.json").read_bytes()
    cli_fails(["train", "--resume", run, "--steps", 3], *needles)
    assert (run / "config.json").read_bytes() == config


def _reseal(run):
    """Record state.pt's sha256 in the manifest (a tampering that also fixed the manifest)."""
    manifest = run / "checkpoint" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["state.pt"] = hashlib.sha256((run / "checkpoint" / "state.pt").read_bytes()).hexdigest()
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m.update(files={}), "must map 'state.pt' to its sha256"),
        (lambda m: m.update(files={"other.pt": "0" * 64}), "must map 'state.pt' to its sha256"),
        (lambda m: m["files"].update({"state.pt": 1}), "must map 'state.pt' to its sha256"),
        (lambda m: m.pop("files"), "lacks 'files'"),
        (lambda m: m.pop("format"), "lacks 'format'"),
        (lambda m: m.update(step=str(m["step"])), "'step' must be a non-negative integer, got '"),
        (lambda m: m.update(step=-1), "'step' must be a non-negative integer, got -1"),
        (lambda m: m.update(step=m["step"] + 1), "its manifest says step"),
    ],
)
def test_a_manifest_that_cannot_verify_the_checkpoint_is_refused(run, edit, needle):
    manifest = run / "checkpoint" / "manifest.json"
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))
    _resume_fails(run, "corrupt checkpoint manifest" if "says" not in needle else "does not match", needle)


def test_a_checkpoint_that_does_not_load_or_holds_no_state_is_refused(run):
    state = run / "checkpoint" / "state.pt"
    state.write_bytes(b"garbage, not a checkpoint")
    _reseal(run)
    _resume_fails(run, repr(str(state)), "does not load")
    torch.save({"model": {}, "steps": 1}, state)
    _reseal(run)
    _resume_fails(run, "holds ['model', 'steps'], not a training state", "data_pos, model, optimizer, rng, step")


def test_a_torn_last_log_line_is_dropped_and_the_run_resumes(run):
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 2, "lo')
    _ok("train", "--resume", run, "--steps", 3)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
    assert (run / "metrics.jsonl").read_text().endswith("}\n")


def test_a_corrupt_log_line_names_the_file_and_line_and_nothing_changes(run):
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "lo\n' + "".join(lines[1:]))
    _resume_fails(run, "metrics.jsonl' line 1 is not valid JSON")
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    cli_fails(["report", run], "metrics.jsonl' line 1 is not valid JSON")


@pytest.mark.parametrize(
    "name, text", [("summary.json", "[1]"), ("config.json", '"run"'), ("events.jsonl", "[1, 2]\n")]
)
def test_a_run_file_that_is_not_an_object_is_named(run, name, text):
    (run / name).write_text(text)
    needle = f"{name}' line 1 must be a JSON object" if name.endswith("jsonl") else f"{name}' must hold a JSON object"
    _resume_fails(run, needle)
    cli_fails(["report", run], needle)


def test_files_that_are_not_utf8_are_named(run, tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe")
    cli_fails(["train", "--steps", 1, "--guard-config", bad, "--out", tmp_path / "r"], f"{str(bad)!r} is not UTF-8")
    cli_fails(["train", "--steps", 1, "--faults", bad, "--out", tmp_path / "r"], f"{str(bad)!r} is not UTF-8")
    (run / "checkpoint" / "manifest.json").write_bytes(b"\xff\xfe")
    _resume_fails(run, "corrupt checkpoint manifest", "manifest.json' is not UTF-8")


def test_report_refuses_another_tools_config_json(tmp_path):
    """A folder with some other tool's config.json (a model checkpoint's) is no run: no report is
    written into it, and a folder of such folders holds no runs."""
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_layer": 12}')
    for target in (model_dir, tmp_path):
        result = runner.invoke(app, ["report", str(target)])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and "Traceback" not in result.output
    assert "no 'workload'" in runner.invoke(app, ["report", str(model_dir)]).output
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
