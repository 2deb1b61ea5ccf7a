"""``sdcscope campaign init|run|status`` and ``sdcscope report``: one-line errors, nothing written on them."""

import pytest
from typer.testing import CliRunner

import sdcscope.cli.campaign_cmd  # noqa: F401  (registers the commands, as cli/app.py does)
import sdcscope.cli.report_cmd  # noqa: F401
from sdcscope.cli import app

runner = CliRunner()
SPEC = """
name: cli
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [2]
horizon: 2
faults: {sites: [gemm.forward], targets: [blocks.0.mlp.fc], bits: [30, 31]}
baseline: {seeds: [5, 6]}
"""


def _err(result):
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


@pytest.mark.parametrize("text,words", [
    (SPEC.replace("horizon: 2", "horizon: 0"), ["horizon must be >= 1"]),
    (SPEC.replace("bits: [30, 31]", "bits: []"), ["fault space would be empty"]),
    (SPEC.replace("blocks.0.mlp.fc", "blocks.0.mlp.fx"), ["blocks.0.mlp.fx", "blocks.0.mlp.fc"]),
    ("- just\n- a list\n", ["must hold a mapping"]),
])
def test_init_refuses_bad_specs_and_writes_nothing(tmp_path, text, words):
    (tmp_path / "c.yaml").write_text(text)
    line = _err(runner.invoke(app, ["campaign", "init", str(tmp_path / "camp"), "--spec", str(tmp_path / "c.yaml")]))
    for w in words:
        assert w in line
    assert not (tmp_path / "camp").exists()


def test_run_and_report_need_a_campaign_directory(tmp_path):
    assert "campaign.yaml" in _err(runner.invoke(app, ["campaign", "run", str(tmp_path)]))
    assert "results.sqlite" in _err(runner.invoke(app, ["report", str(tmp_path)]))
    assert "results.sqlite" in _err(runner.invoke(app, ["campaign", "status", str(tmp_path)]))


def test_init_run_status_report(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC)
    camp = tmp_path / "camp"
    result = runner.invoke(app, ["campaign", "init", str(camp), "--spec", str(tmp_path / "c.yaml")])
    assert result.exit_code == 0 and "2 trials planned" in result.output, result.output
    assert "already exists" in _err(runner.invoke(app, ["campaign", "init", str(camp), "--spec",
                                                         str(tmp_path / "c.yaml")]))
    # without Ray: it names the missing extra; with Ray and no running cluster: it says so, in one line
    line = _err(runner.invoke(app, ["campaign", "run", str(camp), "--ray-address", "auto"]))
    assert "--ray-address 'auto'" in line and ("needs Ray" in line or "no Ray cluster to connect to" in line), line
    result = runner.invoke(app, ["campaign", "run", str(camp), "--workers", "0"])
    assert result.exit_code == 0 and "2/2 trials done (2 run now)" in result.output, result.output
    result = runner.invoke(app, ["campaign", "status", str(camp)])
    assert result.exit_code == 0 and "2/2 trials done:" in result.output, result.output
    result = runner.invoke(app, ["report", str(camp)])
    assert result.exit_code == 0 and (camp / "report.html").is_file() and (camp / "report.md").is_file()
    assert "-1" in _err(runner.invoke(app, ["campaign", "run", str(camp), "--workers", "-1"]))
