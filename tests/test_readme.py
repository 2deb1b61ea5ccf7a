"""The README's two commands stay true: CI runs the README's test command verbatim."""

from pathlib import Path

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


def test_constraints_pin_cpu_torch():
    assert "torch==2.13.0" in (ROOT / "constraints-cpu.txt").read_text()
