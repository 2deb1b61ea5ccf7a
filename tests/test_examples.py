"""The examples run: the README's "Guard your own loop" snippet as written, the own-loop script
with its fault and the shipped guard config, every fault file against the model it is meant for
(the rank faults against a 3-rank job, checked as a launch checks it), and every ``examples/``
path the README and docs name exists (no placeholder such as ``FAULTS.yaml`` or ``my_train.py``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from sdcscope.faults import load_specs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), EXAMPLES / "README.md"]


def _python_block(path: Path, after: str = "") -> str:
    text = path.read_text(encoding="utf-8")
    return text[text.index(after) :].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_snippet_runs_as_written(tmp_path, monkeypatch):
    snippet = _python_block(ROOT / "README.md", "## Guard your own loop")
    assert snippet == _python_block(ROOT / "docs" / "guard.md")  # the guard's page shows the same loop
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)  # NameError before: model, batches, ... were undefined
    assert scope["step"] == len(scope["batches"]) - 1 and scope["guard"].events == []
    assert (tmp_path / "run" / "events.jsonl").is_file()


def test_the_own_loop_script_catches_its_fault_under_the_shipped_guard_config(tmp_path):
    spec = importlib.util.spec_from_file_location("guard_own_loop", EXAMPLES / "guard_own_loop.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--steps", "4", "--batch-size", "2", "--fault", "--out", str(tmp_path / "run")]
    result = script.main([*args, "--guard-config", str(EXAMPLES / "guard.yaml")])
    assert result["steps"] == 4 and result["faults_fired"] == 1 and result["stopped"] is None
    (event,) = result["events"]
    assert (event["step"], event["detector"], event["verdict"], event["action"]) == (
        2,
        "abft",
        "transient",
        "recompute",
    )


@pytest.mark.parametrize("path", sorted((EXAMPLES / "faults").glob("*.yaml")), ids=lambda p: p.name)
def test_each_fault_file_fits_its_model(path, tmp_path):
    from sdcscope.engine.dist import DistConfig
    from sdcscope.engine.topology import Topology
    from sdcscope.inject import validate_specs
    from sdcscope.jobs import make_job
    from sdcscope.jobs.launcher import check_job
    from sdcscope.workloads import WorkloadConfig, make_workload

    specs = load_specs(path)
    name = next((w for w in ("cnn", "moe") if path.name.startswith(f"{w}_")), "gpt")
    workload = WorkloadConfig(workload=name, batch_size=2)
    if any(
        s.rank not in (0, None) or s.site.startswith("comm") for s in specs
    ):  # a distributed run's: as a launch checks
        # FSDP2's collectives, expert parallelism: the two-rank run its first line names
        kind = "fsdp" if path.name.startswith("fsdp_") else "ep" if path.name.startswith("moe_ep_") else None
        world = {"parallel": Topology(kind=kind)} if kind else {}
        job = make_job(
            tmp_path / "run", 2 if kind else 3, workload=workload, specs=specs, dist_config=DistConfig(), **world
        )
        check_job(job)
        return
    w = make_workload(workload)
    model = w.build_model()
    validate_specs(model, specs, w.build_optimizer(model), steps=200)


def test_the_docs_name_only_examples_that_exist():
    named = {m for doc in DOCS for m in re.findall(r"examples/[\w./-]*\w", doc.read_text(encoding="utf-8"))}
    assert {"examples/guard_own_loop.py", "examples/guard.yaml", "examples/faults/rank_faults.yaml"} <= named
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
    placeholder = re.compile(r"(?<![\w/.-])(FAULTS\.yaml|my_train\.py|rank_faults\.yaml|guard\.yaml)\b")
    found = [(str(d), m.group(0)) for d in DOCS[:-1] for m in placeholder.finditer(d.read_text(encoding="utf-8"))]
    assert found == []


def test_the_plain_script_runs_alone_and_its_fault_fits_its_model():
    """examples/plain_train.py is a script that knows nothing of sdcscope (what ``sdcscope guard --
    python`` attaches to, tests/integrations/test_script_attach.py); its fault file fits its model."""
    from sdcscope.inject import validate_specs

    path = EXAMPLES / "plain_train.py"
    assert "sdcscope" not in "".join(
        line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(("import", "from"))
    )
    spec = importlib.util.spec_from_file_location("plain_train", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    loss = script.main(["--steps", "2", "--batch-size", "2"])
    assert 0 < loss < 10
    validate_specs(script.TinyLM(), load_specs(EXAMPLES / "plain_train_flip.yaml"))
