"""comparison.html of an inject/demo folder: self-contained (no external resource), telling the story
in one sentence per fact, and rendering in a real headless browser with its image loaded."""

import json
import math
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from sdcscope.study.compare_page import PAGE, build_page, write_page

FAULT = {"step": 3, "site": "weight", "module": "fc.weight", "model": "bitflip", "bits": [14], "count": 8}
EVENT = {
    "step": 3,
    "detector": "state_checksum",
    "verdict": "corrupt",
    "module": "fc.weight",
    "gemm": None,
    "evidence": {"rolled_back_to": 2},
    "action": "rollback",
}


def _run(path, losses, events=(), injections=(), vetoed=()):
    path.mkdir(parents=True)
    rows = [
        {"step": i, "loss": v if math.isfinite(v) else str(v), "skipped": i in vetoed} for i, v in enumerate(losses)
    ]
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.joinpath("events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    path.joinpath("injections.jsonl").write_text("".join(json.dumps(i) + "\n" for i in injections))
    path.joinpath("summary.json").write_text(json.dumps({"outcome": "completed", "steps": len(losses)}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """golden, faulty (a spike at the fault, then a worse curve), guarded (a rollback: equal to golden)."""
    out = tmp_path_factory.mktemp("cmp")
    golden = [5.0 - 0.2 * i for i in range(12)]
    _run(out / "golden", golden)
    _run(out / "faulty", golden[:3] + [g + 1.5 - 0.1 * i for i, g in enumerate(golden[3:])], injections=[FAULT])
    _run(out / "guarded", golden, events=[EVENT], injections=[FAULT])
    comparison = {
        "outcome": "deviation",
        "param_rel_l2": 3.5,
        "first_divergence_step": 3,
        "guarded": {"outcome": "masked", "param_rel_l2": 0.0},
        "param_distance": {
            "every": 3,
            "faulty": {"steps": [0, 3, 6, 9], "values": [0.0, 3.0, 3.4, 3.5]},
            "guarded": {"steps": [0, 3, 6, 9], "values": [0.0, 0.0, 0.0, 0.0]},
        },
    }
    (out / "comparison.json").write_text(json.dumps(comparison))
    page = build_page(out)
    return out, page, write_page(out, page)


class _Resources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [(tag, k, v) for k, v in attrs if k in ("src", "href", "srcset", "data", "poster", "action")]


def test_the_page_is_self_contained(folder):
    _, _, path = folder
    html = path.read_text(encoding="utf-8")
    parser = _Resources()
    parser.feed(html)
    assert parser.refs and all(v.startswith("data:image/png;base64,") for _, _, v in parser.refs), parser.refs
    assert not {"script", "link", "iframe", "object"} & set(parser.tags)
    assert "url(" not in html and "@import" not in html  # no stylesheet resource either


def test_the_page_tells_the_story_and_plots_what_happened(folder):
    _, page, _ = folder
    fault, unguarded, detection, repair = page["story"]
    assert fault.startswith("fault: at step 3") and "fc.weight" in fault
    assert unguarded.startswith("unguarded: the loss left the golden curve at step 3 (+1.5) and ends +0.7 from it")
    assert detection == "detection: at step 3 the guard's state_checksum check flagged fc.weight: corrupt"
    assert "rolled back to its verified snapshot of step 2" in repair and "bitwise equal" in repair
    figure = page["figure"]
    assert figure["distance"]["guarded"]["values"] == [0.0] * 4 and figure["distance"]["faulty"]["values"][-1] == 3.5
    assert figure["detections"] == [{"run": "guarded", "step": 3, "detector": "state_checksum", "action": "rollback"}]
    assert [row[0] for row in page["tables"][0]["rows"]] == ["golden", "faulty", "guarded"]


def test_the_departure_is_the_first_step_that_differs_not_the_largest_gap(tmp_path):
    """A fault that moves the loss a little at its step and most a few steps later: the loss left
    the golden curve at the fault's step (the demo said it left at the step of the largest gap)."""
    from sdcscope.study.compare_series import load_series, story

    golden = [5.0 - 0.2 * i for i in range(8)]
    gaps = [0, 0, 0, 0.25, 1.0, 2.0, 1.0, 0.5]
    _run(tmp_path / "golden", golden)
    _run(tmp_path / "faulty", [g + d for g, d in zip(golden, gaps)], injections=[FAULT])
    _, unguarded = story(load_series(tmp_path))
    assert unguarded == (
        "unguarded: the loss left the golden curve at step 3 (+0.25), was furthest from it at step 5 (+2) "
        "and ends +0.5 from it"
    ), unguarded
    _run(tmp_path / "same" / "golden", golden)
    _run(tmp_path / "same" / "faulty", golden, injections=[FAULT])
    assert story(load_series(tmp_path / "same"))[1] == "unguarded: the loss never left the golden curve"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
def test_the_page_renders_in_a_headless_browser_with_its_image_loaded(folder, tmp_path):
    import matplotlib.image

    out, _, path = folder
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    probe = tmp_path / "probe.html"  # the page plus a script that writes each image's decoded width into the DOM
    probe.write_text(
        path.read_text(encoding="utf-8")
        + "<script>window.addEventListener('load', () => document.body.setAttribute('data-widths',"
        " JSON.stringify([...document.images].map(i => i.complete ? i.naturalWidth : -1))));</script>",
        encoding="utf-8",
    )
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=60).stdout
    start = dom.index('data-widths="') + len('data-widths="')
    widths = json.loads(dom[start : dom.index('"', start)])
    assert widths and all(w > 0 for w in widths), widths
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1100,1400", path.as_uri()], timeout=60, check=True)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1400, 1100)
    assert pixels.std() > 0.05  # not blank: text, figure and tables drawn
    assert (pixels.reshape(-1, 3).max(axis=1) - pixels.reshape(-1, 3).min(axis=1)).max() > 0.3  # coloured curves


def test_the_page_file_is_written_into_the_folder(folder):
    out, _, path = folder
    assert path == out / PAGE and path.read_text(encoding="utf-8").startswith("<!doctype html>")
