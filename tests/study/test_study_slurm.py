"""A campaign through submitit's local executor writes the local runner's rows; a killed array
task's trials run once when the campaign is run again; the Slurm settings are checked up front."""

import os
import pickle
import signal
import time

import pytest

from helpers import campaign_tables, cli_fails
from sdcscope.study import init_campaign, run_campaign
from sdcscope.study.slurm import SLURM_DIR, SlurmConfig, TasksEndedError

submitit = pytest.importorskip("submitit")

SPEC = """
name: slurm-vs-local
workload: {name: cnn, preset: tiny}
inject_steps: [3]
horizon: 4
faults:
  sites: [gemm.forward, weight]
  targets: [conv2, fc1]
  models: [bitflip]
  bits: [0, 22, 26, 30, 31]
  patterns: [{kind: element}]
baseline: {seeds: [1, 2], twins: 3}
"""
LOCAL = {"cluster": "local", "poll_s": 0.1}


def _running_task(directory, timeout=30.0):
    """The pid of the array task that holds a job's claim now (it names itself in the claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for claim in (directory / SLURM_DIR / "claims").glob("*.lock"):
            try:
                pid = int(claim.read_text().split()[1])
                os.kill(pid, 0)
            except (OSError, IndexError, ValueError):  # gone, half written, or its task is dead
                continue
            return pid
        time.sleep(0.01)
    raise AssertionError("no array task holds a claim")


def _trial_results(directory):
    """Each trial's result file as the array task wrote it: (inode, mtime) by name."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in (directory / SLURM_DIR / "results").glob("*.pkl")
        if pickle.loads(p.read_bytes())["kind"] == "trial"
    }


@pytest.mark.slow
def test_slurm_campaign_gives_the_local_rows_and_a_killed_task_resumes_once(tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    local, array = tmp_path / "local", tmp_path / "array"
    for d in (local, array):
        init_campaign(d, tmp_path / "spec.yaml")
    expected = run_campaign(local, workers=0)
    assert expected["done"] == 20

    killed = []

    def kill_mid_trial(phase, done, total):
        if phase == "trials" and done == 3 and not killed:
            killed.append(_running_task(array))
            os.kill(killed[0], signal.SIGKILL)

    with pytest.raises(TasksEndedError, match=r"every array task ended with \d+ of 20 jobs .*run the campaign again"):
        run_campaign(array, workers=1, slurm=LOCAL, progress=kill_mid_trial)
    first = _trial_results(array)
    assert 3 <= len(first) < 20 and len(campaign_tables(array)["trials"]) == len(first)

    resumed = run_campaign(array, workers=1, slurm=LOCAL)
    assert resumed["ran"] == 20 - len(first) and resumed["done"] == 20
    after = _trial_results(array)
    assert len(after) == 20  # one result per trial ...
    assert {k: after[k] for k in first} == first  # ... and the finished ones were not run again
    assert campaign_tables(array) == campaign_tables(local)  # row for row, baselines, twins and thresholds too
    assert resumed["outcomes"] == expected["outcomes"]
    assert not list((array / SLURM_DIR / "queue").iterdir())


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    directory = tmp_path_factory.mktemp("refusals")
    (directory / "spec.yaml").write_text(SPEC)
    init_campaign(directory / "c", directory / "spec.yaml")
    return directory / "c"


@pytest.mark.parametrize(
    "slurm, error, match",
    [
        ({"cluster": "pbs"}, ValueError, r"unknown slurm cluster 'pbs'; allowed: slurm, local"),
        ({"clutser": "local"}, ValueError, r"unknown slurm config key 'clutser' \(did you mean 'cluster'\?\)"),
        ({"poll_s": 0}, ValueError, r"slurm poll_s=0 must be a finite number > 0"),
        ({"cluster": "local", "parameters": {"slurm_partitoin": "gpu"}}, ValueError, r"slurm_partitoin"),
        ({"cluster": "local", "parameters": {"timeout_min": "1h"}}, TypeError, r"timeout_min"),
    ],
)
def test_slurm_settings_are_refused_before_any_work(campaign, slurm, error, match):
    with pytest.raises(error, match=match):
        run_campaign(campaign, workers=1, slurm=slurm)
    assert not (campaign / "golden").exists() and not (campaign / SLURM_DIR / "queue").exists()


def test_slurm_excludes_other_backends(tmp_path, campaign):
    cli_fails(["campaign", "run", campaign, "--slurm", "--ray-address", "auto"], "give one backend, not both")
    cli_fails(
        ["campaign", "run", campaign, "--slurm-config", tmp_path / "none.yaml"], "--slurm-config", "does not exist"
    )
    with pytest.raises(ValueError, match="give one backend, not both"):
        run_campaign(tmp_path, ray_address="local", slurm={})
    with pytest.raises(ValueError, match="workers=0 runs in this process"):
        run_campaign(tmp_path, workers=0, slurm={})
    cfg = tmp_path / "slurm.yaml"
    cfg.write_text("cluster: local\nparameters: {timeout_min: 5}\n")
    assert SlurmConfig.coerce(cfg) == SlurmConfig(cluster="local", parameters={"timeout_min": 5})
