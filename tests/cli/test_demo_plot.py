"""The demo tells its story: the unguarded run leaves the golden curve on the top panel of its figure,
the guarded one stays on it, and the detection and the repair are marked and said in one sentence
each. Checked on the data behind the figure of one short real demo, and on a crashed run's marker."""

import json
import math

import pytest
from typer.testing import CliRunner

from sdcscope.cli.app import app
from sdcscope.study.compare_figure import comparison_figure
from sdcscope.study.compare_series import load_series

STEPS = 40  # the fault fires at step 20


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "d"
    result = CliRunner().invoke(app, ["demo", "--out", str(out), "--steps", str(STEPS)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_unguarded_run_leaves_the_golden_curve_and_the_guarded_run_stays_on_it(demo):
    out, _ = demo
    data = comparison_figure(load_series(out), render=False)
    assert data["fault_steps"] == [STEPS // 2]
    loss = {label: dict(zip(c["steps"], c["values"])) for label, c in data["loss"].items()}
    assert set(loss) == {"golden", "faulty", "guarded"}
    golden = loss["golden"]
    before = [abs(loss["faulty"][s] - golden[s]) for s in range(STEPS // 2)]
    after = [abs(loss["faulty"][s] - golden[s]) for s in range(STEPS // 2, STEPS)]
    assert max(before) == 0.0  # the same run until the fault
    assert max(after) > 1.0  # then the top panel's curves part, visibly (golden is ~3 here)
    assert sum(after) / len(after) > 0.5  # and stay apart: not a single-step blip
    assert loss["guarded"] == golden  # the guarded run is the golden curve, step for step
    distance = {label: c["values"][-1] for label, c in data["distance"].items()}
    assert distance["faulty"] > 1.0 and distance["guarded"] == 0.0
    (detection,) = data["detections"]
    assert detection["run"] == "guarded" and detection["step"] == STEPS // 2
    assert detection["action"] == "rollback"


def test_the_demo_says_what_it_detected_and_repaired_in_one_sentence_each(demo):
    out, output = demo
    lines = [line for line in output.splitlines() if line.startswith(("detection:", "repair:"))]
    assert [line.split(":")[0] for line in lines] == ["detection", "repair"]
    assert "blocks.1.mlp.proj" in lines[0] and f"step {STEPS // 2}" in lines[0]
    assert "bitwise equal to the golden one" in lines[1]
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["guarded"]["outcome"] == "masked" and comparison["outcome"] == "deviation"
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "comparison.html").is_file()


def test_the_demo_says_what_it_trains_on_and_where_the_loss_departed(demo):
    _, output = demo
    first = " ".join(output.split("\n")[0].split())
    assert first.startswith("training a byte-level GPT (tiny: 2 layers, d=64") and "next byte" in first, first
    assert "Python's standard library" in first and "MB of .py files" in first, first
    (unguarded,) = [line for line in output.splitlines() if line.startswith("unguarded:")]
    assert f"left the golden curve at step {STEPS // 2} (" in unguarded, unguarded  # the fault's step


def _run(path, losses, events=(), injections=(), outcome="completed"):
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": v if math.isfinite(v) else str(v)}) + "\n" for i, v in enumerate(losses))
    )
    path.joinpath("events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    path.joinpath("injections.jsonl").write_text("".join(json.dumps(i) + "\n" for i in injections))
    path.joinpath("summary.json").write_text(json.dumps({"outcome": outcome, "steps": len(losses)}))


def test_a_crashed_run_ends_in_a_marker_with_its_legend_entry(tmp_path):
    fault = {"step": 2, "site": "weight", "module": "fc.weight", "bits": [30], "count": 1, "when": "train"}
    _run(tmp_path / "golden", [3.0, 2.5, 2.2, 2.0, 1.9])
    _run(tmp_path / "faulty", [3.0, 2.5, 2.6, float("nan")], injections=[fault], outcome="crash")
    data = comparison_figure(load_series(tmp_path), render=False)
    assert data["crashes"] == {"faulty": 3}
    assert data["loss"]["faulty"] == {"steps": [0, 1, 2], "values": [3.0, 2.5, 2.6]}
    assert data["fault_steps"] == [2]
