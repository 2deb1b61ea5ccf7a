"""Resuming a run: it continues exactly as config.json describes it (faults and guard included), or
is refused with one clear line; an interrupted run saves a checkpoint it can be resumed from."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import cli_fails, cli_invoke
from sdcscope.cli import app
from sdcscope.cli.options import guard_config

runner = CliRunner()
SDCSCOPE = str(Path(sys.executable).with_name("sdcscope"))

PERMANENT = """\
- site: weight
  target: blocks.0.attn.q_proj
  model: stuck_at_1
  bits: [29]
  pattern: {kind: element, index: 3}
  schedule: {kind: permanent, start: 2}
  seed: 1
"""


def _ok(*args, code=0):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


def _files(run):
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _json(path):
    return json.loads(path.read_text())


@pytest.fixture
def run3(tmp_path):
    _ok("train", "--steps", 3, "--out", tmp_path / "r")
    return tmp_path / "r"


@pytest.mark.parametrize(
    "edit, needles",
    [
        (
            lambda t: t.replace('"tiny"', '"small"'),
            ["config.json", "workload.preset is 'small'", "trained with 'tiny'"],
        ),
        (lambda t: t.replace('"preset"', '"bogus"'), ["config.json", "unknown workload key 'bogus'", "allowed:"]),
        (lambda t: t.replace("{", "{,", 1), ["config.json", "is not valid JSON"]),
    ],
)
def test_an_edited_config_is_refused_naming_the_file(run3, edit, needles):
    config = run3 / "config.json"
    config.write_text(edit(config.read_text()))
    before = _files(run3)
    cli_fails(["train", "--resume", run3, "--steps", 5], *needles)
    assert _files(run3) == before


def test_a_checkpoint_without_recorded_config_that_does_not_fit_is_refused(run3):
    manifest = run3 / "checkpoint" / "manifest.json"
    data = _json(manifest)
    del data["run"]  # as written before the manifest recorded the configuration
    manifest.write_text(json.dumps(data))
    config = _json(run3 / "config.json")
    (run3 / "config.json").write_text(json.dumps({**config, "workload": {**config["workload"], "preset": "small"}}))
    cli_fails(["train", "--resume", run3, "--steps", 5], "config.json", "data.model.d_model", "differ")
    del config["data"]  # nor the data section (a model description): the checkpoint does not fit
    (run3 / "config.json").write_text(json.dumps({**config, "workload": {**config["workload"], "preset": "small"}}))
    cli_fails(["train", "--resume", run3, "--steps", 5], "does not fit the model", "size mismatch")


def test_resuming_to_the_steps_already_done_keeps_the_summary(run3):
    before = _files(run3)
    out = _ok("train", "--resume", run3, "--steps", 3)
    assert "already has 3 steps: nothing to train" in out and "train loss 5." in out
    assert _files(run3) == before
    summary = _json(run3 / "summary.json")
    assert summary["final_train_loss"] is not None and summary["wall_seconds"] > 0


def test_zero_steps_save_the_initial_state_to_resume_from(tmp_path):
    out = _ok("train", "--steps", 0, "--out", tmp_path / "z")
    assert "after 0 steps: no step trained, val loss 5." in out and "None" not in out
    summary = _json(tmp_path / "z" / "summary.json")
    assert summary["steps"] == 0 and summary["final_train_loss"] is None
    _ok("train", "--resume", tmp_path / "z", "--steps", 2)
    _ok("train", "--steps", 2, "--out", tmp_path / "y")
    resumed, whole = (_json(tmp_path / r / "summary.json")["param_sha256"] for r in "zy")
    assert resumed == whole


def test_options_that_change_the_run_are_refused_on_resume(run3):
    before = _files(run3)
    cli_fails(
        ["train", "--resume", run3, "--steps", 5, "--workload", "cnn", "--seed", 7, "--lr", 0.5, "--batch-size", 3],
        "--workload cnn (the run has gpt)",
        "--seed 7 (the run has 0)",
        "--lr 0.5 (the run has 0.003)",
        "--batch-size 3 (the run has 16)",
    )
    assert _files(run3) == before
    _ok("train", "--resume", run3, "--steps", 4, "--seed", 0, "--preset", "tiny")  # the recorded values
    assert _json(run3 / "summary.json")["steps"] == 4


def test_guard_and_eval_every_may_change_and_are_recorded(run3):
    _ok("train", "--resume", run3, "--steps", 4, "--guard", "--eval-every", 2)
    config = _json(run3 / "config.json")
    assert config["guard"] is not None and config["train"]["eval_every"] == 2
    assert config["resumes"] == [
        {"from_step": 3, "steps": 4, "changed": {"guard": config["guard"], "train.eval_every": 2}}
    ]
    _ok("train", "--resume", run3, "--steps", 5)  # keeps the recorded guard
    config = _json(run3 / "config.json")
    assert config["guard"] is not None and config["resumes"][-1] == {"from_step": 4, "steps": 5}
    rows = [json.loads(line) for line in (run3 / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    guard_keys = {k for k in set(rows[3]) - set(rows[0]) if not k.startswith("eval_")}  # the guard's metrics
    assert guard_keys and guard_keys <= set(rows[4])


def test_a_resumed_faulty_run_keeps_its_faults_bitwise(tmp_path):
    spec = tmp_path / "perm.yaml"
    spec.write_text(PERMANENT)
    _ok("inject", "--spec", spec, "--steps", 4, "--out", tmp_path / "i")
    _ok("train", "--resume", tmp_path / "i" / "faulty", "--steps", 6)
    _ok("train", "--faults", spec, "--nproc", 1, "--steps", 6, "--out", tmp_path / "t")  # single process
    resumed, whole = tmp_path / "i" / "faulty", tmp_path / "t"
    assert _json(resumed / "summary.json")["param_sha256"] == _json(whole / "summary.json")["param_sha256"]
    assert (resumed / "injections.jsonl").read_text() == (whole / "injections.jsonl").read_text()
    assert "world_size" not in _json(whole / "config.json")
    _ok("train", "--resume", whole, "--steps", 7, "--faults", spec)  # the recorded faults: accepted
    cli_fails(
        ["train", "--resume", tmp_path / "i" / "golden", "--steps", 7, "--faults", spec], "--faults", "keeps its faults"
    )


def test_single_process_faults_are_not_treated_as_distributed(tmp_path, run3):
    spec = tmp_path / "perm.yaml"
    spec.write_text(PERMANENT)
    text = cli_fails(
        ["train", "--faults", spec, "--invariants", tmp_path / "missing.yaml", "--nproc", 1, "--out", tmp_path / "x"],
        "--invariants",
        "does not exist",
    )
    assert "distributed" not in text
    assert not (tmp_path / "x").exists()


def test_a_run_resumes_in_the_world_it_was_trained_in(run3):
    """A single-process run resumes in one process; one whose config.json claims ranks resumes on
    them, from a checkpoint its ranks wrote: this one's is refused before any rank starts."""
    cli_fails(["train", "--resume", run3, "--nproc", 2], "--nproc 2", "trained in one process", "drop --nproc")
    config = _json(run3 / "config.json")
    (run3 / "config.json").write_text(json.dumps({**config, "world_size": 2}))
    cli_fails(["train", "--resume", run3, "--steps", 5], "was not written by the ranks of a distributed run")
    with pytest.raises(ValueError, match="trained on 2 ranks.*resumes on its ranks"):
        from sdcscope.engine import Run

        Run.resume(run3)


