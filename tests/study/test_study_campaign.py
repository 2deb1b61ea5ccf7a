"""A 40-trial campaign on the tiny GPT end to end; kill -9 and resume; refusals; the report."""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from sdcscope.study import (
    OUTCOMES,
    ResultsDB,
    classify,
    init_campaign,
    load_campaign,
    prediction_bound,
    run_campaign,
    write_report,
)
from sdcscope.study.stats import THRESHOLD_MEASURES

SPEC = """
name: ci-40
workload: {name: gpt, preset: tiny, batch_size: 8, eval_batches: 1}
inject_steps: [5]
horizon: 5
faults:
  sites: [gemm.forward, gemm.grad_input, gemm.grad_weight]
  targets: ["blocks.*.attn.*_proj", "blocks.*.mlp.*", head]
  models: [bitflip]
  bits: ["0-31"]
sampling: {kind: random, n: 40, seed: 1}
baseline: {seeds: [101, 102, 103]}
"""


def _rows(directory):
    con = sqlite3.connect(directory / "results.sqlite")
    con.row_factory = sqlite3.Row
    try:
        return [
            {k: r[k] for k in r.keys() if k != "wall_s"} for r in con.execute("SELECT * FROM trials ORDER BY trial_id")
        ]
    finally:
        con.close()


def _count(directory):
    try:
        con = sqlite3.connect(directory / "results.sqlite", timeout=1)
        try:
            return con.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "campaign.yaml"
    path.write_text(SPEC)
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, spec_file):
    directory = tmp_path_factory.mktemp("runs") / "full"
    init_campaign(directory, spec_file)
    summary = run_campaign(directory, workers=2)
    assert summary["done"] == summary["trials"] == 40
    return directory


def test_campaign_rows_are_complete_and_classified(finished):
    rows = _rows(finished)
    assert [r["trial_id"] for r in rows] == list(range(40)) and len({r["key"] for r in rows}) == 40
    spec = load_campaign(finished / "campaign.yaml")
    assert all(r["spec_hash"] == spec.hash and r["outcome"] in OUTCOMES for r in rows)
    assert all(r["fired"] == 1 and r["injections"] == 1 and len(r["losses"]) > 0 for r in rows)
    with ResultsDB(finished / "results.sqlite", spec) as db:
        baselines, thresholds = db.baselines(), db.thresholds()[5]
        trials = db.trials()
    assert len(baselines) == 3
    for measure in THRESHOLD_MEASURES:  # thresholds come from the recorded healthy spread
        want = prediction_bound([abs(b[measure]) for b in baselines], 0.01)["bound"]
        assert thresholds[measure] == pytest.approx(want)
    for r in trials:  # and every outcome follows from them
        m = {**r, "crash": bool(r["crash"]), "masked": bool(r["masked"])}
        assert classify(m, thresholds, guard=False) == {k: r[k] for k in ("effect", "sdc_kind", "outcome")}
        if r["outcome"] == "masked":
            assert r["dist_golden"] in (0.0, None) and r["val_delta"] in (0.0, None)


def test_kill_and_resume_equals_uninterrupted(finished, spec_file, tmp_path):
    directory = tmp_path / "killed"
    init_campaign(directory, spec_file)
    code = f"from sdcscope.study import run_campaign; run_campaign({str(directory)!r}, workers=2)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    try:
        while _count(directory) < 6 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers, mid-campaign
        proc.wait()
    partial = _count(directory)
    assert 6 <= partial < 40
    summary = run_campaign(directory, workers=0)  # resume, with another worker count
    assert summary["ran"] == 40 - partial and summary["done"] == 40
    assert _rows(directory) == _rows(finished)


def test_results_of_another_spec_are_refused_and_kept(finished, tmp_path):
    directory = tmp_path / "other"
    shutil.copytree(finished, directory)
    before = (directory / "results.sqlite").read_bytes()
    (directory / "campaign.yaml").write_text(SPEC.replace("horizon: 5", "horizon: 6"))
    with pytest.raises(ValueError, match="another campaign spec"):
        run_campaign(directory, workers=0)
    assert (directory / "results.sqlite").read_bytes() == before
    (directory / "results.sqlite").write_bytes(b"not a database at all" * 10)
    (directory / "campaign.yaml").write_text(SPEC)
    with pytest.raises(ValueError, match="not an sdcscope results database"):
        run_campaign(directory, workers=0)


def test_rerun_of_a_finished_campaign_runs_nothing(finished):
    summary = run_campaign(finished, workers=2)
    assert summary["ran"] == 0 and summary["done"] == 40


def test_report_is_self_contained(finished):
    html, md = write_report(finished)
    text = html.read_text()
    assert text.count("data:image/png;base64,") >= 5
    assert "http://" not in text and "https://" not in text and "<script" not in text
    summary = md.read_text()
    for heading in (
        "## Outcomes",
        "## PVF by site",
        "## PVF by target",
        "## PVF by bit",
        "## Healthy-spread thresholds",
    ):
        assert heading in summary
