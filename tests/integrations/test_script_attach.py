"""The guard and the injector attached to an unmodified script (``examples/plain_train.py``: its
own model, AdamW, gradient accumulation, clipping): a clean run has no event and trains bit for bit
as the script does unwatched; a forward-GEMM flip in the second micro-batch of step 3 is caught in
that step, in that layer, and kept out of the update; under ``torchrun --nproc_per_node 2`` the
flip on rank 1 is named with its rank and every rank vetoes the step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdcscope.common.io import read_json, read_jsonl
from sdcscope.faults import FaultSpec
from sdcscope.guard import GuardConfig
from sdcscope.integrations.script import run_attached

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "plain_train.py"
ARGS = [str(SCRIPT), "--steps", "5", "--accum", "2", "--batch-size", "4"]
FULL = GuardConfig.from_dict({"profile": "full"})  # every GEMM checked every step


def flip(rank: int | None = None) -> FaultSpec:
    return FaultSpec.from_dict(
        {
            "site": "gemm.forward",
            "target": "fc1",
            "model": "bitflip",
            "bits": [30],
            "pattern": {"kind": "element", "index": 5},
            "schedule": {"kind": "transient", "step": 3, "micro_batch": 1},
            "rank": rank,
            "seed": 1,
        }
    )


def test_a_clean_script_under_the_guard_has_no_event_and_trains_as_unwatched(tmp_path):
    assert run_attached(ARGS, tmp_path / "g", FULL, []) == (0, True)
    assert run_attached(ARGS, tmp_path / "plain", None, []) == (0, True)  # only watched: the step count
    guarded, plain = read_json(tmp_path / "g" / "summary.json"), read_json(tmp_path / "plain" / "summary.json")
    assert read_jsonl(tmp_path / "g" / "events.jsonl") == []
    assert (guarded["steps"], guarded["discarded_steps"]) == (5, 0)
    assert len(read_jsonl(tmp_path / "g" / "metrics.jsonl")) == 5  # one row per optimizer step
    assert guarded["param_sha256"] == plain["param_sha256"]
    assert guarded["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=0, abs=0)


def test_a_forward_gemm_flip_in_a_micro_batch_is_caught_in_its_step_and_vetoed(tmp_path):
    assert run_attached(ARGS, tmp_path / "f", FULL, [flip()]) == (0, True)
    (fired,) = read_jsonl(tmp_path / "f" / "injections.jsonl")
    assert (fired["step"], fired["micro_batch"], fired["module"]) == (3, 1, "fc1")
    events = read_jsonl(tmp_path / "f" / "events.jsonl")
    abft = [e for e in events if e["detector"] == "abft"]
    assert [(e["step"], e["module"], e["gemm"], e["evidence"]["micro_batch"]) for e in abft] == [
        (3, "fc1", "forward", 1)
    ]
    assert {e["step"] for e in events} == {3} and {e["action"] for e in events} == {"veto"}
    summary = read_json(tmp_path / "f" / "summary.json")
    assert (summary["steps"], summary["discarded_steps"], summary["injections"]) == (5, 1, 1)
    assert summary["final_train_loss"] < 10  # step 4 trains on: the vetoed update never reached the weights


def test_torchrun_rewrite_runs_the_bootstrap_in_every_worker():
    from sdcscope.cli.script import ATTACH, script_command

    argv = script_command(["torchrun", "--nproc_per_node", "2", "t.py", "--lr", "1"], ATTACH, ["--out", "o"])
    assert argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        ATTACH,
        "--out",
        "o",
        "--",
        "t.py",
        "--lr",
        "1",
    ]
    argv = script_command(
        ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "pkg.train"], ATTACH, []
    )
    assert argv[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "-m", ATTACH, "--", "-m", "pkg.train"]


def test_torchrun_two_ranks_the_flip_on_rank_1_is_named_and_every_rank_vetoes(tmp_path):
    spec = tmp_path / "flip.yaml"
    import yaml

    spec.write_text(yaml.safe_dump([flip(rank=1).to_dict()]))
    guard = tmp_path / "guard.yaml"
    guard.write_text("profile: full\n")
    out = tmp_path / "t"
    cmd = [sys.executable, "-m", "sdcscope", "inject", "--spec", str(spec), "--guard-config", str(guard)]
    cmd += ["--out", str(out), "--", "torchrun", "--nproc_per_node", "2", *ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    abft = [e for e in read_jsonl(out / "events.jsonl") if e["detector"] == "abft"]
    assert [(e["step"], e["rank"], e["module"], e["action"]) for e in abft] == [(3, 1, "fc1", "veto")]
    assert [r["rank"] for r in read_jsonl(out / "injections.jsonl")] == [1]  # merged from the rank logs
    for name in ("summary.json", "summary.rank1.json"):
        summary = read_json(out / name)
        assert (summary["steps"], summary["discarded_steps"]) == (5, 1)


def test_the_commands_refuse_bad_input_before_the_script_runs(tmp_path):
    from helpers import cli_fails

    bad = tmp_path / "bad.yaml"
    bad.write_text("profile: fastest\n")
    never = tmp_path / "never"  # the script would write it: it must not run
    script = tmp_path / "train.py"
    script.write_text(f"open({str(never)!r}, 'w').close()\n")
    cli_fails(["guard", "--guard-config", bad, "--out", tmp_path / "a", "--", "python", script], "fastest")
    cli_fails(
        ["inject", "--spec", bad, "--out", tmp_path / "b", "--", "python", script], "unknown fault spec key 'profile'"
    )
    cli_fails(["guard", "--out", tmp_path / "c", "--", "torchrun", "--no-python", "true"], "--no-python")
    assert not never.exists()
