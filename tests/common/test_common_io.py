"""JSON lines and JSON files of a run directory: strict JSON (non-finite floats written as strings),
numpy and torch values written as numbers, a torn last line dropped."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import strict_loads
from sdcscope.common.io import JsonlWriter, dumps, read_jsonl, write_json
from sdcscope.detect.events import Event


def test_jsonl_writer_writes_non_finite_floats_as_strings(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 1, "loss": math.nan, "grad": [math.inf, -math.inf, 1.0], "nested": {"x": math.nan}})
    writer.close()
    (line,) = path.read_text().splitlines()
    assert strict_loads(line) == {"step": 1, "loss": "nan", "grad": ["inf", "-inf", 1.0], "nested": {"x": "nan"}}
    (record,) = read_jsonl(path)
    assert math.isnan(float(record["loss"])) and [float(g) for g in record["grad"]] == [math.inf, -math.inf, 1.0]


@pytest.mark.parametrize(
    "value,written",
    [
        (np.float32("nan"), "nan"),
        (np.float64("-inf"), "-inf"),
        (np.float32(1.5), 1.5),
        (np.int64(3), 3),
        (torch.tensor(float("nan")), "nan"),
        (torch.tensor(2.5), 2.5),
        (np.array([1.0, np.inf]), [1.0, "inf"]),
        (torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16), [1.0, "-inf"]),
        ({float("nan"): 1}, {"nan": 1}),
        ((1, math.nan), [1, "nan"]),
    ],
    ids=repr,
)
def test_numpy_and_torch_values_are_written_as_their_numbers(value, written):
    assert strict_loads(dumps({"x": value})) == {"x": written}


def test_write_json_is_strict_json(tmp_path):
    path = tmp_path / "summary.json"
    write_json(path, {"final_loss": math.inf, "val": torch.tensor(float("nan"))})
    assert strict_loads(path.read_text()) == {"final_loss": "inf", "val": "nan"}


def test_event_records_with_non_finite_evidence_are_strict_json(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = JsonlWriter(path)
    writer.write(
        Event(
            step=3, detector="nonfinite", verdict="nonfinite", evidence={"loss": math.nan, "grad_norm": math.inf}
        ).to_dict()
    )
    writer.close()
    (line,) = path.read_text().splitlines()
    assert strict_loads(line)["evidence"] == {"loss": "nan", "grad_norm": "inf"}


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n{"step": 1')
    assert read_jsonl(path) == [{"step": 0}]
    path.write_text('{"step": 0}\n{"step": 1\n')  # ends with its newline: written whole, so corrupt
    with pytest.raises(ValueError, match=r"log.jsonl' line 2 is not valid JSON"):
        read_jsonl(path)


def test_new_outputs_leave_no_folder_behind_a_failure_and_keep_the_users(tmp_path):
    import typer

    from sdcscope.common.storage import new_outputs

    made, empty, full = tmp_path / "a" / "b" / "out", tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    (full / "mine.txt").write_text("kept")
    with pytest.raises(typer.Exit), new_outputs(made, empty, full):
        for folder in (made, empty, full):
            (folder / "sub").mkdir(parents=True, exist_ok=True)
            (folder / "sub" / "half.json").write_text("{")
        raise typer.Exit(6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # a/ and a/b/ went with out/
    assert list(empty.iterdir()) == [] and (full / "mine.txt").read_text() == "kept"
    with pytest.raises(typer.Exit), new_outputs(made):
        made.mkdir(parents=True)
        raise typer.Exit(0)  # a success that exits early keeps what it wrote
    assert made.is_dir()
