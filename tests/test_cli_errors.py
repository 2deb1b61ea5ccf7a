"""Bad input: one-line error naming the problem, exit code 2, nothing written."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app

runner = CliRunner()


def _fails(args, *needles):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    text = result.output
    assert "error:" in text
    for needle in needles:
        assert needle in text, text
    return text


def test_unknown_preset(tmp_path):
    _fails(["train", "--preset", "huge", "--out", str(tmp_path / "r")], "huge", "tiny, small, base")
    assert not (tmp_path / "r").exists()


def test_unknown_workload(tmp_path):
    _fails(["train", "--workload", "resnet", "--out", str(tmp_path / "r")], "resnet", "gpt, cnn")
    assert not (tmp_path / "r").exists()


def test_negative_steps(tmp_path):
    _fails(["train", "--steps", "-1", "--out", str(tmp_path / "r")], "-1", ">= 0")
    assert not (tmp_path / "r").exists()


def test_missing_corpus(tmp_path):
    _fails(["train", "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "r")], "nope")
    assert not (tmp_path / "r").exists()


def test_out_holding_another_run(tmp_path):
    assert runner.invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "r")]).exit_code == 0
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    _fails(["train", "--steps", "1", "--out", str(tmp_path / "r")], "already holds another run")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before


def test_tampered_checkpoint(tmp_path):
    assert runner.invoke(app, ["train", "--steps", "1", "--out", str(tmp_path / "r")]).exit_code == 0
    state = tmp_path / "r" / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    _fails(["train", "--resume", str(tmp_path / "r"), "--steps", "3"], "does not match its manifest")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_does_not_import_torch(args):
    code = ("import sys; sys.argv = ['sdcscope'] + %r\n"
            "from sdcscope.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')" % args)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
