"""Output folders: the demo replaces only its own earlier output, and a folder that cannot be
written is refused before any work, by every command that writes a run."""

import sys

import pytest
from typer.testing import CliRunner

from helpers import cli_fails, cli_invoke
from sdcscope.cli import app

runner = CliRunner()


def test_the_demo_replaces_its_own_output_and_nothing_else(tmp_path):
    out = tmp_path / "demo"
    first = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])
    assert first.exit_code == 0, first.output
    made = sorted(p.name for p in out.iterdir())
    again = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])  # its own output: replaced
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == made
    (out / "notes.txt").write_text("mine")
    (out / "src").mkdir()
    refused = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])
    assert refused.exit_code == 2
    assert "holds an earlier demo and other files (notes.txt, src)" in refused.output
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == sorted(
        made + ["notes.txt", "src"]
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize(
    "args", [["train", "--steps", "1"], ["demo", "--steps", "2"], ["invariants", "trace", "--steps", "1"]]
)
def test_an_output_folder_that_cannot_be_written_is_refused_first(args):
    result = runner.invoke(app, [*args, "--out", "/proc/sdcscope-run"])
    assert result.exit_code == 2, result.output
    assert "--out '/proc/sdcscope-run' cannot be written: '/proc' refuses new files" in result.output


@pytest.mark.parametrize(
    "flag, args",
    [
        ("--out", ["train", "--steps", 0, "--out", ""]),
        ("--out", ["train", "--steps", 0, "-o", " "]),
        ("--out", ["train", "--steps", 0, "--out=", "--faults", "f.yaml"]),
        ("--faults", ["train", "--steps", 0, "--out", "x", "--faults", ""]),
        ("--resume", ["train", "--steps", 0, "--resume", ""]),
        ("--out", ["inject", "--steps", 1, "--spec", "f.yaml", "--out", ""]),
        ("--out", ["demo", "--steps", 2, "--out", ""]),
        ("--out", ["invariants", "trace", "--steps", 0, "--out", ""]),
        ("directory", ["campaign", "init", "", "--spec", "c.yaml"]),
    ],
)
def test_an_empty_path_option_is_refused_before_any_work(tmp_path, monkeypatch, flag, args):
    """Typer reads ``--out ""`` as ``.``: the run went into the working directory."""
    monkeypatch.chdir(tmp_path)
    code, text = cli_invoke(*args)
    assert code == 2, text
    assert f"Invalid value for '{flag}'" in text and "is not a path" in text and "Traceback" not in text, text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command", [["train", "--steps", "1"], ["inject", "--spec", "SPEC", "--steps", "2"], ["demo", "--steps", "2"]]
)
def test_an_out_below_a_file_is_refused(tmp_path, command):
    (tmp_path / "afile").write_text("")
    (tmp_path / "f.yaml").write_text(
        "- {site: weight, target: head, model: zero, schedule: {kind: transient, step: 0}}\n"
    )
    args = [str(tmp_path / "f.yaml") if a == "SPEC" else a for a in command]
    cli_fails([*args, "--out", tmp_path / "afile" / "run"], f"{str(tmp_path / 'afile')!r} is a file, not a folder")
