"""Per-step training metrics and their sinks (JSONL, TensorBoard, Prometheus).

Depends only on torch. :class:`Metrics` computes everything on device and syncs once per step;
:func:`is_matmul` is the duck-typed MatMul contract (``is_matmul = True``, ``forward(a, b) = a @ b``)
that :mod:`sdcscope.detect` also uses.
"""

from sdcscope.observe._util import is_matmul, jsonable, match_modules
from sdcscope.observe.config import MetricsConfig
from sdcscope.observe.metrics import Metrics, grad_norms, grad_sq_norms
from sdcscope.observe.sinks import JsonlSink, PrometheusSink, Sink, TensorBoardSink

__all__ = [
    "JsonlSink",
    "Metrics",
    "MetricsConfig",
    "PrometheusSink",
    "Sink",
    "TensorBoardSink",
    "grad_norms",
    "grad_sq_norms",
    "is_matmul",
    "jsonable",
    "match_modules",
]
