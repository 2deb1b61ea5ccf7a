"""Per-step training metrics and their sinks (JSONL, TensorBoard, Prometheus).

Depends only on torch. :class:`Metrics` computes everything on device and syncs once per step;
:func:`is_matmul` (the duck-typed MatMul contract, ``is_matmul = True``, ``forward(a, b) = a @ b``),
:func:`match_modules` and :func:`jsonable` are re-exported from :mod:`sdcscope.common`.
"""

from sdcscope.common.io import jsonable
from sdcscope.common.modules import is_matmul, match_modules
from sdcscope.observe.config import MetricsConfig
from sdcscope.observe.metrics import Metrics
from sdcscope.observe.reduce import grad_norms, grad_sq_norms
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
