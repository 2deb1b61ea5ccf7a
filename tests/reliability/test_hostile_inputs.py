"""Hostile input files: a YAML alias bomb, an alias that holds itself, a fault file that is one
mapping short of a spec. Each is refused before any work with one short line (exit 2) naming what
is wrong and what is allowed, and leaves nothing behind."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sdcscope.cli import app
from sdcscope.common.exitcodes import ExitCode

SPEC_HEAD = """\
- site: weight
  model: bitflip
  schedule: {kind: transient, step: 1}
  bits: [1]
  target: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
"""


def alias_bomb(keys: list[str]) -> str:
    """A fault spec whose ``keys`` each hold nine aliases of the one before (``target`` first) and
    whose ``pattern`` holds nine of the last: 9^(len(keys) + 2) strings from a few hundred bytes."""
    text, previous = SPEC_HEAD, "a"
    for i, key in enumerate(keys):
        text += f"  {key}: &l{i} [{', '.join(['*' + previous] * 9)}]\n"
        previous = f"l{i}"
    return text + f"  pattern: [{', '.join(['*' + previous] * 9)}]\n"


def inject(tmp_path, text: str):
    (tmp_path / "faults.yaml").write_text(text)
    out = tmp_path / "exp"
    result = CliRunner().invoke(app, ["inject", "--spec", str(tmp_path / "faults.yaml"), "-n", "2", "--out", str(out)])
    assert result.exit_code == ExitCode.USER_ERROR, result.output[:2000]
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output[:2000]
    assert not out.exists()
    return lines[0]


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    text = alias_bomb(["seed", "rank", "format", "state_key", "phase"])  # 9^7 strings
    assert len(text.encode()) < 500
    line = inject(tmp_path, text)
    assert len(line) < 300, f"{len(line):,} characters"
    assert "aliases" in line and "100,000 values" in line and "faults.yaml" in line, line


def test_a_value_below_the_alias_limit_is_named_briefly(tmp_path):
    line = inject(tmp_path, alias_bomb(["seed", "rank", "format"]))  # 9^5: loads, then refused
    assert len(line) < 400, f"{len(line):,} characters"
    assert "pattern must be a mapping" in line and "..." in line, line


def test_an_alias_that_holds_itself_is_refused(tmp_path):
    line = inject(tmp_path, "- &spec {site: weight, target: *spec}\n")
    assert "an alias refers to the value that holds it (line 1)" in line, line


@pytest.mark.parametrize(
    ("text", "missing"),
    [
        ("site: weight\ntarget: fc\n", "'model', 'schedule'"),  # one spec as a mapping, not a list
        ("- model: bitflip\n  bits: [3]\n", "'site', 'target', 'schedule'"),
        ("- site: weight\n  target: fc\n  model: bitflip\n  bits: [3]\n  schedule: {step: 1}\n", "'kind'"),
    ],
)
def test_a_spec_missing_required_keys_names_them(tmp_path, text, missing):
    line = inject(tmp_path, text)
    assert f"lacks {missing}" in line and "__init__" not in line, line
    assert "needs site, target, model, schedule" in line or "needs kind" in line, line
