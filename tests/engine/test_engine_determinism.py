"""Same seed ⇒ same parameters; 2N steps == N steps + resume N steps, bitwise (GPT and CNN)."""

import json

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app

runner = CliRunner()


def _train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def _sha(path):
    return json.loads((path / "summary.json").read_text())["param_sha256"]


@pytest.mark.parametrize("workload", ["gpt", "cnn"])
def test_same_seed_same_params_and_resume_is_bitwise(tmp_path, workload):
    n = 12
    common = ["--workload", workload, "--preset", "tiny", "--seed", "7"]
    _train(*common, "--steps", str(2 * n), "--out", str(tmp_path / "a"))
    _train(*common, "--steps", str(2 * n), "--out", str(tmp_path / "b"))
    _train(*common, "--steps", str(n), "--out", str(tmp_path / "c"))
    _train("--resume", str(tmp_path / "c"), "--steps", str(2 * n))
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b") == _sha(tmp_path / "c")
    # the resumed run's metrics continue where they stopped, without duplicates
    steps = [json.loads(line)["step"] for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(2 * n))
    ref = (tmp_path / "a" / "metrics.jsonl").read_text()
    assert (tmp_path / "c" / "metrics.jsonl").read_text() == ref


def test_other_seed_differs(tmp_path):
    _train("--steps", "3", "--seed", "1", "--out", str(tmp_path / "a"))
    _train("--steps", "3", "--seed", "2", "--out", str(tmp_path / "b"))
    assert _sha(tmp_path / "a") != _sha(tmp_path / "b")


def test_grad_accum_is_deterministic(tmp_path):
    _train("--steps", "4", "--grad-accum", "2", "--out", str(tmp_path / "a"))
    _train("--steps", "4", "--grad-accum", "2", "--out", str(tmp_path / "b"))
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b")


def test_run_directory_contract(tmp_path):
    _train("--steps", "5", "--eval-every", "5", "--out", str(tmp_path / "r"))
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["workload"]["preset"] == "tiny" and config["train"]["seed"] == 0
    assert config["data"]["corpus_sha256"]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert set(summary) >= {"outcome", "final_train_loss", "final_val_loss", "param_sha256", "steps", "wall_seconds"}
    assert summary["outcome"] == "completed" and summary["steps"] == 5
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5 and "eval_val_loss" in json.loads(lines[-1])
