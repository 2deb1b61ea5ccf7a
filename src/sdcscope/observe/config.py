"""Configuration of the per-step metrics collector (:class:`~sdcscope.observe.Metrics`).

Tiers (see docs/guard.md): every step (loss, learning rate, gradient norms global
and per layer, attention-logit bound — a few fused reductions); statistics steps every
``stats_every`` (parameter norm, update ratio, cosines, Adam ``g²/v``, output log-sum-exp); probe steps every
``probe_every`` (exact attention max logit and entropy, activation kurtosis); and every
``stable_rank_every`` steps (weight stable rank by power iteration). Set ``stats_every=1`` to get
the statistics tier every step (its cost: benchmarks/; it is largest on small models, where Python
and dispatch cost per tensor dominate).

Module options left at ``None`` use a default that may match nothing (a model without attention
simply has no attention metrics); a pattern you set must match something, else ``ValueError``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sdcscope.common.validate import check_bool, check_choice, check_positive
from sdcscope.observe.sinks import check_package, check_sink

UPDATE_RATIO_SOURCES = ("auto", "optimizer", "copy", "off")
SINKS = ("jsonl", "tensorboard")
MLFLOW_KEYS = ("tracking_uri", "experiment", "run_id", "run_name", "tags")

DEFAULT_ATTN_SCORE = "*score"
DEFAULT_ATTN_CONTEXT = "*context"
DEFAULT_OUTPUT_MODULE = "head"


@dataclass(kw_only=True)
class MetricsConfig:
    per_layer: bool = True
    """Also emit ``grad_norm/<layer>`` and ``update_ratio/<layer>`` (layer = parameter's module)."""
    update_ratio: str = "auto"
    """How ``‖Δθ‖/‖θ‖`` gets ``Δθ``: ``'optimizer'`` reconstructs the step the optimizer just took
    from its state (Adam/AdamW/SGD, no extra memory), ``'copy'`` keeps a pre-step copy of the
    parameters (exact, any optimizer, one parameter-sized buffer), ``'auto'`` = optimizer when
    supported and exact, else copy (sparse gradients, which the reconstruction leaves out, and
    weights narrower than fp32, whose stored update is the intended one rounded), ``'off'``."""
    cosines: bool = True
    """``cos/update_grad`` (cos(Δθ, g); a descent step gives a negative value) and
    ``cos/grad_moment`` (cos(g_t, m_{t-1}) with Adam's exp_avg before this step)."""
    adam_stats: bool = True
    """``adam/g2_over_v`` = Σg²/Σv̂_{t-1} (global and min/max over layers): ≪ 1 for long means the
    second moment has decoupled from the gradient."""
    stats_every: int = 25
    """Parameter norm, update ratio, cosines, Adam statistics and the output log-sum-exp on steps with
    ``step % stats_every == 0`` (research tier "every ~10–100 steps")."""
    probe_every: int = 50
    """Exact attention max logit, attention entropy and activation kurtosis on steps with
    ``step % probe_every == 0``."""
    stable_rank_every: int = 100
    """Weight stable rank ``‖W‖_F²/σ_max²`` on steps with ``step % stable_rank_every == 0``."""
    power_iters: int = 2
    """Power iterations per stable-rank probe of a weight above 2²² elements (smaller ones get the
    exact σ_max from an SVD); the vector is kept between probes (warm start, the first probe runs
    ``10 × power_iters``). A few iterations underestimate σ_max, so they overstate the stable rank,
    where the top singular values lie close together (fresh random weights); more iterations narrow
    the gap."""
    attn_score: str | None = None
    """Pattern for the attention-score MatMul modules (``forward(q*scale, kᵀ)``); default ``'*score'``."""
    attn_context: str | None = None
    """Pattern for the MatMul modules that receive the attention probabilities
    (``forward(probs, v)``); default ``'*context'``."""
    sdpa: bool = True
    """Also take the attention metrics from the model's ``F.scaled_dot_product_attention`` calls
    (Hugging Face models, ``nn.TransformerEncoderLayer``): while attached, the function is
    wrapped (:mod:`sdcscope.observe.attention`); the metrics are named after the module that
    called it."""
    output_module: str | None = None
    """Module whose output are the vocabulary logits; default ``'head'``."""
    kurtosis_modules: tuple[str, ...] | None = None
    """Modules whose output kurtosis is measured; default: every element of the model's top-level
    ``nn.ModuleList`` (the transformer blocks, i.e. the residual stream)."""
    stable_rank_params: tuple[str, ...] | None = None
    """Parameter-name patterns for the stable rank; default: every 2-D parameter."""
    sink: str = "jsonl"
    """Sink built from ``path`` when :class:`Metrics` gets no explicit ``sinks``: ``'jsonl'``
    (:class:`JsonlSink`) or ``'tensorboard'`` (log dir). Prometheus: pass a ``PrometheusSink``."""
    path: str | None = None
    """JSONL file (or TensorBoard log dir); ``None`` = no sink from the config."""
    prometheus_port: int | None = None
    """Serve the metrics and the guard's event counters (detections, actions, replays,
    rollbacks) for Prometheus at ``http://<prometheus_addr>:<port>/metrics`` (rank ``r`` of a
    distributed run at ``port + r``); 0 = any free port (logged); ``None`` = off. Needs
    ``pip install 'sdcscope[prometheus]'``."""
    prometheus_addr: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (``0.0.0.0``: every interface)."""
    wandb: dict | None = None
    """Log to Weights & Biases: the keyword arguments of ``wandb.init`` (``project``, ``name``,
    ``mode: offline``, ``dir``, ...); ``{}`` = wandb's defaults; ``None`` = off. Needs
    ``pip install 'sdcscope[wandb]'``."""
    mlflow: dict | None = None
    """Log to MLflow: ``tracking_uri``, ``experiment``, ``run_id``, ``run_name``, ``tags`` (see
    :class:`~sdcscope.observe.trackers.MlflowSink`); ``{}`` = the default tracking URI, experiment
    ``sdcscope``; ``None`` = off. Needs ``pip install 'sdcscope[mlflow]'``."""

    def __post_init__(self) -> None:
        check_choice("update_ratio", self.update_ratio, UPDATE_RATIO_SOURCES)
        check_choice("sink", self.sink, SINKS)
        for name in ("stats_every", "probe_every", "stable_rank_every", "power_iters"):
            check_positive(name, getattr(self, name))
        for name in ("per_layer", "cosines", "adam_stats", "sdpa"):
            check_bool(name, getattr(self, name))
        for name in ("attn_score", "attn_context", "output_module", "path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name}={value!r} must be a non-empty string or None")
            if value == "":
                raise ValueError(f"{name}={value!r} must be a non-empty string or None")
        if self.path is not None:
            check_sink(self.sink, self.path)
        self._check_trackers()
        for name in ("kurtosis_modules", "stable_rank_params"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{name}={value!r} must be a pattern or a list of non-empty pattern strings")
            if not all(value):
                raise ValueError(f"{name}={value!r} must be a pattern or a list of non-empty pattern strings")
            setattr(self, name, tuple(value))

    def _check_trackers(self) -> None:
        port = self.prometheus_port
        if port is not None:
            if isinstance(port, bool) or not isinstance(port, int):
                raise TypeError(f"prometheus_port={port!r} must be an int (0..65535) or None")
            if not 0 <= port <= 65535:
                raise ValueError(f"prometheus_port={port!r} must lie in 0..65535 (0: any free port) or be None")
            check_package("metrics prometheus_port", "prometheus_client", "prometheus-client", "prometheus")
        if not isinstance(self.prometheus_addr, str) or not self.prometheus_addr:
            raise TypeError(f"prometheus_addr={self.prometheus_addr!r} must be a non-empty string")
        for name, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"{name}={value!r} must be a mapping of settings or None")
            check_package(f"metrics {name}", module, module, module)
        unknown = sorted(set(self.mlflow or {}) - set(MLFLOW_KEYS))
        if unknown:
            raise ValueError(f"mlflow settings {unknown} unknown; allowed: {', '.join(MLFLOW_KEYS)}")

    def to_dict(self) -> dict:
        return asdict(self)
