"""Experiment trackers as metric sinks: Weights & Biases and MLflow (optional extras).

Each imports its library lazily, on construction (``ImportError`` naming the extra when it is
missing), logs every metrics row at its step, and adds the guard's running event counts
(:class:`~sdcscope.observe.eventlog.EventCounts`: ``sdcscope/detections``, ``sdcscope/actions/<a>``,
``sdcscope/replays``, ``sdcscope/rollbacks``) to the rows that follow an event. Both work offline:
W&B with ``mode="offline"`` (a local run folder to ``wandb sync`` later), MLflow with a
``file:`` tracking URI or a local database.
"""

from __future__ import annotations

import time
from typing import Any

from sdcscope.observe.eventlog import EventCounts
from sdcscope.observe.sinks import split_metric


def _missing(what: str, package: str, extra: str) -> str:
    return f"{what} needs the {package!r} package: pip install 'sdcscope[{extra}]'"


class _CountingSink:
    """Keeps the event counts; a subclass logs them with the next row (and at close)."""

    def __init__(self) -> None:
        self.counts = EventCounts()
        self._dirty = False
        self._last_step = 0

    def event(self, record: dict) -> None:
        self.counts.add(record)
        self._dirty = True

    def _row(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        self._last_step = int(step)
        row = {k: float(v) for k, v in metrics.items() if k != "step"}
        if self._dirty:
            row.update(self.counts.as_metrics())
            self._dirty = False
        return row


class WandbSink(_CountingSink):
    """Metrics rows to a Weights & Biases run: ``run`` (an active ``wandb`` run, left open at
    :meth:`close`) or a new one from ``wandb.init(**init_kwargs)`` (finished at :meth:`close`);
    e.g. ``WandbSink(project="sdc", mode="offline", dir="runs/wandb")``."""

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        super().__init__()
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(_missing("WandbSink", "wandb", "wandb")) from exc
        self._owned = run is None
        self.run = wandb.init(**init_kwargs) if run is None else run

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(self._row(step, metrics), step=int(step))

    def close(self) -> None:
        if self._dirty:  # events after the last row
            self.run.log(self.counts.as_metrics(), step=self._last_step)
            self._dirty = False
        if self._owned and self.run is not None:
            self.run.finish()
            self.run = None


class MlflowSink(_CountingSink):
    """Metrics rows to an MLflow run through ``MlflowClient(tracking_uri)``: ``run_id`` (an
    existing run, left open) or a new run in ``experiment`` (created if missing; ended at
    :meth:`close`). Names as :meth:`key`; non-finite values are logged as MLflow stores them."""

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str = "sdcscope",
        run_id: str | None = None,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(_missing("MlflowSink", "mlflow", "mlflow")) from exc
        self._metric = Metric
        self.client = MlflowClient(tracking_uri)
        self._owned = run_id is None
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        self.run_id = run_id

    @staticmethod
    def key(name: str) -> str:
        """The MLflow name of a metric: a per-layer quantity's global value gets ``/all``
        (``grad_norm`` → ``grad_norm/all``), so no name is a folder of another in the file store."""
        quantity, layer = split_metric(name)
        return name if layer is None else f"{quantity}/{layer}"

    def _log(self, step: int, row: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(self.key(k), v, now, int(step)) for k, v in row.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._log(step, self._row(step, metrics))

    def close(self) -> None:
        if self.run_id is None:
            return
        if self._dirty:
            self._log(self._last_step, self.counts.as_metrics())
            self._dirty = False
        if self._owned:
            self.client.set_terminated(self.run_id)
        self.run_id = None
