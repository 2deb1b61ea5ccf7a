"""Per-step training metrics and their sinks (JSONL, TensorBoard, Prometheus, W&B, MLflow).

Depends only on torch. :class:`Metrics` computes everything on device and syncs once per step;
:func:`is_matmul` (the duck-typed MatMul contract, ``is_matmul = True``, ``forward(a, b) = a @ b``),
:func:`match_modules` and :func:`jsonable` are re-exported from :mod:`sdcscope.common`.
"""

from sdcscope.common.io import jsonable
from sdcscope.common.modules import is_matmul, match_modules
from sdcscope.observe.config import MetricsConfig
from sdcscope.observe.eventlog import EventCounts, event_line
from sdcscope.observe.metrics import Metrics
from sdcscope.observe.prometheus import PrometheusSink
from sdcscope.observe.reduce import grad_norms, grad_sq_norms
from sdcscope.observe.sinks import JsonlSink, Sink, TensorBoardSink, split_metric
from sdcscope.observe.trackers import MlflowSink, WandbSink

__all__ = [
    "EventCounts",
    "JsonlSink",
    "Metrics",
    "MetricsConfig",
    "MlflowSink",
    "PrometheusSink",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "event_line",
    "grad_norms",
    "grad_sq_norms",
    "is_matmul",
    "jsonable",
    "match_modules",
    "split_metric",
]
