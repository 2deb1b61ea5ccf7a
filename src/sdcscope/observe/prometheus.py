"""The guard's metrics and event counters for Prometheus, named and labelled by its conventions.

* A whole-model value and the per-layer values of one quantity are two metrics, so ``sum()`` over
  a metric never adds the whole model to its own layers: ``sdcscope_grad_norm`` (the global norm)
  and ``sdcscope_layer_grad_norm{layer="blocks.0.mlp.fc"}``.
* Units in the name where the value has one (``sdcscope_attn_entropy_nats``), ``_total`` on every
  counter (``sdcscope_detections_total{detector,verdict}``), a HELP text saying what each is.
* Every metric carries the ``rank`` it was measured on (0 in one process); in a distributed run
  rank ``r`` serves on ``port + r``.
"""

from __future__ import annotations

import logging
import re

from sdcscope.observe.sinks import _missing, split_metric

log = logging.getLogger("sdcscope.observe.sinks")

__all__ = ["PrometheusSink", "prometheus_name"]

_BAD = re.compile(r"[^a-zA-Z0-9_:]")

_QUANTITIES: dict[str, tuple[str, str]] = {
    "step": ("step", "Last training step whose metrics were written (0-based)"),
    "loss": ("loss", "Training loss of the last step, as the training loop computed it"),
    "lr": ("learning_rate", "Learning rate of the optimizer's first parameter group"),
    "grad_norm": ("grad_norm", "L2 norm of the gradient before clipping"),
    "param_norm": ("param_norm", "L2 norm of all parameters after the last update (statistics steps)"),
    "update_ratio": ("update_ratio", "L2 norm of the last update over the L2 norm of the parameters"),
    "cos/update_grad": ("update_grad_cosine", "Cosine between the last update and the gradient (< 0 for descent)"),
    "cos/grad_moment": ("grad_moment_cosine", "Cosine between the gradient and Adam's first moment before the step"),
    "adam/g2_over_v": ("adam_g2_over_v_ratio", "Sum of squared gradients over Adam's second moment, whole model"),
    "adam/g2_over_v_min": ("adam_g2_over_v_min_ratio", "Smallest per-layer squared gradient over Adam's second moment"),
    "adam/g2_over_v_max": ("adam_g2_over_v_max_ratio", "Largest per-layer squared gradient over Adam's second moment"),
    "attn/max_logit_bound": ("attn_max_logit_bound", "Upper bound of the largest attention logit, max|q| * max|k|"),
    "attn/max_logit": ("attn_max_logit", "Largest attention logit before masking (probe steps)"),
    "attn/entropy": ("attn_entropy_nats", "Mean entropy of the attention probabilities (probe steps)"),
    "attn/entropy_min": ("attn_entropy_min_nats", "Lowest per-layer mean attention entropy (probe steps)"),
    "logits/lse_mean": ("logits_lse_mean", "Mean log-sum-exp of the output logits per token (statistics steps)"),
    "logits/lse_max": ("logits_lse_max", "Largest log-sum-exp of the output logits per token (statistics steps)"),
    "act/kurtosis": ("act_kurtosis", "Kurtosis of the per-feature RMS of activations; 1: no outlier features"),
    "act/kurtosis_max": ("act_kurtosis_max", "Largest per-module activation kurtosis (probe steps)"),
    "stable_rank": ("stable_rank", "Stable rank of a weight, squared Frobenius norm over squared spectral norm"),
    "stable_rank_min": ("stable_rank_min", "Lowest stable rank over the weights"),
}
"""Metric key (a quantity of :class:`~sdcscope.observe.Metrics`) -> (name without the prefix, HELP)."""

_COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "detections": (("detector", "verdict"), "Guard findings, by the detector that made them and the verdict"),
    "actions": (("action",), "Steps on which the guard took each mitigation action"),
    "replays": ((), "Steps the guard re-executed to judge a finding"),
    "rollbacks": ((), "Rollbacks of the model and optimizer to a verified snapshot"),
    "guard_reports": (("verdict",), "The guard's reports about itself (an internal error, a stall)"),
}
"""Event counter (exposed with ``_total``) -> (its labels, HELP)."""


