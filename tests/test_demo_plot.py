"""The demo's figure: losses on top, each run's difference from the golden run below."""

import json
import struct
import warnings

from sdcscope.cli.demo_cmd import plot_losses


def _run(path, losses):
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(losses)))


def test_plot_has_a_difference_panel_and_takes_a_crashed_shorter_run(tmp_path):
    _run(tmp_path / "golden", [3.0, 2.5, 2.2, 2.0])
    _run(tmp_path / "faulty", [3.0, 2.6, float("inf"), float("nan")])   # crashed after the fault
    _run(tmp_path / "guarded", [3.0, 2.5, 2.2])                         # stopped a step early
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_losses(tmp_path, ["golden", "faulty", "guarded"], fault_step=1, detections=[1])
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (770, 660)   # 7 x 6 inches at 110 dpi: the loss and the difference panels
