"""``examples/campaigns/regenerate.py`` on the shrunken specs: every generated block of RESULTS.md is
filled, every finding carries a verdict with its evidence (interval or counts, units, healthy
spread), and every committed number of the shrunken specs' blocks (``shrunk_blocks.md``) is
regenerated exactly -- a number changed by hand in a copy fails the check, through the CLI too."""

import importlib.util
import re
from pathlib import Path

from sdcscope.study.stats import VERDICTS

ROOT = Path(__file__).resolve().parents[2]


def _regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "examples" / "campaigns" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shrunken_campaigns_regenerate_every_committed_number(tmp_path):
    m = _regenerate()
    template, runs, out = m.HERE / "RESULTS.md", tmp_path / "runs", tmp_path / "RESULTS.md"
    found = m.regenerate(runs, True, 0, template, out, parallel=2)
    prose = template.read_text(encoding="utf-8").split("## Findings")[0]
    for i, _, verdict, evidence in found:  # measured, with its evidence, and referred to by the text
        assert verdict in VERDICTS and ("trial" in evidence or "n = " in evidence), (i, verdict, evidence)
        if evidence.startswith("effect"):  # an effect: its interval, units and the healthy spread
            assert "95 % t interval" in evidence and "training seed" in evidence and "healthy spread" in evidence
        assert f"({i}" in prose or f"{i})" in prose or f" {i}" in prose, i
    text = out.read_text(encoding="utf-8")
    blocks = {b.group("name"): b.group(0) for b in m.MARK.finditer(text)}
    assert set(blocks) == {b.group("name") for b in m.MARK.finditer(template.read_text(encoding="utf-8"))}
    for name, block in blocks.items():  # each one filled: a table or measured facts
        assert len(block.splitlines()) >= 3 and ("|" in block or "- " in block or "." in block), name
    assert "does NOT reproduce" not in blocks["gap-table"]  # the re-run trial equals its campaign row

    committed = m.SHRUNK_BLOCKS.read_text(encoding="utf-8")
    assert m.check(committed, text) == []  # every committed number regenerates, verdicts included

    # a committed number changed by hand: the first loss of the GPT table, in a copy
    gpt = re.search(r"<!-- generated: gpt-table -->.*?<!-- end: gpt-table -->", committed, re.S)
    number = re.search(r"\| (\d\.\d{3}) \|", gpt.group(0))
    edited_value = f"{float(number.group(1)) + 0.001:.3f}"
    start = gpt.start() + number.start(1)
    edited = committed[:start] + edited_value + committed[start + 5 :]
    problems = m.check(edited, text)
    assert len(problems) == 1 and problems[0].startswith("gpt-table:") and edited_value in problems[0]
    copy = tmp_path / "shrunk_blocks.edited.md"
    copy.write_text(edited, encoding="utf-8")
    argv = ["--shrink", "--runs", str(runs), "--workers", "0", "--out", str(tmp_path / "again.md")]
    assert m.main(argv + ["--check", str(copy)]) == 2  # exit status 2: a mismatch (the campaigns are only read)
