"""Bad input found by the CLI QA pass (F3-F7): refused before any work, exit code 2, one line
naming the value, nothing written."""

import importlib.util
import os

import pytest
import torch
from typer.testing import CliRunner

import sdcscope.cli.campaign_cmd  # noqa: F401  (registers the commands, as cli/app.py does)
import sdcscope.cli.invariants_cmd  # noqa: F401
import sdcscope.cli.report_cmd  # noqa: F401
from sdcscope.cli import app
from sdcscope.detect.invariants import load_invariants
from sdcscope.engine import TrainConfig
from sdcscope.engine.trainer import SEED_MAX
from sdcscope.study import init_campaign
from sdcscope.study import runner as campaign_runner
from sdcscope.study.runner import LOCK_FILE, SPEC_FILE, CampaignBusyError

from test_study_cli import SPEC, _err

cli = CliRunner()


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A tiny traced run (trace.jsonl), as `invariants infer` and `check` need."""
    run = tmp_path_factory.mktemp("qa") / "tr"
    r = invoke("invariants", "trace", "--steps", 2, "--batch-size", 2, "--out", run)
    assert r.exit_code == 0, r.output
    return run


# -- F3: a refused `campaign run` leaves no run.lock ----------------------------------------

@pytest.mark.parametrize("text,words", [
    ("name: x\nworkload: {name: gpt\n", ["malformed YAML"]),
    (SPEC.replace("blocks.0.mlp.fc", "blocks.0.mlp.fx"), ["blocks.0.mlp.fx"]),
    (SPEC + "seed: 18446744073709551616\n", ["seed must be in 0..18446744073709551615", "18446744073709551616"]),
], ids=["malformed_yaml", "unknown_target", "seed_above_2_64"])
def test_campaign_run_refusing_a_hand_made_spec_leaves_the_directory_as_it_was(tmp_path, text, words):
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / SPEC_FILE).write_text(text)
    before = _files(camp)
    line = _err(invoke("campaign", "run", camp, "-j", 0))
    assert all(w in line for w in words), line
    assert _files(camp) == before


def test_campaign_run_refused_after_the_lock_removes_the_lock_file_it_created(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC)
    camp = tmp_path / "camp"
    init_campaign(camp, tmp_path / "c.yaml")
    (camp / SPEC_FILE).write_text((camp / SPEC_FILE).read_text().replace("horizon: 2", "horizon: 3"))
    before = _files(camp)
    assert "holds results of another campaign spec" in _err(invoke("campaign", "run", camp, "-j", 0))
    assert _files(camp) == before
    (camp / LOCK_FILE).write_text("")  # a lock file it did not create is kept
    _err(invoke("campaign", "run", camp, "-j", 0))
    assert (camp / LOCK_FILE).is_file()


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
def test_campaign_run_without_ray_writes_nothing(tmp_path):
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / SPEC_FILE).write_text(SPEC)
    line = _err(invoke("campaign", "run", camp, "--ray-address", "bogus://x"))
    assert "--ray-address 'bogus://x' needs Ray" in line
    assert _files(camp) == {SPEC_FILE: SPEC.encode()}  # neither run.lock nor results.sqlite


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


# -- F4: seeds torch cannot take are refused by name at validation --------------------------

def test_seed_bound_is_torchs():
    torch.Generator().manual_seed(SEED_MAX)
    with pytest.raises(ValueError, match="Overflow"):
        torch.Generator().manual_seed(SEED_MAX + 1)
    assert TrainConfig(seed=SEED_MAX).seed == SEED_MAX
    for bad in (SEED_MAX + 1, -1):
        with pytest.raises(ValueError, match=rf"seed={bad} must be an integer in 0\.\.{SEED_MAX}"):
            TrainConfig(seed=bad)


def test_train_refuses_a_seed_above_2_64(tmp_path):
    line = _err(invoke("train", "--steps", 1, "--seed", 2**64, "--out", tmp_path / "r"))
    assert f"seed={2**64} must be an integer in 0..{2**64 - 1}" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra,words", [
    ("seed: 99999999999999999999999\n", ["seed must be in 0..18446744073709551615, got 99999999999999999999999"]),
    ("seed: -1\n", ["seed must be in 0..18446744073709551615, got -1"]),
    (None, ["baseline seed must be in 0..9223372036854775807, got 9223372036854775808"]),
], ids=["seed_above_2_64", "seed_negative", "baseline_seed_above_sqlite"])
def test_campaign_init_refuses_seeds_out_of_range(tmp_path, extra, words):
    text = SPEC + extra if extra else SPEC.replace("seeds: [5, 6]", "seeds: [5, 9223372036854775808]")
    (tmp_path / "c.yaml").write_text(text)
    line = _err(invoke("campaign", "init", tmp_path / "camp", "--spec", tmp_path / "c.yaml"))
    assert all(w in line for w in words), line
    assert not (tmp_path / "camp").exists()


# -- F5: `report` on a folder of runs checks every run before writing any report ------------

def test_report_on_a_folder_with_a_bad_run_writes_nothing(tmp_path):
    runs = tmp_path / "runs"
    assert invoke("train", "--steps", 1, "--batch-size", 2, "--out", runs / "a").exit_code == 0
    (runs / "b").mkdir()
    (runs / "b" / "config.json").write_text("{{{")
    before = _files(runs)
    line = _err(invoke("report", runs))
    assert "config.json" in line and "not valid JSON" in line, line
    assert _files(runs) == before
    (runs / "b" / "config.json").unlink()
    (runs / "b").rmdir()
    r = invoke("report", runs)
    assert r.exit_code == 0 and (runs / "a" / "report.html").is_file() and (runs / "a" / "report.md").is_file()


# -- F6: an invariants file without invariants is refused -----------------------------------

def test_an_empty_invariants_list_is_refused_naming_the_file(tmp_path, traced):
    empty = tmp_path / "inv.yaml"
    empty.write_text("[]\n")
    with pytest.raises(ValueError, match=rf"invariants file '{empty}' holds no invariants"):
        load_invariants(empty)
    before = _files(traced)
    line = _err(invoke("invariants", "check", traced, "-i", empty))
    assert f"'{empty}' holds no invariants" in line
    assert _files(traced) == before  # events.jsonl untouched
    line = _err(invoke("train", "--steps", 1, "--batch-size", 2, "--invariants", empty, "--out", tmp_path / "r"))
    assert f"'{empty}' holds no invariants" in line
    assert not (tmp_path / "r").exists()


# -- F7: `invariants infer --out` is checked before inference -------------------------------

def test_infer_refuses_an_existing_out_file_unless_forced(tmp_path, traced):
    out = tmp_path / "inv.yaml"
    out.write_text("# my hand-edited invariants\n")
    for run in (traced, tmp_path / "nope"):  # refused before the runs are even read
        line = _err(invoke("invariants", "infer", run, "--out", out, "--min-support", 1))
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
    line = _err(invoke("invariants", "infer", nope, "--out", tmp_path / "od"))
    assert f"--out '{tmp_path / 'od'}' is a folder; give a file" in line
    line = _err(invoke("invariants", "infer", nope, "--out", tmp_path / "f" / "inv.yaml"))
    assert f"'{tmp_path / 'f'}' is a file, not a folder" in line
    line = _err(invoke("invariants", "infer", nope, "--out", "/proc/qa_sdcscope/inv.yaml"))
    assert "--out '/proc/qa_sdcscope/inv.yaml' cannot be written: '/proc' refuses new files" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "od"] and not any((tmp_path / "od").iterdir())
