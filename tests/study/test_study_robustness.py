"""Campaign robustness: orphaned workers, a relative corpus, two runners on one directory,
``sampling.by`` as a string, typed workload fields, the run report's guard label."""

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import sdcscope.cli.campaign_cmd  # noqa: F401  (registers the commands, as cli/app.py does)
from helpers import CAMPAIGN_SPEC, one_line_error
from sdcscope.cli import app
from sdcscope.study import Sampling, init_campaign, load_campaign, run_campaign
from sdcscope.study.runner import LOCK_FILE, SPEC_FILE, CampaignBusyError
from sdcscope.workloads import WorkloadConfig, make_workload

cli = CliRunner()
SPEC = CAMPAIGN_SPEC.replace("name: cli", "name: robust")


# -- 1. a worker whose runner is gone exits --------------------------------------------------


def _child(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=20, capture_output=True, text=True)


def test_worker_watchdog_exits_when_the_given_runner_is_not_its_parent():
    # the runner's pid is handed in; a child whose parent is not that pid (runner gone) stops
    t0 = time.monotonic()
    done = _child(
        "import os\nfrom sdcscope.study.runner import _exit_with_parent\n"
        "_exit_with_parent(os.getppid() + 999999)\nprint('still here')"
    )
    assert done.returncode == 1 and "still here" not in done.stdout
    assert time.monotonic() - t0 < 15


def test_worker_init_exits_at_once_when_the_runner_died_before_it_started(tmp_path):
    done = _child(
        f"import os\nfrom sdcscope.study.runner import _init_worker\n"
        f"_init_worker({str(tmp_path)!r}, {{}}, os.getppid() + 999999)\nprint('still here')"
    )
    assert done.returncode == 1 and "still here" not in done.stdout


def test_worker_init_watches_the_given_pid(monkeypatch):
    import sdcscope.study.runner as runner

    started = []
    monkeypatch.setattr(
        runner.threading,
        "Thread",
        lambda target, args, daemon: type("T", (), {"start": lambda self: started.append((target, args))})(),
    )
    monkeypatch.setattr(runner, "Worker", lambda directory, spec: ("worker", directory))
    runner._init_worker("d", {}, os.getppid())
    assert started == [(runner._exit_with_parent, (os.getppid(),))] and runner._WORKER == ("worker", "d")


# -- 2. a relative corpus is the spec file's, wherever the campaign runs from ----------------


def _corpus_text() -> str:
    return "".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog\n" for i in range(200))


def test_relative_corpus_resolves_against_the_spec_folder(tmp_path, monkeypatch):
    specs, elsewhere = tmp_path / "specs", tmp_path / "elsewhere"
    (specs / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (specs / "data" / "c.txt").write_text(_corpus_text())
    (elsewhere / "data").mkdir()  # a decoy with the same relative path
    (elsewhere / "data" / "c.txt").write_text(_corpus_text().upper())
    (specs / "c.yaml").write_text(SPEC.replace("eval_batches: 1}", "eval_batches: 1, corpus: data/c.txt}"))
    corpus = str((specs / "data" / "c.txt").resolve())

    monkeypatch.chdir(tmp_path)  # init from one directory (the spec's folder is not the cwd)
    spec, _ = init_campaign(tmp_path / "camp", "specs/c.yaml")
    assert spec.workload["corpus"] == corpus
    stored = load_campaign(tmp_path / "camp" / SPEC_FILE)
    assert stored.workload["corpus"] == corpus and stored.hash == spec.hash

    monkeypatch.chdir(elsewhere)  # run from another: the same data, the same spec hash
    again = load_campaign(tmp_path / "camp" / SPEC_FILE)
    assert again.hash == spec.hash
    assert make_workload(again.workload_config()).corpus.source == corpus
    summary = run_campaign(tmp_path / "camp", workers=0)
    assert summary["done"] == summary["trials"] == 2


def test_missing_corpus_is_named_at_init_and_nothing_is_written(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC.replace("eval_batches: 1}", "eval_batches: 1, corpus: nope.txt}"))
    line = one_line_error(
        cli.invoke(app, ["campaign", "init", str(tmp_path / "camp"), "--spec", str(tmp_path / "c.yaml")])
    )
    assert "nope.txt" in line and "does not exist" in line and str(tmp_path) in line
    assert not (tmp_path / "camp").exists()


# -- 3. one runner per campaign directory ----------------------------------------------------


def test_a_second_runner_is_refused_while_one_holds_the_directory(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC)
    camp = tmp_path / "camp"
    init_campaign(camp, tmp_path / "c.yaml")
    with open(camp / LOCK_FILE, "a+") as held:  # this process plays the active runner
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        with pytest.raises(CampaignBusyError, match=r"another `campaign run` is active on .*\(pid 4242\)"):
            run_campaign(camp, workers=0)
        line = one_line_error(cli.invoke(app, ["campaign", "run", str(camp), "--workers", "0"]))
        assert "another `campaign run` is active" in line and "4242" in line
        assert not (camp / "golden").exists()  # refused before any work
    summary = run_campaign(camp, workers=0)  # the lock died with its holder: runs
    assert summary["done"] == summary["trials"] == 2
    with open(camp / LOCK_FILE, "a+") as again:  # and the run released it
        fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)