@pytest.fixture
def sigint_default():
    """SIGINT as Python sets it by default: a shell starting the tests in the background makes
    them inherit it ignored, and the run leaves an ignored signal alone (as it should)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_sigint_stops_at_a_step_and_the_resumed_run_is_bitwise(tmp_path, sigint_default):
    from sdcscope.engine import Run, TrainConfig
    from sdcscope.engine.run import Interrupted
    from sdcscope.workloads import WorkloadConfig

    def interrupt_at(step):
        return lambda m: m["step"] == step and os.kill(os.getpid(), signal.SIGINT)

    wcfg, tcfg = WorkloadConfig(), TrainConfig()
    with pytest.raises(Interrupted) as stop:
        Run(tmp_path / "a", wcfg, tcfg).train(8, on_step=interrupt_at(2))
    assert stop.value.signum == signal.SIGINT and stop.value.summary["steps"] == 3
    assert _json(tmp_path / "a" / "summary.json")["outcome"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed = Run.resume(tmp_path / "a").train(8)
    whole = Run(tmp_path / "b", wcfg, tcfg).train(8)
    assert resumed["param_sha256"] == whole["param_sha256"] and resumed["outcome"] == "completed"
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_an_interrupted_cli_run_can_be_resumed(tmp_path):
    out = tmp_path / "k"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [SDCSCOPE, "train", "--steps", "100000", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # see sigint_default
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert f"continue with: sdcscope train --resume {out}" in " ".join(err.split())
    done = _json(out / "summary.json")["steps"]
    assert _json(out / "checkpoint" / "manifest.json")["step"] == done
    assert metrics.read_text().count("\n") == done
    cli_fails(["train", "--steps", 5, "--out", out], "already holds another run", f"--resume {out}")
    _ok("train", "--resume", out, "--steps", done + 1)


def test_a_run_without_checkpoint_says_so_consistently(run3):
    for path in (run3 / "checkpoint").iterdir():
        path.unlink()
    cli_fails(["train", "--steps", 3, "--out", run3], "saved no checkpoint", "cannot be resumed")
    cli_fails(["train", "--resume", run3, "--steps", 5], "saved no checkpoint", "cannot be continued")


def test_yaml_syntax_errors_show_the_problem_and_its_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- site: weight\n  target: [a, b\n  model: bitflip\n")
    for flag in ("--faults", "--guard-config"):
        cli_fails(
            ["train", flag, bad, "--out", tmp_path / "x"],
            "bad.yaml",
            "expected ',' or ']', but got ':' at line 3, column 8",
            "flow sequence",
        )
    assert not (tmp_path / "x").exists()


def test_a_folder_given_as_a_file_is_named_as_a_folder(tmp_path):
    cli_fails(["inject", "--spec", tmp_path, "--out", tmp_path / "x"], f"--spec '{tmp_path}' is a folder")
    cli_fails(["train", "--guard-config", tmp_path, "--out", tmp_path / "x"], "is a folder")


def test_report_names_a_missing_directory_and_reports_an_inject_directorys_runs(tmp_path):
    text = cli_fails(["report", tmp_path / "nonexist"], "does not exist")
    assert "campaign run" not in text
    spec = tmp_path / "perm.yaml"
    spec.write_text(PERMANENT)
    _ok("inject", "--spec", spec, "--steps", 3, "--out", tmp_path / "i")
    assert _ok("report", tmp_path / "i").count("wrote") == 3  # each run's report, then the comparison page
    assert (tmp_path / "i" / "comparison.html").is_file()
    for run in ("golden", "faulty"):
        assert (tmp_path / "i" / run / "report.md").is_file() and (tmp_path / "i" / run / "report.html").is_file()


def test_a_relative_corpus_is_recorded_absolute_and_resumes_from_anywhere(tmp_path, monkeypatch):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    monkeypatch.chdir(tmp_path)
    _ok("train", "--corpus", "text.txt", "--steps", 2, "--out", "run")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["workload"]["corpus"] == str(
        tmp_path / "text.txt"
    )
    monkeypatch.chdir(tmp_path.parent)
    _ok("train", "--resume", tmp_path / "run", "--steps", 3)


WEIGHT_FLIP = """\
- site: weight
  target: blocks.1.mlp.fc.weight
  model: {model}
  bits: [30]
  pattern: {{kind: element, index: 1234}}
  schedule: {schedule}
  seed: 2
