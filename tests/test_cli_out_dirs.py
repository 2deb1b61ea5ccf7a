"""Output folders: the demo replaces only its own earlier output, and a folder that cannot be
written is refused before any work, by every command that writes a run."""

import sys

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app

runner = CliRunner()


def test_the_demo_replaces_its_own_output_and_nothing_else(tmp_path):
    out = tmp_path / "demo"
    first = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])
    assert first.exit_code == 0, first.output
    made = sorted(p.name for p in out.iterdir())
    again = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])   # its own output: replaced
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == made
    (out / "notes.txt").write_text("mine")
    (out / "src").mkdir()
    refused = runner.invoke(app, ["demo", "--steps", "2", "--out", str(out)])
    assert refused.exit_code == 2
    assert "holds an earlier demo and other files (notes.txt, src)" in refused.output
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == sorted(
        made + ["notes.txt", "src"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("args", [["train", "--steps", "1"], ["demo", "--steps", "2"],
                                  ["invariants", "trace", "--steps", "1"]])
def test_an_output_folder_that_cannot_be_written_is_refused_first(args):
    result = runner.invoke(app, [*args, "--out", "/proc/sdcscope-run"])
    assert result.exit_code == 2, result.output
    assert "--out '/proc/sdcscope-run' cannot be written: '/proc' refuses new files" in result.output
