"""Per-step training metrics for any model and optimizer, computed on device, one host sync a step.

Call order in a training loop (each call is optional; a missing one only drops its metrics)::

    m = Metrics(model, optimizer, MetricsConfig(path="run/metrics.jsonl")).attach()
    for step in range(steps):
        loss = loss_fn(model(x), y)          # forward hooks: attention bound, log-sum-exp, probes
        loss.backward()
        m.after_backward()                   # grad norms, before clipping
        clip_grad_norm_(model.parameters(), 1.0)
        m.before_optimizer_step()            # cos(g, m_{t-1}), Adam g²/v̂, pre-step copy
        optimizer.step()
        m.after_optimizer_step()             # Δθ: update ratio, cos(Δθ, g), param norm
        optimizer.zero_grad()
        row = m.collect(step, loss)          # stack everything, one .tolist(), write the sinks
    m.close()

``attach(optimizer_hooks=True)`` registers the two optimizer calls as optimizer step hooks
instead. Every quantity stays a device tensor until :meth:`Metrics.collect` concatenates them
into one vector and calls ``.tolist()`` once. Tiers (:class:`MetricsConfig`): every step the loss,
learning rate, gradient
norms and the attention-logit bound; statistics steps (``stats_every``) add the parameter norm,
update ratio, cosines, Adam statistics and the log-sum-exp; probe steps (``probe_every``) the exact
attention logit, entropy and kurtosis. Metric names (``<layer>`` is a module name):

====================================  =============================================================
``loss``, ``lr``                      the value given to ``collect``; group 0's learning rate
``grad_norm``, ``grad_norm/<layer>``  ‖g‖₂ (global, per module), before clipping
``param_norm``                        ‖θ‖₂ after the step (statistics steps)
``update_ratio[/<layer>]``            ‖Δθ‖₂ / ‖θ‖₂
``cos/update_grad``                   cos(Δθ_t, g_t); a descent step is negative
``cos/grad_moment``                   cos(g_t, m_{t-1}) with Adam's ``exp_avg`` before the step
``adam/g2_over_v[_min|_max]``         Σg² / Σv̂_{t-1} (global; min/max over layers)
``attn/max_logit_bound[/<attn>]``     max over (batch, head) of maxᵢ‖qᵢ‖·maxⱼ‖kⱼ‖ (q already
                                      scaled), from the score MatMul's inputs, every step;
                                      where the logits are fewer than q's and k's elements
                                      (sequence ≤ 2·head dim) their exact max, which costs less
``attn/max_logit[/<attn>]``           exact max of the score MatMul output (probe steps; before
                                      masking, so an upper bound of the used logits)
                                      — also from ``F.scaled_dot_product_attention`` calls
                                      (:mod:`sdcscope.observe.attention`)
``attn/entropy[_min]``, ``/<attn>``   mean −Σ p log p of the probabilities fed to the context
                                      MatMul (probe steps; rows renormalised, so with attention
                                      dropout it is the entropy of the dropped-out rows)
``logits/lse_mean``, ``_max``         log Σ exp(logits) of the output module, per token
``act/kurtosis[_max]``, ``/<module>`` mean(s⁴)/mean(s²)² with sⱼ the RMS of feature j over
                                      tokens (He et al.; 1 = no outlier features)
``stable_rank[_min]``, ``/<param>``   ‖W‖_F² / σ_max², σ_max by warm-started power iteration
====================================  =============================================================

Forward hooks record only in training mode (``module.training``), so evaluation passes do not
mix into the step's statistics; with gradient accumulation the per-step value is the max (or the
mean) over micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
from torch import nn

from sdcscope.common.modules import is_matmul, match_modules
from sdcscope.common.tensors import dense_values
from sdcscope.observe.attention import SDPATap
from sdcscope.observe.config import (
    DEFAULT_ATTN_CONTEXT,
    DEFAULT_ATTN_SCORE,
    DEFAULT_OUTPUT_MODULE,
    MetricsConfig,
)
from sdcscope.observe.forward_stats import TINY, ForwardStats
from sdcscope.observe.reduce import dense_grad, grad_sq_norms, prefixed, reconstruct_update, stack, summarize, total_dot
from sdcscope.observe.sinks import Sink, make_sinks

_EXACT_SIGMA = 1 << 22
"""Weights of up to this many elements get the exact σ_max (an SVD) in the stable rank."""


def _parent(name: str) -> str:
    return name.rpartition(".")[0] or name


class Metrics(ForwardStats):
    """Collects the metrics of :mod:`sdcscope.observe.metrics` for ``model`` (and ``optimizer``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: MetricsConfig | None = None,
        *,
        sinks: Iterable[Sink] | None = None,
    ) -> None:
        if config is not None and not isinstance(config, MetricsConfig):
            raise TypeError(f"config must be a MetricsConfig, not {type(config).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.config = cfg = config or MetricsConfig()
        named = list(model.named_parameters())  # frozen ones too: a loop may unfreeze them later
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        layers = [_parent(n) for n in self._names]
        slot = {x: i for i, x in enumerate(dict.fromkeys(layers))}
        self._layers = list(slot)
        self._layer_of = [slot[x] for x in layers]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._slots: dict[tuple, tuple[list[str], torch.Tensor]] = {}

        self._score = {
            _parent(n): m
            for n, m in match_modules(
                model,
                [cfg.attn_score or DEFAULT_ATTN_SCORE],
                where=is_matmul,
                option="attn_score",
                strict=cfg.attn_score is not None,
            ).items()
        }
        self._context = {
            _parent(n): m
            for n, m in match_modules(
                model,
                [cfg.attn_context or DEFAULT_ATTN_CONTEXT],
                where=is_matmul,
                option="attn_context",
                strict=cfg.attn_context is not None,
            ).items()
        }
        self._sdpa = SDPATap(model, self) if cfg.sdpa else None
        self._output = match_modules(
            model,
            [cfg.output_module or DEFAULT_OUTPUT_MODULE],
            option="output_module",
            strict=cfg.output_module is not None,
        )
        if cfg.kurtosis_modules is not None:
            self._kurtosis = match_modules(model, cfg.kurtosis_modules, option="kurtosis_modules")
        else:
            self._kurtosis = {
                f"{name}.{i}": child
                for name, lst in model.named_children()
                if isinstance(lst, nn.ModuleList)
                for i, child in enumerate(lst)
            }
        two_d = [(n, p) for n, p in named if p.dim() == 2]
        if cfg.stable_rank_params is not None:
            for pat in cfg.stable_rank_params:
                if not any(fnmatchcase(n, pat) for n, _ in two_d):
                    raise ValueError(
                        f"stable_rank_params pattern {pat!r} matches no 2-D parameter "
                        f"(2-D parameters: {', '.join(n for n, _ in two_d)})"
                    )
            two_d = [(n, p) for n, p in two_d if any(fnmatchcase(n, q) for q in cfg.stable_rank_params)]
        self._sr_params = two_d
        self._sr_vec: dict[str, torch.Tensor] = {}

        if sinks is not None:
            self.sinks = list(sinks)
        else:
            self.sinks = make_sinks(cfg)
        self._handles: list = []
        self._tier_handles: dict[str, list] = {}
        self._attached = False
        self._step = 0
        self._probe = self._stats = True
        self._reset()

    # ------------------------------------------------------------------ hooks
    def attach(self, *, optimizer_hooks: bool = False) -> Metrics:
        """Register the forward hooks (and optionally the optimizer step hooks); returns ``self``.

        :meth:`detach` (or leaving a ``with`` block) removes every hook. The hooks of the probe
        and statistics tiers live only on the steps that record them (:meth:`begin_step`): a
        module with a forward hook takes ``nn.Module``'s slower call path on every call.
        """
        if self._attached:
            return self
        self._attached = True
        h = self._handles
        for layer, mod in self._score.items():
            h.append(mod.register_forward_hook(self._score_hook(layer)))
        if self._sdpa is not None:
            h.append(self._sdpa.install())
        if optimizer_hooks:
            if self.optimizer is None:
                raise ValueError("optimizer_hooks=True needs an optimizer")
            h.append(self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.before_optimizer_step()))
            h.append(self.optimizer.register_step_post_hook(lambda opt, args, kwargs: self.after_optimizer_step()))
        self._sync_tiers()
        return self

    def _sync_tiers(self) -> None:
        """Register the probe-tier and statistics-tier hooks for this step's tiers, remove the others."""
        for tier, on in (("probe", self._probe), ("stats", self._stats)):
            have = self._tier_handles.get(tier)
            if on and self._attached and have is None:
                self._tier_handles[tier] = self._tier_hooks(tier)
            elif not (on and self._attached) and have is not None:
                for handle in self._tier_handles.pop(tier):
                    handle.remove()

    def _tier_hooks(self, tier: str) -> list:
        if tier == "stats":
            return [mod.register_forward_hook(self._lse) for mod in self._output.values()]
        h = [mod.register_forward_pre_hook(self._context_pre(layer)) for layer, mod in self._context.items()]
        return h + [mod.register_forward_hook(self._kurt(name)) for name, mod in self._kurtosis.items()]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attached = False
        self._sync_tiers()

    def __enter__(self) -> Metrics:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------- step calls
    def begin_step(self, step: int) -> None:
        """Declare the step the next forward belongs to (``collect`` does it for ``step + 1``)."""
        if int(step) == self._step:  # collect() already declared it
            return
        self.restart_step()  # whatever an uncollected step recorded (a discarded one) is not this one's
        self._step = int(step)
        self._probe = self._step % self.config.probe_every == 0
        self._stats = self._step % self.config.stats_every == 0
        self._sync_tiers()

    def _with_grad(self) -> list[int]:
        return [i for i, p in enumerate(self._params) if p.grad is not None]

    def _layer_sums(self, idx: list[int], sq: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """Per-layer sums of per-parameter values ``sq`` (aligned with ``idx``)."""
        key = (tuple(idx), sq.device)
        cached = self._slots.get(key)
        if cached is None:  # (layer names, each value's layer slot): one index_add per call
            slots = sorted({self._layer_of[i] for i in idx})
            pos = {s: j for j, s in enumerate(slots)}
            slot = torch.tensor([pos[self._layer_of[i]] for i in idx], device=sq.device)
            cached = self._slots[key] = ([self._layers[s] for s in slots], slot)
        names, slot = cached
        # (not a 0/1 membership GEMV: 0·inf = NaN would spread one layer's inf to every layer)
        return names, sq.new_zeros(len(names)).index_add_(0, slot, sq)

    def after_backward(
        self, grad_sq: tuple[list[int], torch.Tensor | None] | None = None, grad_norm: float | None = None
    ) -> None:
        """Gradient norms (global and per layer) of the gradients as they are now (pre-clip);
        ``grad_sq``: :func:`grad_sq_norms` of these same gradients (of the model's trainable
        parameters, in order), and ``grad_norm`` their global norm on the host, if already
        computed."""
        idx, sq = grad_sq if grad_sq is not None else grad_sq_norms(self._params)
        if sq is None:
            return
        if grad_norm is None:
            self._vec["grad_norm"] = ([], sq.sum().sqrt())
        else:
            self._host["grad_norm"] = float(grad_norm)
        if self.config.per_layer:
            names, per = self._layer_sums(idx, sq)
            self._vec["grad_norm/"] = (names, per.sqrt())
        self._done.add("backward")

    def before_optimizer_step(self, clip_norm: float | None = None) -> None:
        """cos(g, m_{t-1}) and Adam's g²/v̂_{t-1} from the state before this step; a pre-step copy
        of the parameters when the update ratio needs one. Call it after clipping the gradients;
        ``clip_norm``: the global norm a trainer clips them to after this call (the ratio then
        takes them as the update will: v̂ was built from clipped gradients)."""
        if "pre" in self._done:
            return
        self._done.add("pre")
        if "backward" not in self._done:
            self.after_backward()
        cfg = self.config
        idx = self._with_grad() if self._stats else None
        if not idx:
            return
        if self._update_source() == "copy":
            self._prev = (idx, torch._foreach_clone([self._params[i].detach() for i in idx]))
        opt = self.optimizer
        if opt is None or not (cfg.cosines or cfg.adam_stats):
            return
        rows = []  # (param index, grad, exp_avg, exp_avg_sq, beta2, step)
        for group in opt.param_groups:
            beta2 = group.get("betas", (0.9, 0.999))[1]
            for p in group["params"]:
                st = opt.state.get(p, {})
                if not dense_grad(p) or "exp_avg" not in st or id(p) not in self._index_of:
                    continue
                rows.append(
                    (
                        self._index_of[id(p)],
                        p.grad,
                        st["exp_avg"],
                        st.get("exp_avg_sq"),
                        float(beta2),
                        float(st.get("step", 0)),
                    )
                )
        if not rows:
            return
        dev = rows[0][1].device
        g_sq = stack(list(torch._foreach_norm([r[1] for r in rows])), dev).pow(2)
        if cfg.cosines:
            m_sq = stack(list(torch._foreach_norm([r[2] for r in rows])), dev).pow(2)
            dot = total_dot([r[1] for r in rows], [r[2] for r in rows])
            self._vec["cos/grad_moment"] = ([], dot / (g_sq.sum() * m_sq.sum()).sqrt().clamp_min(TINY))
        keep = [j for j, r in enumerate(rows) if r[3] is not None and r[5] >= 1]
        if cfg.adam_stats and keep:
            if len(keep) < len(rows):
                g_sq = g_sq[torch.tensor(keep, device=dev)]
                rows = [rows[j] for j in keep]
            if clip_norm is not None:  # as torch.nn.utils.clip_grad_norm_ will scale them
                grads = dense_values([self._params[i].grad for i in idx])
                total = stack(list(torch._foreach_norm(grads)), dev).norm()
                g_sq = g_sq * (clip_norm / (total + 1e-6)).clamp(max=1.0).square()
            v_sum = stack(list(torch._foreach_norm([r[3] for r in rows], 1)), dev)
            bc = torch.tensor([1.0 - r[4] ** r[5] for r in rows], device=dev)
            v_hat = v_sum / bc
            self._vec["adam/g2_over_v"] = ([], g_sq.sum() / v_hat.sum().clamp_min(TINY))
            names, g_l = self._layer_sums([r[0] for r in rows], g_sq)
            _, v_l = self._layer_sums([r[0] for r in rows], v_hat)
            ratio = g_l / v_l.clamp_min(TINY)
            self._vec["adam/g2_over_v_min"] = ([], ratio.min())
            self._vec["adam/g2_over_v_max"] = ([], ratio.max())

    def _update_source(self) -> str:
        src = self.config.update_ratio
        if src == "auto":
            exact = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.SGD)) and not any(
                (p.grad is not None and p.grad.is_sparse) or p.dtype not in (torch.float32, torch.float64)
                for p in self._params
            )
            src = "optimizer" if exact else "copy"
        return src

    def after_optimizer_step(self) -> None:
        """Update-to-parameter ratio, cos(Δθ, g) and the parameter norm after the step."""
        if "post" in self._done:
            return
        self._done.add("post")
        src = self._update_source() if self._stats else "off"
        deltas: tuple[list[int], list[torch.Tensor]] | None = None
        if src == "copy" and self._prev is not None:
            idx, prev = self._prev
            deltas = (idx, torch._foreach_sub([self._params[i].detach() for i in idx], prev))
            self._prev = None
        elif src == "optimizer" and self.optimizer is not None:
            deltas = reconstruct_update(self.optimizer, self._index_of)
        if not self._stats:
            return
        params = [p.detach() for p in self._params]
        dev = params[0].device if params else torch.device("cpu")
        p_sq = stack(list(torch._foreach_norm(params)), dev).pow(2) if params else None
        if p_sq is not None:
            self._vec["param_norm"] = ([], p_sq.sum().sqrt())
        if not deltas or not deltas[0]:
            return
        idx, d = deltas
        d_sq = stack(list(torch._foreach_norm(d)), dev).pow(2)
        sel = torch.tensor(idx, device=dev)
        self._vec["update_ratio"] = ([], (d_sq.sum() / p_sq[sel].sum().clamp_min(TINY)).sqrt())
        if self.config.per_layer:
            names, dl = self._layer_sums(idx, d_sq)
            _, pl = self._layer_sums(idx, p_sq[sel])
            self._vec["update_ratio/"] = (names, (dl / pl.clamp_min(TINY)).sqrt())
        if self.config.cosines:
            pairs = [(self._params[i].grad, t) for i, t in zip(idx, d) if dense_grad(self._params[i])]
            if pairs:
                g_sq = stack(list(torch._foreach_norm([g for g, _ in pairs])), dev).pow(2)
                dd = stack(list(torch._foreach_norm([t for _, t in pairs])), dev).pow(2)
                dot = total_dot([g for g, _ in pairs], [t for _, t in pairs])
                self._vec["cos/update_grad"] = ([], dot / (g_sq.sum() * dd.sum()).sqrt().clamp_min(TINY))

    def _stable_ranks(self) -> None:
        if not self._sr_params:
            return
        vals = []
        with torch.no_grad():
            for name, p in self._sr_params:
                w = p.detach().float()
                if w.numel() <= _EXACT_SIGMA:  # exact: cheap at this size, every stable_rank_every steps
                    vals.append(w.pow(2).sum() / torch.linalg.matrix_norm(w, ord=2).pow(2).clamp_min(TINY))
                    continue
                v = self._sr_vec.get(name)
                iters = self.config.power_iters
                if v is None:
                    gen = torch.Generator(device="cpu").manual_seed(0)
                    v = torch.randn(w.shape[1], generator=gen, dtype=w.dtype).to(w.device)
                    v = v / v.norm()
                    iters *= 10
                for _ in range(iters):
                    u = w @ v
                    u = u / u.norm().clamp_min(TINY)
                    v = w.t() @ u
                    v = v / v.norm().clamp_min(TINY)
                self._sr_vec[name] = v
                sigma = (w @ v).norm()
                vals.append(w.pow(2).sum() / sigma.pow(2).clamp_min(TINY))
        dev = vals[0].device
        self._vec["stable_rank/"] = ([n for n, _ in self._sr_params], stack(vals, dev))

    # ---------------------------------------------------------------- collect
    def collect(self, step: int, loss: torch.Tensor | float | None = None) -> dict[str, float]:
        """All metrics of this step as ``{name: float}`` (one host sync), written to the sinks."""
        step = int(step)
        if "param_norm" not in self._vec and self._params and self._stats:
            params = [p.detach() for p in self._params]
            self._vec["param_norm"] = (
                [],
                stack(list(torch._foreach_norm(params)), params[0].device).pow(2).sum().sqrt(),
            )
        if step % self.config.stable_rank_every == 0:
            self._stable_ranks()
        keys: list[str] = []
        parts: list[torch.Tensor] = []
        out: dict[str, float] = dict(self._host)
        if loss is not None:
            if isinstance(loss, torch.Tensor):
                keys.append("loss")
                parts.append(loss.detach().float().reshape(1))
            else:
                out["loss"] = float(loss)
        for key, (names, t) in self._vec.items():
            keys.extend(prefixed(key, tuple(names)) if names else [key])
            parts.append(t.reshape(-1))
        for key, t in self._max.items():
            keys.append(key)
            parts.append(t.reshape(1))
        for key, (total, count) in self._mean.items():
            keys.append(key)
            parts.append((total / count).reshape(1))
        if parts:
            dev, f32 = parts[0].device, torch.float32
            values = torch.cat([t if t.dtype == f32 and t.device == dev else t.to(dev, f32) for t in parts]).tolist()
            out.update(zip(keys, values))
        if self.optimizer is not None and self.optimizer.param_groups:
            out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        summarize(out)
        for sink in self.sinks:
            sink.write(step, out)
        self._reset()
        self.begin_step(step + 1)
        return out

    def event(self, record: dict) -> None:
        """A guard event (an ``events.jsonl`` record) for the sinks that count events (their
        ``event(record)``: Prometheus counters, the trackers' event counts)."""
        for sink in self.sinks:
            count = getattr(sink, "event", None)
            if count is not None:
                count(record)

    def restart_step(self) -> None:
        """Drop what this step recorded so far: its update was discarded (a veto, a rollback), or
        its forward and backward run again (a replay) and the next row must be that run's alone."""
        self._reset()

    def _reset(self) -> None:
        self._host: dict[str, float] = {}
        self._vec: dict[str, tuple[list[str], torch.Tensor]] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._mean: dict[str, tuple[torch.Tensor, int]] = {}
        self._done: set[str] = set()
        self._prev = None

    def close(self) -> None:
        """Detach the hooks and close the sinks."""
        self.detach()
        for sink in self.sinks:
            sink.close()