"""


def test_a_guard_rollback_repairs_the_run_and_an_unrepairable_fault_stalls_it(tmp_path):
    """The rolled-back step's non-finite loss is no crash: training goes on to the end. A fault the
    rollback cannot cure (a stuck bit re-applied after every update) ends the run as stalled
    instead of rolling back forever."""
    for name, model, schedule, outcome in (
        ("transient", "bitflip", "{kind: transient, step: 3}", "completed"),
        ("permanent", "stuck_at_1", "{kind: permanent, start: 3}", "stalled"),
    ):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(WEIGHT_FLIP.format(model=model, schedule=schedule))
        code = 4 if outcome == "stalled" else 0  # ExitCode.GUARD_STOPPED: a scheduler sees the guard stopped it
        _ok("train", "--steps", 7, "--seed", 3, "--faults", spec, "--guard", "--out", tmp_path / name, code=code)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["outcome"] == outcome, summary
        assert (summary["steps"] == 7) == (outcome == "completed"), summary


def test_a_guard_that_vetoes_every_step_stalls_the_run(tmp_path):
    """A permanent GEMM fault repeats on every replay, so the guard vetoes every update until the
    ledger's strikes (3) at that site make it persistent and the guard stops the run: it trained
    nothing, and its summary says so (stalled, the discarded steps counted, the reason given)."""
    spec = tmp_path / "perm.yaml"
    spec.write_text(
        "- {site: gemm.forward, target: fc2, model: bitflip, bits: [30], pattern: {kind: element, index: 3},"
        " schedule: {kind: permanent, start: 0}, seed: 5}\n"
    )
    (tmp_path / "guard.yaml").write_text("profile: full\n")  # every GEMM checked every step
    _ok(
        "train",
        "--workload",
        "cnn",
        "--preset",
        "tiny",
        "--steps",
        4,
        "--seed",
        3,
        "--faults",
        spec,
        "--guard-config",
        tmp_path / "guard.yaml",
        "--out",
        tmp_path / "run",
        code=4,  # ExitCode.GUARD_STOPPED
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"], summary["discarded_steps"]) == ("stalled", 3, 3), summary
    assert "persistent" in summary["stop_reason"], summary


FAULT = """\
- site: weight
  target: blocks.0.attn.q_proj
  model: stuck_at_1
  bits: [29]
  pattern: {kind: element, index: 3}
  schedule: {kind: permanent, start: 0}
  seed: 1
