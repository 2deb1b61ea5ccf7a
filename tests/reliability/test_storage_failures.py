"""A full disk and a read-only folder, for train, resume, inject, campaign run, campaign status and
report: one line naming the path, the documented exit code, nothing half-written and no
temporary file left; a failed resume is not recorded; a read-only campaign can still be read."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from helpers import CAMPAIGN_SPEC
from sdcscope.cli import app
from sdcscope.common.exitcodes import ExitCode
from sdcscope.engine.state import verify_checkpoint

FAULTS = """
- site: gemm.forward
  target: blocks.0.attn.q_proj
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: 5}
  schedule: {kind: transient, step: 1}
"""
TRAIN = ["--steps", "4", "--batch-size", "2"]
SLACK = 200_000
"""Free bytes on the full disk: room for config.json and the logs, not for a checkpoint."""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(result, code: int, *needles: str, said: str | None = None) -> str:
    """The command failed with ``code`` and printed exactly one line, an ``error:`` naming ``needles``
    (after one line starting with ``said``, when given: a resume says where it continues from)."""
    assert result.exit_code == code, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    if said is not None:
        assert lines and lines[0].startswith(said), result.output
        lines = lines[1:]
    text = " ".join(result.output.split())
    assert lines and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    assert len(" ".join(lines).split("error:")) == 2, result.output  # one error, however rich wraps it
    for needle in needles:
        assert needle in text, text
    return text


def debris(root) -> list[str]:
    """Temporary files an atomic write would leave, anywhere below ``root``."""
    return sorted(str(p) for p in root.rglob("*.tmp"))


def snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    assert invoke("train", *TRAIN[:1], "2", *TRAIN[2:], "--out", out).exit_code == 0
    return out


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = tmp_path_factory.mktemp("campaign")
    (root / "spec.yaml").write_text(CAMPAIGN_SPEC)
    assert invoke("campaign", "init", root / "c", "--spec", root / "spec.yaml").exit_code == 0
    ran = invoke("campaign", "run", root / "c", "--workers", "0")
    assert ran.exit_code == 0, ran.output
    return root / "c"


def test_train_on_a_full_disk(storage, tmp_path):
    disk = tmp_path / "disk"
    with storage.full(disk, slack=SLACK):
        result = invoke("train", *TRAIN, "--checkpoint-every", "2", "--out", disk / "run")
    one_line(result, ExitCode.STORAGE, "cannot write", str(disk / "run"))
    assert not (disk / "run").exists()  # a new run that could not save anything leaves nothing


def test_resume_on_a_full_disk_is_not_recorded(storage, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = (run / "config.json").read_bytes(), (run / "summary.json").read_bytes()
    with storage.full(run, slack=SLACK):
        result = invoke("train", "--resume", run, "--steps", "4")
    one_line(result, ExitCode.STORAGE, "cannot write", str(run), said="resuming from ")
    assert ((run / "config.json").read_bytes(), (run / "summary.json").read_bytes()) == before
    assert verify_checkpoint(run / "checkpoint")["step"] == 2  # the run's checkpoint is whole, as it was
    assert debris(run) == []
    assert invoke("train", "--resume", run, "--steps", "4").exit_code == 0  # once space is back


def test_inject_on_a_full_disk(storage, tmp_path):
    (tmp_path / "faults.yaml").write_text(FAULTS)
    disk = tmp_path / "disk"
    with storage.full(disk, slack=SLACK):
        result = invoke("inject", "--spec", tmp_path / "faults.yaml", *TRAIN, "--out", disk / "exp")
    one_line(result, ExitCode.STORAGE, "cannot write", str(disk / "exp"))
    assert not (disk / "exp").exists()  # no empty folder either


def test_campaign_run_on_a_full_disk(storage, tmp_path):
    (tmp_path / "spec.yaml").write_text(CAMPAIGN_SPEC)
    directory = tmp_path / "c"
    assert invoke("campaign", "init", directory, "--spec", tmp_path / "spec.yaml").exit_code == 0
    with storage.full(directory, slack=SLACK):
        result = invoke("campaign", "run", directory, "--workers", "0")
    one_line(result, ExitCode.STORAGE, "cannot write", str(directory))
    assert debris(directory) == []
    status = invoke("campaign", "status", directory)  # the database was not damaged
    assert status.exit_code == 0 and "0/2 trials done" in status.output, status.output


def test_report_on_a_full_disk_leaves_no_half_written_report(storage, campaign, tmp_path):
    directory = tmp_path / "c"
    shutil.copytree(campaign, directory)
    with storage.full(directory, slack=0):
        result = invoke("report", directory)
    one_line(result, ExitCode.STORAGE, "cannot write the report", "report.html")
    assert not (directory / "report.html").exists() and debris(directory) == []


def test_report_elsewhere_on_a_full_disk_leaves_no_folder(storage, campaign, tmp_path):
    disk = tmp_path / "disk"
    with storage.full(disk, slack=0):
        result = invoke("report", campaign, "--out", disk / "reports" / "c")
    one_line(result, ExitCode.STORAGE, "cannot write the report")
    assert list(disk.iterdir()) == []  # neither reports/ nor reports/c


def test_train_into_a_read_only_folder_is_refused_before_any_work(storage, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    with storage.readonly(folder):
        result = invoke("train", *TRAIN, "--out", folder / "run")
    one_line(result, ExitCode.USER_ERROR, "cannot be written", str(folder))
    assert list(folder.iterdir()) == []


def test_resume_of_a_read_only_run(storage, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = snapshot(run)
    with storage.readonly(run):
        result = invoke("train", "--resume", run, "--steps", "4")
    one_line(result, ExitCode.STORAGE, "cannot write", str(run), said="resuming from ")
    assert snapshot(run) == before


def test_inject_into_a_read_only_folder(storage, tmp_path):
    (tmp_path / "faults.yaml").write_text(FAULTS)
    folder = tmp_path / "ro"
    folder.mkdir()
    with storage.readonly(folder):
        result = invoke("inject", "--spec", tmp_path / "faults.yaml", *TRAIN, "--out", folder / "exp")
    one_line(result, ExitCode.USER_ERROR, "cannot be written", str(folder))


def test_a_read_only_campaign_can_be_read_not_run(storage, campaign, tmp_path):
    directory = tmp_path / "c"
    shutil.copytree(campaign, directory)
    before = snapshot(directory)
    with storage.readonly(directory):
        status = invoke("campaign", "status", directory)
        ran = invoke("campaign", "run", directory, "--workers", "0")
        report = invoke("report", directory)
        elsewhere = invoke("report", directory, "--out", tmp_path / "elsewhere")
    assert status.exit_code == 0 and "2/2 trials done" in status.output, status.output
    one_line(ran, ExitCode.STORAGE, "cannot write", str(directory))
    one_line(report, ExitCode.STORAGE, "cannot write the report", str(directory / "report.html"))
    assert elsewhere.exit_code == 0, elsewhere.output
    assert (tmp_path / "elsewhere" / "report.html").stat().st_size > 1000
    assert snapshot(directory) == before
