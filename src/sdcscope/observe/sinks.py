"""Where per-step metrics go: JSONL (default), TensorBoard, Prometheus.

A sink is anything with ``write(step, metrics)`` and ``close()`` (:class:`Sink`). The optional
back-ends import their library lazily, on construction, and raise ``ImportError`` naming the
extra to install when it is missing; :func:`check_sink` refuses such a sink before any work.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

from sdcscope.common.io import JsonlWriter, file_in_the_way, jsonable


def _missing(what: str, package: str, extra: str) -> str:
    return f"{what} needs the {package!r} package: pip install 'sdcscope[{extra}]'"


@runtime_checkable
class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One strict-JSON object per step, ``{"step": N, ...metrics}``, appended to ``path`` by a
    :class:`~sdcscope.common.io.JsonlWriter` (created on construction).

    Non-finite values are written as the strings ``"nan"``/``"inf"``/``"-inf"``. The file is
    flushed every ``flush_every`` writes (1 = every step, so a crash loses nothing).
    """

    def __init__(self, path: str | Path, *, append: bool = True, flush_every: int = 1) -> None:
        self._writer = JsonlWriter(path, append=append, flush_every=flush_every)
        self.path = self._writer.path
        self._writer.touch()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._writer.write(jsonable({"step": int(step), **{k: v for k, v in metrics.items() if k != "step"}}))

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardSink:
    """Scalars to a TensorBoard event file through ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, log_dir: str | Path, **writer_kwargs: object) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional dependency
            raise ImportError(_missing("TensorBoardSink", "tensorboard", "tensorboard")) from exc
        self._writer = SummaryWriter(log_dir=str(log_dir), **writer_kwargs)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


_PROM_BAD = re.compile(r"[^a-zA-Z0-9_:]")


class PrometheusSink:
    """Gauges in a ``prometheus_client`` registry, optionally served over HTTP on ``port``.

    ``grad_norm/blocks.0.fc`` becomes the gauge ``<prefix>grad_norm{layer="blocks.0.fc"}``: the
    part before the first ``/`` names the gauge, the rest is its ``layer`` label. The last step
    is the gauge ``<prefix>step``.
    """

    def __init__(self, *, port: int | None = None, registry: object = None, prefix: str = "sdcscope_") -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(_missing("PrometheusSink", "prometheus_client", "prometheus")) from exc
        self._prom = prometheus_client
        self._registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._prefix = prefix
        self._gauges: dict[str, object] = {}
        if port is not None:
            prometheus_client.start_http_server(port, registry=self._registry)

    def _gauge(self, name: str, labelled: bool):
        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = self._prom.Gauge(
                name, f"sdcscope metric {name}", ["layer"] if labelled else [], registry=self._registry
            )
            self._gauges[name] = gauge
        return gauge

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._gauge(self._prefix + "step", False).set(step)
        for key, value in metrics.items():
            base, _, layer = key.partition("/")
            name = self._prefix + _PROM_BAD.sub("_", base)
            gauge = self._gauge(name + ("_by_layer" if layer else ""), bool(layer))
            (gauge.labels(layer=layer) if layer else gauge).set(value)

    def close(self) -> None:
        pass


def make_sink(kind: str, path: str | Path) -> Sink:
    """The sink a :class:`~sdcscope.observe.MetricsConfig` names: ``'jsonl'`` or ``'tensorboard'``."""
    return JsonlSink(path) if kind == "jsonl" else TensorBoardSink(path)


def check_sink(kind: str, path: str | Path) -> None:
    """Refuse (ValueError), before any work, the sink :func:`make_sink` could not build: a missing
    optional package, a JSONL path that is a folder, a path under a file."""
    if kind == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(_missing("metrics sink 'tensorboard'", "tensorboard", "tensorboard"))
    if kind == "jsonl" and Path(path).is_dir():
        raise ValueError(f"metrics path {str(path)!r} is a folder; give a JSONL file")
    if kind == "tensorboard" and Path(path).is_file():
        raise ValueError(f"metrics path {str(path)!r} is a file; give a TensorBoard log folder")
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise ValueError(f"metrics path {str(path)!r} cannot be created: {str(blocker)!r} is a file, not a folder")
