"""The demo's figure: losses on top, each run's difference from the golden run below, the fault's step
and the guard's detections marked on both panels."""

import json
import math
import struct
import warnings

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba

from sdcscope.cli.demo_cmd import plot_losses


def _run(path, losses):
    path.mkdir(parents=True)
    path.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(losses))
    )


def _vertical_lines(ax):
    """{x: colour} of the axis' vertical lines (axvline: two points at one x, spanning the axis)."""
    return {
        float(line.get_xdata()[0]): to_rgba(line.get_color())
        for line in ax.get_lines()
        if len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]
    }


def test_plot_has_a_difference_panel_and_takes_a_crashed_shorter_run(tmp_path, monkeypatch):
    _run(tmp_path / "golden", [3.0, 2.5, 2.2, 2.0])
    _run(tmp_path / "faulty", [3.0, 2.6, float("inf"), float("nan")])  # crashed after the fault
    _run(tmp_path / "guarded", [3.0, 2.5, 2.2])  # stopped a step early
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_losses(tmp_path, ["golden", "faulty", "guarded"], fault_step=1, detections=[2])
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (770, 660)  # 7 x 6 inches at 110 dpi: the loss and the difference panels

    (fig,) = figures
    top, bottom = fig.axes
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in top.get_lines()}
    assert curves["golden"] == ([0, 1, 2, 3], [3.0, 2.5, 2.2, 2.0])
    diffs = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in bottom.get_lines()
        if not line.get_label().startswith("_")
    }
    assert set(diffs) == {"faulty − golden", "guarded − golden", "guard detection"}
    steps, faulty = diffs["faulty − golden"]
    assert steps == [0, 1, 2, 3] and faulty[0] == 0.0  # equal to the golden run before the fault
    assert math.isclose(faulty[1], 0.1) and faulty[2] == math.inf and math.isnan(faulty[3])  # leaves 0 there
    assert diffs["guarded − golden"] == ([0, 1, 2], [0.0, 0.0, 0.0])  # a bitwise-equal run stays at 0
    for ax in (top, bottom):  # the fault's step in grey, the detection in the detection colour
        marks = _vertical_lines(ax)
        assert marks.keys() == {1.0, 2.0}
        assert marks[1.0] == to_rgba("grey") and marks[2.0][:3] == to_rgba("C3")[:3]