"""


def test_resume_with_an_edited_fault_file_names_the_first_differing_field(tmp_path):
    spec = tmp_path / "fault.yaml"
    spec.write_text(FAULT)
    code, text = cli_invoke("train", "--steps", 1, "--faults", spec, "--out", tmp_path / "run")
    assert code == 0, text
    before = _files(tmp_path / "run")
    spec.write_text(FAULT.replace("bits: [29]", "bits: [30]"))
    code, text = cli_invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert code == 2 and "Traceback" not in text, text
    assert "faults[0].bits[0] is 30 in the file, 29 in the run" in text, text
    assert "drop --faults" in text  # the whole message, on one line
    spec.write_text(FAULT.replace("index: 3", "index: 4") + FAULT.replace("bits: [29]", "bits: [28]"))
    _, text = cli_invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert "faults[0].pattern.index is 4 in the file, 3 in the run" in text, text
    spec.write_text(FAULT + FAULT.replace("bits: [29]", "bits: [28]"))
    _, text = cli_invoke("train", "--resume", tmp_path / "run", "--steps", 2, "--faults", spec)
    assert 'faults[1] is {"site": "weight", ' in text and "…" in text and "(absent) in the run" in text, text
    assert _files(tmp_path / "run") == before


def test_guard_paths_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inv.yaml").write_text("[]\n")
    (tmp_path / "g.yaml").write_text("invariants: inv.yaml\nmetrics: {path: logs/m.jsonl}\n")
    config = guard_config(False, tmp_path / "g.yaml")
    assert config.invariants == str(tmp_path / "inv.yaml")
    assert config.metrics.path == str(tmp_path / "logs" / "m.jsonl")
    assert guard_config(False, None, tmp_path / "inv.yaml").invariants == str(tmp_path / "inv.yaml")


PERMANENT_FLIPS = """\
- site: weight
  target: fc1
  model: bitflip
  bits: [29]
  pattern: {kind: element, index: 10}
  schedule: {kind: permanent, start: 1}
- site: optimizer_state
  target: fc2.weight
  state_key: exp_avg
  model: bitflip
  bits: [27]
  pattern: {kind: element, index: 3}
  schedule: {kind: permanent, start: 1}
"""


def test_a_resumed_run_keeps_its_permanent_bit_flips_bitwise(tmp_path):
    """The checkpoint holds the flipped values: the resumed injector knows them in place rather
    than flipping them back."""
    import json

    faults = tmp_path / "flips.yaml"
    faults.write_text(PERMANENT_FLIPS)
    common = ["train", "--workload", "cnn", "--faults", faults]
    assert cli_invoke(*common, "--steps", 4, "--out", tmp_path / "whole")[0] == 0
    assert cli_invoke(*common, "--steps", 2, "--out", tmp_path / "part")[0] == 0
    assert cli_invoke("train", "--resume", tmp_path / "part", "--steps", 4)[0] == 0
    whole, part = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "part"))
    assert part["param_sha256"] == whole["param_sha256"]
    assert (tmp_path / "part" / "injections.jsonl").read_text() == (tmp_path / "whole" / "injections.jsonl").read_text()