def prometheus_name(key: str, prefix: str = "sdcscope_") -> tuple[str, str, bool]:
    """``(name, HELP, per_layer)`` of a metric key: ``grad_norm`` -> ``sdcscope_grad_norm``,
    ``grad_norm/blocks.0.fc`` -> ``sdcscope_layer_grad_norm`` (its layer a label)."""
    quantity, layer = split_metric(key)
    per_layer = layer not in (None, "all")
    name, help_text = _QUANTITIES.get(quantity, (_BAD.sub("_", quantity), f"sdcscope metric {quantity!r}"))
    if per_layer:
        return f"{prefix}layer_{name}", f"{help_text}, of one layer (module or parameter)", True
    scope = ", whole model" if layer == "all" else ""
    return f"{prefix}{name}", help_text + scope, False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PrometheusSink:
    """Gauges and counters in a ``prometheus_client`` registry, served over HTTP on ``port``
    (``0``: any free port, see :attr:`port`; ``None``: not served, read :attr:`registry`). In a
    distributed run rank ``r`` serves on ``port + r`` (``port`` 0: each rank any free port).

    Names: :func:`prometheus_name`; the last step is ``<prefix>step``; guard events (:meth:`event`)
    count into ``<prefix>detections_total{detector,verdict}``, ``<prefix>actions_total{action}``,
    ``<prefix>replays_total``, ``<prefix>rollbacks_total`` and ``<prefix>guard_reports_total{verdict}``.
    Every metric has the label ``rank`` (this process's, or ``rank``); ``labels`` adds constant labels
    (e.g. ``{"run": "exp1"}``). :meth:`close` stops the server.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        registry: object = None,
        prefix: str = "sdcscope_",
        labels: dict[str, str] | None = None,
        addr: str = "127.0.0.1",
        rank: int | None = None,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise ImportError(_missing("PrometheusSink", "prometheus_client", "prometheus")) from exc
        from sdcscope.observe.eventlog import EventCounts

        self._prom = prometheus_client
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._prefix = prefix
        self.rank = _rank() if rank is None else int(rank)
        self._const = {"rank": str(self.rank), **{str(k): str(v) for k, v in (labels or {}).items()}}
        self._metrics: dict[str, object] = {}
        self._counts = EventCounts()
        self._server = None
        for what in ("replays", "rollbacks"):  # 0 from the first scrape on
            self._counter(what)
        self.port = port
        if port is not None:
            port = port + self.rank if port else 0
            self._server, _ = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
            self.port = self._server.server_port
            log.info("Prometheus metrics of rank %d served on http://%s:%d/metrics", self.rank, addr, self.port)

    def _get(self, kind: str, name: str, help_text: str, extra: tuple[str, ...]):
        metric = self._metrics.get(name)
        if metric is None:
            cls = self._prom.Gauge if kind == "gauge" else self._prom.Counter
            metric = cls(name, help_text, [*self._const, *extra], registry=self.registry)
            self._metrics[name] = metric
        return metric

    def _counter(self, what: str, **labels: str):
        extra, help_text = _COUNTERS[what]
        return self._get("counter", self._prefix + what, help_text, extra).labels(**self._const, **labels)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        name, help_text, _ = prometheus_name("step", self._prefix)
        self._get("gauge", name, help_text, ()).labels(**self._const).set(step)
        for key, value in metrics.items():
            name, help_text, per_layer = prometheus_name(key, self._prefix)
            if per_layer:
                gauge = self._get("gauge", name, help_text, ("layer",))
                gauge.labels(**self._const, layer=split_metric(key)[1]).set(value)
            else:
                self._get("gauge", name, help_text, ()).labels(**self._const).set(value)

    def event(self, record: dict) -> None:
        """Count a guard event (an ``events.jsonl`` record)."""
        added = self._counts.add(record)
        if added["detection"] is not None:
            detector, verdict = added["detection"]
            self._counter("detections", detector=detector, verdict=verdict).inc()
        if added["report"] is not None:
            self._counter("guard_reports", verdict=added["report"]).inc()
        for action in added["actions"]:
            self._counter("actions", action=action).inc()
        for what in ("replay", "rollback"):
            if added[what]:
                self._counter(f"{what}s").inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