# -- 4. sampling.by ----------------------------------------------------------------------------


def test_sampling_by_takes_a_single_dimension_name():
    assert Sampling(kind="stratified", n=3, by="bit").by == ("bit",)
    assert Sampling(kind="stratified", n=3, by=["bit", "site"]).by == ("bit", "site")
    spec = load_campaign(SPEC + "sampling: {kind: stratified, n: 2, by: bit}\n")
    assert spec.sampling.by == ("bit",)


@pytest.mark.parametrize(
    "by,words",
    [
        ([1], ["sampling.by", "1", "bit"]),
        ([["bit"]], ["sampling.by", "['bit']"]),
        ({"bit": 1}, ["sampling.by", "{'bit': 1}"]),
        ("bits", ["unknown sampling.by 'bits'", "did you mean 'bit'"]),
    ],
)
def test_sampling_by_refuses_non_names(by, words):
    with pytest.raises((TypeError, ValueError)) as info:
        Sampling(kind="stratified", n=3, by=by)
    for w in words:
        assert w in str(info.value)


# -- 5. typed workload fields --------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("qk_norm", "no", ["qk_norm='no'", "true, false"]),
        ("qk_norm", 1, ["qk_norm=1", "boolean"]),
        ("lr", True, ["lr=True", "> 0"]),
        ("lr", "fast", ["lr='fast'", "finite number > 0"]),
        ("lr", float("inf"), ["lr=inf", "finite"]),
        ("lr", float("nan"), ["lr=nan"]),
        ("lr", 0, ["lr=0", "> 0"]),
        ("grad_clip", "x", ["grad_clip='x'", ">= 0"]),
        ("grad_clip", -1.0, ["grad_clip=-1.0", ">= 0"]),
        ("z_loss", "abc", ["z_loss='abc'", ">= 0"]),
        ("z_loss", float("inf"), ["z_loss=inf"]),
        ("weight_decay", "0.1", ["weight_decay='0.1'"]),
        ("weight_decay", -0.5, ["weight_decay=-0.5", ">= 0"]),
        ("warmup", 2.5, ["warmup=2.5", "integer"]),
        ("batch_size", True, ["batch_size=True"]),
        ("eval_batches", "2", ["eval_batches='2'"]),
        ("max_corpus_bytes", 0, ["max_corpus_bytes=0"]),
        ("corpus", 5, ["corpus=5", "path"]),
    ],
)
def test_workload_fields_are_type_checked(field, value, words):
    # a wrong type (a string, a bool, a float where an int is expected) is a TypeError; a wrong value a ValueError
    wrong_type = isinstance(value, (str, bool)) or (
        field in ("qk_norm", "warmup", "batch_size", "eval_batches", "corpus")
        and not isinstance(value, bool)
        and value != 0
    )
    with pytest.raises(TypeError if wrong_type else ValueError) as info:
        WorkloadConfig(workload="gpt", **{field: value})
    for w in words:
        assert w in str(info.value)


def test_workload_fields_in_a_campaign_spec_name_the_field(tmp_path):
    (tmp_path / "c.yaml").write_text(SPEC.replace("eval_batches: 1}", "eval_batches: 1, qk_norm: 'no'}"))
    line = one_line_error(
        cli.invoke(app, ["campaign", "init", str(tmp_path / "camp"), "--spec", str(tmp_path / "c.yaml")])
    )
    assert "qk_norm='no'" in line and "true, false" in line
    assert not (tmp_path / "camp").exists()


def test_good_workload_values_are_kept():
    cfg = WorkloadConfig(workload="gpt", lr=1, grad_clip=0, z_loss=1e-4, weight_decay=0, qk_norm=True)
    assert (cfg.lr, cfg.grad_clip, cfg.z_loss, cfg.weight_decay, cfg.qk_norm) == (1.0, 0.0, 1e-4, 0.0, True)
    assert isinstance(cfg.lr, float) and WorkloadConfig(workload="cnn").lr == 3e-3


# -- 6/7. report label, --spec a folder ------------------------------------------------------------


def test_run_report_guard_label_follows_the_guard_setting(tmp_path):
    from sdcscope.study.report import build_report

    run = tmp_path / "run"
    run.mkdir()
    config = {
        "workload": {"workload": "gpt", "preset": "tiny"},
        "train": {"seed": 0},
        "world_size": 2,
        "backend": "gloo",
        "crossrank": True,
        "guard": None,
    }
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    line = build_report(run)["line"]
    assert "guard off" in line and "cross-rank checks on" in line
    (run / "config.json").write_text(json.dumps({**config, "guard": {"replay": True}}))
    assert "guard on" in build_report(run)["line"]


def test_init_spec_a_folder_says_so(tmp_path):
    line = one_line_error(cli.invoke(app, ["campaign", "init", str(tmp_path / "camp"), "--spec", str(tmp_path)]))
    assert "is a directory, not a spec file" in line
