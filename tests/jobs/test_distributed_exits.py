"""How a distributed job ends, as a scheduler and a person see it: a guard's stop under FSDP2 exits
4 with one line naming the rank and the site (summary ``stopped``, ledger written, no traceback);
an invalid topology is refused with exit 2 before any rank starts; a rank that refuses the job
makes the job exit 2, not 5; and every guard event is one WARNING line naming its rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import at, rank_flip
from sdcscope.common.exitcodes import ExitCode
from sdcscope.engine import read_jsonl
from sdcscope.engine.dist import DistConfig
from sdcscope.engine.topology import Topology
from sdcscope.observe import event_line
from sdcscope.workloads import WorkloadConfig

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-c", "import sys; from sdcscope.cli import main; sys.exit(main())"]
SMALL = ("--batch-size", "2", "--timeout", "60")


def _fault_file(path, schedule: dict):
    """A bit-30 flip of element 5 of ``blocks.0.mlp.fc``'s forward GEMM on rank 1."""
    spec = rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, schedule, seed=1)
    path.write_text(json.dumps([spec]))
    return path


def _train(*args) -> subprocess.CompletedProcess:
    """``sdcscope train *args`` in its own process: the ranks write to its real stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*CLI, "train", *map(str, args), *SMALL]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _events(out) -> list[dict]:
    """Every guard event of a run: the world's (``events.jsonl``) and each rank's own."""
    return [e for path in sorted(out.glob("events*.jsonl")) for e in read_jsonl(path)]


def _logged_events(stderr: str) -> list[str]:
    """The guard-event log lines of ``stderr``; each must name the rank that logged it."""
    lines = [line for line in stderr.splitlines() if "guard event: " in line]
    assert all(re.match(r"WARNING rank [01] sdcscope\.", line) for line in lines), lines
    return sorted(line.split("guard event: ", 1)[1] for line in lines)


def _expected(events: list[dict]) -> list[str]:
    return sorted(event_line(e).split("guard event: ", 1)[1] for e in events)


def test_a_guard_stop_under_fsdp_exits_4_with_one_line_naming_rank_and_site(tmp_path):
    # a permanent forward-GEMM fault on rank 1: its vetoed steps' losses are non-finite, the ledger
    # finds the site persistent, and no rank can be excluded under FSDP2: every rank stops after the
    # same step, as a stop (not a signal, not a crash)
    out = tmp_path / "run"
    faults = _fault_file(tmp_path / "perm.json", {"kind": "permanent", "start": 1})
    got = _train("--nproc", 2, "--parallel", "fsdp", "--guard", "--faults", faults, "--steps", 8, "--out", out)
    assert got.returncode == ExitCode.GUARD_STOPPED, (got.returncode, got.stderr)
    assert "Traceback" not in got.stderr + got.stdout, got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, got.stderr
    assert "the guard stopped the run" in errors[0] and "rank 1" in errors[0], errors
    assert "blocks.0.mlp.fc" in errors[0], errors  # the site: the faulty GEMM's layer
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "stopped" and summary["stop_reason"] in errors[0], summary
    assert summary["steps"] < 8 and summary["replicas_identical"]
    assert not list(out.glob("failure*.json"))
    ledger = json.loads((out / "ledger.json").read_text())
    assert [d["rank"] for d in ledger["devices"].values() if d["faulty"]] == [1]
    events = _events(out)
    assert (events[-1]["detector"], events[-1]["verdict"]) == ("guard", "stopped")
    assert _logged_events(got.stderr) == _expected(events)  # one WARNING per event, rank 0 for the world's


def test_a_guarded_ddp_run_logs_one_warning_per_guard_event_with_its_rank(tmp_path):
    out = tmp_path / "run"
    faults = _fault_file(tmp_path / "flip.json", at(2))
    got = _train("--nproc", 2, "--guard", "--faults", faults, "--steps", 4, "--out", out)
    assert got.returncode == 0, got.stderr
    events = _events(out)
    assert events and any(e["rank"] == 1 for e in events), events
    assert _logged_events(got.stderr) == _expected(events)


def test_an_invalid_topology_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sdcscope.cli import app
    from sdcscope.jobs import launcher

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher.subprocess, "Popen", no_rank)
    for args, needle in (
        (
            ["--nproc", 3, "--parallel", "tp"],
            "n_head=2 and MLP width 256 are not both divisible by 3; allowed degrees: 1, 2",
        ),
        (["--nproc", 3, "--parallel", "hsdp"], "--parallel hsdp needs --nproc a multiple of 2"),
        (["--nproc", 2, "--parallel", "fsdp", "--workload", "cnn"], "the cnn workload has no parallelize plan"),
    ):
        out = tmp_path / "run"
        got = CliRunner().invoke(app, ["train", *map(str, args), "--steps", "2", "--out", str(out)])
        assert got.exit_code == ExitCode.USER_ERROR, got.output
        lines = [line for line in got.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), got.output
        assert needle in " ".join(got.output.split()), got.output
        assert not out.exists()


def test_a_rank_that_refuses_the_job_makes_it_exit_2(tmp_path, monkeypatch, capfd):
    from sdcscope.jobs import launcher, make_job

    # a topology the launcher's check would refuse reaches the ranks: each refuses it, exit 2
    monkeypatch.setattr(launcher, "check_job", lambda job: None)
    job = make_job(
        tmp_path / "run",
        2,
        steps=2,
        workload=WorkloadConfig(workload="cnn"),
        dist_config=DistConfig(backend="gloo", timeout_s=60),
        parallel=Topology(kind="fsdp"),
    )
    rc = launcher.launch(job, timeout_s=300)
    assert rc == ExitCode.USER_ERROR
    assert "the cnn workload has no parallelize plan" in capfd.readouterr().err
    code, line = launcher.describe_failure(job.out, rc)
    assert code == ExitCode.USER_ERROR and "exit code 2 (USER_ERROR)" in line


def test_the_job_code_is_the_ranks_own(tmp_path):
    from sdcscope.jobs.launcher import job_code

    # torchrun exits 1 on any rank's failure: the peers that lost the world say 5, the cause says 2
    assert job_code(1, {0: ExitCode.INFRASTRUCTURE, 1: ExitCode.USER_ERROR}, tmp_path) == ExitCode.USER_ERROR
    assert job_code(1, {0: ExitCode.STORAGE, 1: ExitCode.INFRASTRUCTURE}, tmp_path) == ExitCode.STORAGE
    assert job_code(1, {0: ExitCode.INFRASTRUCTURE}, tmp_path) == ExitCode.INFRASTRUCTURE  # a lost world
    assert job_code(1, {}, tmp_path) == ExitCode.INFRASTRUCTURE  # torchrun's 1 with no rank's word: no bug (1)
    assert job_code(0, {0: 0, 1: 0}, tmp_path) == 0
    (tmp_path / "summary.json").write_text(json.dumps({"outcome": "stopped", "stop_reason": "why"}))
    assert job_code(0, {0: 0, 1: 0}, tmp_path) == ExitCode.GUARD_STOPPED  # the ranks ended cleanly
