"""``examples/campaigns/regenerate.py`` on the shrunken specs: every finding that RESULTS.md states
holds in shape (outcome classes, sign and order of magnitude of each effect), and every generated
block of RESULTS.md is filled from the campaigns' results."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "examples" / "campaigns" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shrunken_campaigns_show_every_finding_of_results_md(tmp_path):
    m = _regenerate()
    template = m.HERE / "RESULTS.md"
    found = m.regenerate(tmp_path / "runs", True, 0, template, tmp_path / "RESULTS.md", parallel=2)
    failing = [(i, claim) for i, claim, ok in found if not ok]
    assert failing == []
    text = (tmp_path / "RESULTS.md").read_text(encoding="utf-8")
    blocks = {b.group("name"): b.group(0) for b in m.MARK.finditer(text)}
    assert set(blocks) == {b.group("name") for b in m.MARK.finditer(template.read_text(encoding="utf-8"))}
    for name, block in blocks.items():  # each one filled: a table or measured facts
        assert len(block.splitlines()) >= 3 and ("|" in block or "- " in block or "." in block), name
    assert "does NOT reproduce" not in blocks["gap-table"]  # the re-run trial equals its campaign row
    for i, _, _ in found:  # every finding is referred to by the text around the tables
        assert f"{i}" in template.read_text(encoding="utf-8").split("## Findings")[0], i
