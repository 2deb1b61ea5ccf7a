"""Metric sinks: JSONL contract, lazy optional back-ends with clear errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from helpers import MLP
from sdcscope.observe import JsonlSink, Metrics, MetricsConfig, PrometheusSink, Sink, TensorBoardSink


def test_jsonl_sink_one_strict_json_object_per_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with JsonlSink(path) as sink:
        assert isinstance(sink, Sink)
        sink.write(0, {"loss": 2.5, "grad_norm": float("inf")})
        sink.write(1, {"loss": float("nan"), "step": 99})
    lines = path.read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # strict JSON: no bare NaN/Infinity
    assert rows == [{"step": 0, "loss": 2.5, "grad_norm": "inf"}, {"step": 1, "loss": "nan"}]
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert float(rows[0]["grad_norm"]) == float("inf")


def test_metrics_writes_jsonl_from_config(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "metrics.jsonl"
    m = Metrics(model, opt, MetricsConfig(path=str(path))).attach()
    for step in range(3):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 12)), torch.zeros(4, dtype=torch.long))
        loss.backward()
        m.after_backward()
        opt.step()
        opt.zero_grad()
        m.collect(step, loss)
    m.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all({"loss", "grad_norm", "lr"} <= r.keys() for r in rows)
    assert "param_norm" in rows[0] and "param_norm" not in rows[1]  # statistics tier: step 0


def test_explicit_sinks_override_config(tmp_path):
    got = []

    class ListSink:
        def write(self, step, metrics):
            got.append((step, dict(metrics)))

        def close(self):
            got.append("closed")

    m = Metrics(MLP(), config=MetricsConfig(path=str(tmp_path / "unused.jsonl")), sinks=[ListSink()])
    m.collect(7, 1.25)
    m.close()
    assert got[0][0] == 7 and got[0][1]["loss"] == 1.25 and got[-1] == "closed"
    assert not (tmp_path / "unused.jsonl").exists()


def test_optional_backends_fail_clearly_when_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"tensorboard.*sdcscope\[tensorboard\]"):
        TensorBoardSink(tmp_path / "tb")
    with pytest.raises(ImportError, match=r"prometheus_client.*sdcscope\[prometheus\]"):
        PrometheusSink()


def test_prometheus_sink_labels_layers():
    prom = pytest.importorskip("prometheus_client")
    reg = prom.CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    sink.write(3, {"loss": 2.0, "grad_norm/blocks.0.fc": 0.5})
    assert reg.get_sample_value("sdcscope_loss", {"rank": "0"}) == 2.0
    assert reg.get_sample_value("sdcscope_layer_grad_norm", {"rank": "0", "layer": "blocks.0.fc"}) == 0.5
    assert reg.get_sample_value("sdcscope_step", {"rank": "0"}) == 3
