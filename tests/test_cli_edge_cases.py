"""Edge cases of run directories and config files: a one-line error naming the file, exit code 2,
nothing written (and never a traceback)."""

import hashlib
import json
import shutil
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

from sdcscope._io import read_jsonl
from sdcscope.cli import app
from sdcscope.cli.common import user_errors
from sdcscope.cli.guard_opts import guard_config
from sdcscope.guard import GuardConfig

runner = CliRunner()


def _ok(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def _fails(args, *needles):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    for needle in needles:
        assert needle in text, text
    return text


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
    _fails(["train", "--resume", run, "--steps", 3], *needles)
    assert (run / "config.json").read_bytes() == config


def _reseal(run):
    """Record state.pt's sha256 in the manifest (a tampering that also fixed the manifest)."""
    manifest = run / "checkpoint" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["state.pt"] = hashlib.sha256((run / "checkpoint" / "state.pt").read_bytes()).hexdigest()
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(files={}), "must map 'state.pt' to its sha256"),
    (lambda m: m.update(files={"other.pt": "0" * 64}), "must map 'state.pt' to its sha256"),
    (lambda m: m["files"].update({"state.pt": 1}), "must map 'state.pt' to its sha256"),
    (lambda m: m.pop("files"), "lacks 'files'"),
    (lambda m: m.pop("format"), "lacks 'format'"),
    (lambda m: m.update(step=str(m["step"])), "'step' must be a non-negative integer, got '"),
    (lambda m: m.update(step=-1), "'step' must be a non-negative integer, got -1"),
    (lambda m: m.update(step=m["step"] + 1), "its manifest says step"),
])
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
    _fails(["report", run], "metrics.jsonl' line 1 is not valid JSON")


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n{"step": 1')
    assert read_jsonl(path) == [{"step": 0}]
    path.write_text('{"step": 0}\n{"step": 1\n')  # ends with its newline: written whole, so corrupt
    with pytest.raises(ValueError, match=r"log.jsonl' line 2 is not valid JSON"):
        read_jsonl(path)


@pytest.mark.parametrize("name, text", [("summary.json", "[1]"), ("config.json", '"run"'),
                                        ("events.jsonl", "[1, 2]\n")])
def test_a_run_file_that_is_not_an_object_is_named(run, name, text):
    (run / name).write_text(text)
    needle = f"{name}' line 1 must be a JSON object" if name.endswith("jsonl") else f"{name}' must hold a JSON object"
    _resume_fails(run, needle)
    _fails(["report", run], needle)


def test_a_guard_config_reads_exponents_without_a_dot_as_numbers(tmp_path):
    (tmp_path / "g.yaml").write_text("abft: {budget: 2e-2}\nloss_spike: {alarm_z: 1e1}\n")
    config = GuardConfig.load(tmp_path / "g.yaml")
    assert config.abft.budget == 0.02 and config.loss_spike.alarm_z == 10.0


def test_guard_paths_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inv.yaml").write_text("[]\n")
    (tmp_path / "g.yaml").write_text("invariants: inv.yaml\nmetrics: {path: logs/m.jsonl}\n")
    config = guard_config(False, tmp_path / "g.yaml")
    assert config.invariants == str(tmp_path / "inv.yaml")
    assert config.metrics.path == str(tmp_path / "logs" / "m.jsonl")
    assert guard_config(False, None, tmp_path / "inv.yaml").invariants == str(tmp_path / "inv.yaml")


def test_a_dead_pattern_in_a_target_list_is_named(tmp_path):
    (tmp_path / "f.yaml").write_text(
        "- {site: weight, target: [blocks.1.mlp.fc.weight, blocks.1.mlp.fcc.weight], model: bitflip, bits: [3],"
        " schedule: {kind: transient, step: 1}}\n")
    _fails(["train", "--faults", tmp_path / "f.yaml", "--steps", 2, "--out", tmp_path / "r"],
           "target pattern 'blocks.1.mlp.fcc.weight'", "close names: blocks.1.mlp.fc.weight")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["inject", "--spec", "SPEC", "--steps", "2"],
                                     ["demo", "--steps", "2"]])
def test_an_out_below_a_file_is_refused(tmp_path, command):
    (tmp_path / "afile").write_text("")
    (tmp_path / "f.yaml").write_text("- {site: weight, target: head, model: zero, schedule: {kind: transient, step: 0}}\n")
    args = [str(tmp_path / "f.yaml") if a == "SPEC" else a for a in command]
    _fails([*args, "--out", tmp_path / "afile" / "run"], f"{str(tmp_path / 'afile')!r} is a file, not a folder")


def test_a_metrics_sink_that_cannot_be_built_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    (tmp_path / "afile").write_text("")
    (tmp_path / "tb.yaml").write_text("metrics: {sink: tensorboard, path: tb}\n")
    (tmp_path / "under.yaml").write_text(f"metrics: {{path: {tmp_path / 'afile' / 'm.jsonl'}}}\n")
    _fails(["train", "--steps", 1, "--guard-config", tmp_path / "tb.yaml", "--out", tmp_path / "r"],
           "needs the 'tensorboard' package: pip install 'sdcscope[tensorboard]'")
    _fails(["train", "--steps", 1, "--guard-config", tmp_path / "under.yaml", "--out", tmp_path / "r"],
           "is a file, not a folder")
    assert not (tmp_path / "r").exists()


def test_distributed_options_are_checked_before_launch(tmp_path):
    (tmp_path / "nm.yaml").write_text("abft: {targets: [nomatch.*]}\n")
    _fails(["train", "--nproc", 2, "--steps", 1, "--guard-config", tmp_path, "--out", tmp_path / "r"],
           "--guard-config", "is a folder")
    _fails(["train", "--nproc", 2, "--steps", 1, "--guard-config", tmp_path / "nm.yaml", "--out", tmp_path / "r"],
           "ABFT targets pattern 'nomatch.*' matches no eligible module")
    assert not (tmp_path / "r").exists()


def test_remaining_os_errors_are_one_line_naming_the_path(tmp_path, capsys):
    with pytest.raises(typer.Exit) as exit_info, user_errors():
        open(tmp_path)
    assert exit_info.value.exit_code == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_files_that_are_not_utf8_are_named(run, tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\xff\xfe")
    _fails(["train", "--steps", 1, "--guard-config", bad, "--out", tmp_path / "r"], f"{str(bad)!r} is not UTF-8")
    _fails(["train", "--steps", 1, "--faults", bad, "--out", tmp_path / "r"], f"{str(bad)!r} is not UTF-8")
    (run / "checkpoint" / "manifest.json").write_bytes(b"\xff\xfe")
    _resume_fails(run, "corrupt checkpoint manifest", "manifest.json' is not UTF-8")


@pytest.mark.parametrize("args, needle", [(["demo", "--steps", "-3"], "the demo needs at least 2 steps"),
                                          (["train", "--steps", "1", "--timeout", "-5"], "--timeout -5 must be > 0")])
def test_bad_numbers_are_refused(tmp_path, args, needle):
    _fails([*args, "--out", tmp_path / "r"], needle)
    assert not (tmp_path / "r").exists()
