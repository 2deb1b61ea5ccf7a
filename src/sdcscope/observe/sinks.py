"""Where per-step metrics go: JSONL (default), TensorBoard, Prometheus (:mod:`.prometheus`; W&B, MLflow:
:mod:`.trackers`).

A sink is anything with ``write(step, metrics)`` and ``close()`` (:class:`Sink`); one that also
has ``event(record)`` gets the guard's events too (to count them). The optional
back-ends import their library lazily, on construction, and raise ``ImportError`` naming the
extra to install when it is missing; :func:`check_sink` refuses such a sink before any work.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

from sdcscope.common.io import JsonlWriter, file_in_the_way, jsonable

log = logging.getLogger(__name__)


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


LAYER_FAMILIES = (
    "grad_norm",
    "update_ratio",
    "attn/max_logit_bound",
    "attn/max_logit",
    "attn/entropy",
    "act/kurtosis",
    "stable_rank",
)
"""The quantities :class:`~sdcscope.observe.Metrics` also gives per layer, as ``<quantity>/<layer>``."""


def split_metric(key: str) -> tuple[str, str | None]:
    """``(quantity, layer)`` of a metric name: ``'attn/entropy/blocks.0.attn'`` →
    ``('attn/entropy', 'blocks.0.attn')``; a per-layer quantity's global value (``'grad_norm'``)
    has layer ``'all'``; any other key is its own quantity with no layer (``('attn/entropy_min', None)``)."""
    if key in LAYER_FAMILIES:
        return key, "all"
    cut = key.rfind("/")
    if cut > 0 and key[:cut] in LAYER_FAMILIES:  # module names hold no '/'
        return key[:cut], key[cut + 1 :]
    return key, None


class LatestRow:
    """The latest metrics row, kept in memory for a trainer's own loggers (the HF and Lightning
    adapters add it to their guard's sinks): :meth:`summary` gives the whole-model values --
    quantities without a layer and the ``layer="all"`` ones of :func:`split_metric` -- under
    ``prefix``; the per-layer ones stay in the metrics file."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.row: dict[str, float] = {}

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.step, self.row = int(step), dict(metrics)

    def summary(self, prefix: str = "sdcscope/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in self.row.items() if split_metric(k)[1] in (None, "all")}

    def close(self) -> None:
        pass


def make_sink(kind: str, path: str | Path) -> Sink:
    """The sink a :class:`~sdcscope.observe.MetricsConfig` names: ``'jsonl'`` or ``'tensorboard'``."""
    return JsonlSink(path) if kind == "jsonl" else TensorBoardSink(path)


def make_sinks(config) -> list[Sink]:
    """Every sink a :class:`~sdcscope.observe.MetricsConfig` asks for: its ``sink`` at ``path``,
    a Prometheus endpoint (``prometheus_port``), Weights & Biases (``wandb``), MLflow (``mlflow``)."""
    sinks: list[Sink] = []
    if config.path is not None:
        sinks.append(make_sink(config.sink, config.path))
    if config.prometheus_port is not None:
        from sdcscope.observe.prometheus import PrometheusSink

        sinks.append(PrometheusSink(port=config.prometheus_port, addr=config.prometheus_addr))
    if config.wandb is not None or config.mlflow is not None:
        from sdcscope.observe.trackers import MlflowSink, WandbSink

        if config.wandb is not None:
            sinks.append(WandbSink(**config.wandb))
        if config.mlflow is not None:
            sinks.append(MlflowSink(**config.mlflow))
    return sinks


def check_package(what: str, module: str, package: str, extra: str) -> None:
    """ValueError naming the extra to install when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(_missing(what, package, extra))


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
