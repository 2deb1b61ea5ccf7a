"""``sdcscope campaign init|run|status`` and ``sdcscope report``: one-line errors, nothing written on them."""

import importlib.util
import os

import pytest
from typer.testing import CliRunner

import sdcscope.cli.campaign_cmd  # noqa: F401  (registers the commands, as cli/app.py does)
import sdcscope.cli.report_cmd  # noqa: F401
from helpers import CAMPAIGN_SPEC, one_line_error
from sdcscope.cli import app
from sdcscope.study import init_campaign
from sdcscope.study import runner as campaign_runner
from sdcscope.study.runner import LOCK_FILE, SPEC_FILE, CampaignBusyError

runner = CliRunner()


@pytest.mark.parametrize(
    "text,words",
    [
        (CAMPAIGN_SPEC.replace("horizon: 2", "horizon: 0"), ["horizon must be >= 1"]),
        (CAMPAIGN_SPEC.replace("bits: [30, 31]", "bits: []"), ["fault space would be empty"]),
        (CAMPAIGN_SPEC.replace("blocks.0.mlp.fc", "blocks.0.mlp.fx"), ["blocks.0.mlp.fx", "blocks.0.mlp.fc"]),
        ("- just\n- a list\n", ["must hold a mapping"]),
    ],
)
def test_init_refuses_bad_specs_and_writes_nothing(tmp_path, text, words):
    (tmp_path / "c.yaml").write_text(text)
    line = one_line_error(
        runner.invoke(app, ["campaign", "init", str(tmp_path / "camp"), "--spec", str(tmp_path / "c.yaml")])
    )
    for w in words:
        assert w in line
    assert not (tmp_path / "camp").exists()


def test_run_and_report_need_a_campaign_directory(tmp_path):
    assert "campaign.yaml" in one_line_error(runner.invoke(app, ["campaign", "run", str(tmp_path)]))
    assert "results.sqlite" in one_line_error(runner.invoke(app, ["report", str(tmp_path)]))
    assert "results.sqlite" in one_line_error(runner.invoke(app, ["campaign", "status", str(tmp_path)]))


def test_init_run_status_report(tmp_path):
    (tmp_path / "c.yaml").write_text(CAMPAIGN_SPEC)
    camp = tmp_path / "camp"
    result = runner.invoke(app, ["campaign", "init", str(camp), "--spec", str(tmp_path / "c.yaml")])
    assert result.exit_code == 0 and "2 trials planned" in result.output, result.output
    assert "already exists" in one_line_error(
        runner.invoke(app, ["campaign", "init", str(camp), "--spec", str(tmp_path / "c.yaml")])
    )
    # without Ray: it names the missing extra; with Ray and no running cluster: it says so, in one line
    line = one_line_error(runner.invoke(app, ["campaign", "run", str(camp), "--ray-address", "auto"]))
    assert "--ray-address 'auto'" in line and ("needs Ray" in line or "no Ray cluster to connect to" in line), line
    result = runner.invoke(app, ["campaign", "run", str(camp), "--workers", "0"])
    assert result.exit_code == 0 and "2/2 trials done (2 run now)" in result.output, result.output
    result = runner.invoke(app, ["campaign", "status", str(camp)])
    assert result.exit_code == 0 and "2/2 trials done:" in result.output, result.output
    result = runner.invoke(app, ["report", str(camp)])
    assert result.exit_code == 0 and (camp / "report.html").is_file() and (camp / "report.md").is_file()
    assert "-1" in one_line_error(runner.invoke(app, ["campaign", "run", str(camp), "--workers", "-1"]))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    "text,words",
    [
        ("name: x\nworkload: {name: gpt\n", ["malformed YAML"]),
        (CAMPAIGN_SPEC.replace("blocks.0.mlp.fc", "blocks.0.mlp.fx"), ["blocks.0.mlp.fx"]),
        (
            CAMPAIGN_SPEC + "seed: 18446744073709551616\n",
            ["seed must be in 0..18446744073709551615", "18446744073709551616"],
        ),
    ],
    ids=["malformed_yaml", "unknown_target", "seed_above_2_64"],
)
def test_campaign_run_refusing_a_hand_made_spec_leaves_the_directory_as_it_was(tmp_path, text, words):
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / SPEC_FILE).write_text(text)
    before = _files(camp)
    line = one_line_error(invoke("campaign", "run", camp, "-j", 0))
    assert all(w in line for w in words), line
    assert _files(camp) == before


def test_campaign_run_refused_after_the_lock_removes_the_lock_file_it_created(tmp_path):
    (tmp_path / "c.yaml").write_text(CAMPAIGN_SPEC)
    camp = tmp_path / "camp"
    init_campaign(camp, tmp_path / "c.yaml")
    (camp / SPEC_FILE).write_text((camp / SPEC_FILE).read_text().replace("horizon: 2", "horizon: 3"))
    before = _files(camp)
    assert "holds results of another campaign spec" in one_line_error(invoke("campaign", "run", camp, "-j", 0))
    assert _files(camp) == before
    (camp / LOCK_FILE).write_text("")  # a lock file it did not create is kept
    one_line_error(invoke("campaign", "run", camp, "-j", 0))
    assert (camp / LOCK_FILE).is_file()


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
def test_campaign_run_without_ray_writes_nothing(tmp_path):
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / SPEC_FILE).write_text(CAMPAIGN_SPEC)
    line = one_line_error(invoke("campaign", "run", camp, "--ray-address", "bogus://x"))
    assert "--ray-address 'bogus://x' needs Ray" in line
    assert _files(camp) == {SPEC_FILE: CAMPAIGN_SPEC.encode()}  # neither run.lock nor results.sqlite


def test_a_runner_that_opened_a_lock_file_a_failed_run_removed_locks_a_new_one(tmp_path, monkeypatch):
    path, real_open, opened = tmp_path / LOCK_FILE, os.open, []

    def open_then_removed(file, flags, mode=0o777):
        fd = real_open(file, flags, mode)
        if not opened:  # a failed run unlinks the file right after this runner opened it
            os.unlink(file)
        opened.append(fd)
        return fd

    monkeypatch.setattr(campaign_runner.os, "open", open_then_removed)
    fd, created = campaign_runner._lock(path)
    monkeypatch.undo()
    assert len(opened) == 2 and fd == opened[1] and created
    assert os.path.samestat(os.fstat(fd), os.stat(path))  # it holds the file on disk: a second runner is refused
    with pytest.raises(CampaignBusyError):
        campaign_runner._lock(path)
    os.close(fd)


@pytest.mark.parametrize(
    "extra,words",
    [
        ("seed: 99999999999999999999999\n", ["seed must be in 0..18446744073709551615, got 99999999999999999999999"]),
        ("seed: -1\n", ["seed must be in 0..18446744073709551615, got -1"]),
        (None, ["baseline seed must be in 0..9223372036854775807, got 9223372036854775808"]),
    ],
    ids=["seed_above_2_64", "seed_negative", "baseline_seed_above_sqlite"],
)
def test_campaign_init_refuses_seeds_out_of_range(tmp_path, extra, words):
    text = CAMPAIGN_SPEC + extra if extra else CAMPAIGN_SPEC.replace("seeds: [5, 6]", "seeds: [5, 9223372036854775808]")
    (tmp_path / "c.yaml").write_text(text)
    line = one_line_error(invoke("campaign", "init", tmp_path / "camp", "--spec", tmp_path / "c.yaml"))
    assert all(w in line for w in words), line
    assert not (tmp_path / "camp").exists()
