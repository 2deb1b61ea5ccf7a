"""Bad input: one-line error naming the problem, exit code 2, nothing written."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from helpers import cli_fails, one_line_error
from sdcscope.cli import app
from sdcscope.cli.common import user_errors

runner = CliRunner()


def test_unknown_preset(tmp_path):
    cli_fails(["train", "--preset", "huge", "--out", str(tmp_path / "r")], "huge", "tiny, small, base")
    assert not (tmp_path / "r").exists()


def test_unknown_workload(tmp_path):
    cli_fails(["train", "--workload", "resnet", "--out", str(tmp_path / "r")], "resnet", "gpt, cnn")
    assert not (tmp_path / "r").exists()


def test_negative_steps(tmp_path):
    cli_fails(["train", "--steps", "-1", "--out", str(tmp_path / "r")], "-1", ">= 0")
    assert not (tmp_path / "r").exists()


def test_missing_corpus(tmp_path):
    cli_fails(["train", "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "r")], "nope")
    assert not (tmp_path / "r").exists()


def test_out_holding_another_run(tmp_path):
    assert runner.invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "r")]).exit_code == 0
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    cli_fails(["train", "--steps", "1", "--out", str(tmp_path / "r")], "already holds another run")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before


def test_tampered_checkpoint(tmp_path):
    assert runner.invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "r")]).exit_code == 0
    state = tmp_path / "r" / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    cli_fails(["train", "--resume", str(tmp_path / "r"), "--steps", "3"], "does not match its manifest")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_does_not_import_torch(args):
    code = (
        f"import sys; sys.argv = ['sdcscope'] + {args!r}\n"
        "from sdcscope.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_train_refuses_a_seed_above_2_64(tmp_path):
    line = one_line_error(invoke("train", "--steps", 1, "--seed", 2**64, "--out", tmp_path / "r"))
    assert f"seed={2**64} must be an integer in 0..{2**64 - 1}" in line
    assert not (tmp_path / "r").exists()


def test_report_on_a_folder_with_a_bad_run_writes_nothing(tmp_path):
    runs = tmp_path / "runs"
    assert invoke("train", "--steps", 1, "--batch-size", 2, "--out", runs / "a").exit_code == 0
    (runs / "b").mkdir()
    (runs / "b" / "config.json").write_text("{{{")
    before = _files(runs)
    line = one_line_error(invoke("report", runs))
    assert "config.json" in line and "not valid JSON" in line, line
    assert _files(runs) == before
    (runs / "b" / "config.json").unlink()
    (runs / "b").rmdir()
    r = invoke("report", runs)
    assert r.exit_code == 0 and (runs / "a" / "report.html").is_file() and (runs / "a" / "report.md").is_file()


def test_a_dead_pattern_in_a_target_list_is_named(tmp_path):
    (tmp_path / "f.yaml").write_text(
        "- {site: weight, target: [blocks.1.mlp.fc.weight, blocks.1.mlp.fcc.weight], model: bitflip, bits: [3],"
        " schedule: {kind: transient, step: 1}}\n"
    )
    cli_fails(
        ["train", "--faults", tmp_path / "f.yaml", "--steps", 2, "--out", tmp_path / "r"],
        "target pattern 'blocks.1.mlp.fcc.weight'",
        "close names: blocks.1.mlp.fc.weight",
    )
    assert not (tmp_path / "r").exists()


def test_a_metrics_sink_that_cannot_be_built_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    (tmp_path / "afile").write_text("")
    (tmp_path / "tb.yaml").write_text("metrics: {sink: tensorboard, path: tb}\n")
    (tmp_path / "under.yaml").write_text(f"metrics: {{path: {tmp_path / 'afile' / 'm.jsonl'}}}\n")
    cli_fails(
        ["train", "--steps", 1, "--guard-config", tmp_path / "tb.yaml", "--out", tmp_path / "r"],
        "needs the 'tensorboard' package: pip install 'sdcscope[tensorboard]'",
    )
    cli_fails(
        ["train", "--steps", 1, "--guard-config", tmp_path / "under.yaml", "--out", tmp_path / "r"],
        "is a file, not a folder",
    )
    assert not (tmp_path / "r").exists()


def test_distributed_options_are_checked_before_launch(tmp_path):
    (tmp_path / "nm.yaml").write_text("abft: {targets: [nomatch.*]}\n")
    cli_fails(
        ["train", "--nproc", 2, "--steps", 1, "--guard-config", tmp_path, "--out", tmp_path / "r"],
        "--guard-config",
        "is a folder",
    )
    cli_fails(
        ["train", "--nproc", 2, "--steps", 1, "--guard-config", tmp_path / "nm.yaml", "--out", tmp_path / "r"],
        "ABFT targets pattern 'nomatch.*' matches no eligible module",
    )
    cli_fails(  # rank r serves on port + r: rank 2 would have no port
        ["train", "--nproc", 3, "--steps", 1, "--prometheus-port", 65534, "--out", tmp_path / "r"],
        "65536 (rank 2) is above 65535",
    )
    cli_fails(  # no per-step metrics over shards, said why (it said "not supported yet" for any --nproc)
        ["train", "--nproc", 2, "--parallel", "fsdp", "--prometheus-port", 0, "--out", tmp_path / "r"],
        "which a sharded run has not: per-step metrics read whole parameters",
    )
    assert not (tmp_path / "r").exists()


def test_remaining_os_errors_are_one_line_naming_the_path(tmp_path, capsys):
    with pytest.raises(typer.Exit) as exit_info, user_errors():
        open(tmp_path)
    assert exit_info.value.exit_code == 2
    assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["demo", "--steps", "-3"], "the demo needs at least 2 steps"),
        (["train", "--steps", "1", "--timeout", "-5"], "--timeout -5 must be > 0"),
    ],
)
def test_bad_numbers_are_refused(tmp_path, args, needle):
    cli_fails([*args, "--out", tmp_path / "r"], needle)
    assert not (tmp_path / "r").exists()
