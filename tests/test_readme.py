"""The README's two commands stay true: CI runs the README's test command verbatim."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement  # a dependency of pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    return [lines[i + 1] for i, line in enumerate(lines) if line.strip() == "```bash"][:2]


def test_readme_opens_with_demo_and_test_commands():
    demo, tests = _readme_commands()
    assert "constraints-cpu.txt" in demo and demo.endswith("sdcscope demo")
    assert "constraints-cpu.txt" in tests and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    _, tests = _readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_constraints_pin_exact_versions_that_pyproject_accepts():
    """The README installs with ``-c constraints-cpu.txt``: each line pins one dependency of sdcscope
    (torch among them) to an exact version its pyproject requirement accepts, or pip refuses the install."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {
        Requirement(r).name: Requirement(r)
        for r in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    }
    pins = [
        Requirement(line)
        for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert "torch" in {pin.name for pin in pins}
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        assert pin.name in required, f"{pin} pins no dependency of sdcscope"
        assert required[pin.name].specifier.contains(spec.version), f"{pin} is outside pyproject's {required[pin.name]}"


def test_readme_states_the_suites_duration_and_a_quick_subset_that_exists():
    lines = (ROOT / "README.md").read_text().splitlines()
    text = " ".join(lines)
    assert "about 9 minutes on a quiet 2-core machine" in text and "558 s" in text
    quick = [lines[i + 1] for i, line in enumerate(lines) if line.strip() == "```bash"][2]
    assert quick.startswith(".venv/bin/python -m pytest tests/"), quick
    paths = quick.split("pytest ", 1)[1].split()
    assert "tests/test_examples.py" in paths and all((ROOT / p).exists() for p in paths), paths
