"""The ABFT detector: chooses the layers checked each step, registers their hooks, numbers their
calls, and judges the step's recorded checks in one host sync (:meth:`ABFTDetector.check`)."""

from __future__ import annotations

import logging
import math
import warnings
import weakref

import torch
from torch import nn

from sdcscope.common.modules import CONV_TYPES, TRANSPOSED_TYPES, is_matmul
from sdcscope.detect.abft.config import ABFTConfig
from sdcscope.detect.abft.conv import ConvChecks, self_padding
from sdcscope.detect.abft.fp8 import Fp8Checks
from sdcscope.detect.abft.graph import GraphChecks, graph_linear
from sdcscope.detect.abft.hooks import ModuleHooks, backward_hooked, keep_last
from sdcscope.detect.abft.layers import find_layers, listed, unchecked_params
from sdcscope.detect.abft.linear import LinearChecks
from sdcscope.detect.abft.records import CheckRecord, Layer
from sdcscope.detect.abft.sampling import Sampler
from sdcscope.detect.abft.taps import FunctionalTaps, install_tap, owner_module, remove_tap
from sdcscope.detect.abft.tensorparallel import TensorParallelChecks
from sdcscope.detect.attention import SDPACheck
from sdcscope.detect.checksum import Operand, line_ratios
from sdcscope.detect.events import Event
from sdcscope.detect.protocol import CheckView, Registration, register

log = logging.getLogger("sdcscope.detect.abft")


class ABFTDetector(ModuleHooks, LinearChecks, ConvChecks, Fp8Checks, FunctionalTaps, TensorParallelChecks, GraphChecks):
    """Checksum detector for the GEMMs of ``model`` (see :mod:`sdcscope.detect.abft`)."""

    name = "abft"

    def __init__(self, model: nn.Module, config: ABFTConfig | None = None, *, rank: int | None = None) -> None:
        self.config = cfg = config or ABFTConfig()
        self.model = model
        self._cs = torch.float32 if cfg.checksum_dtype == "auto" else getattr(torch, cfg.checksum_dtype)
        self.rank = rank
        self.layers, self.skipped, eligible = find_layers(model, cfg)
        """``skipped``: ``nn.Linear`` / ``nn.ConvNd`` subclasses overriding ``forward`` (their output
        is not XWᵀ + b), parametrized ones (the W their forward used cannot be read again) and those
        whose weight is not a real floating-point tensor (complex, quantized: no rounding model)."""
        self._by_name = {x.name: x for x in self.layers}
        self._tp_unchecked: dict[str, str] = {}  # tensor-parallel layers without a local GEMM, and why
        self.unreached: set[str] = set()
        """Layers sampled twice without a call ABFT could check while their weight got gradients
        (a weight applied by ``bmm`` or ``einsum`` instead of ``F.linear``): unchecked, and out of
        the sampling rotation."""
        self._reached: set[str] = set()
        self._misses: dict[str, int] = {}
        self.unchecked_params = unchecked_params(model, self.layers, [eligible[n] for n in self.skipped])
        """Trainable weights (2-D and up) that no checked or skipped layer holds, embeddings aside:
        those of layers left out by ``targets`` or ``kinds``, and those a module applies in its own
        ``forward`` (an MoE's 3-D expert weights, a router's weight, ``nn.MultiheadAttention``'s
        ``in_proj_weight``). With ``'linear'`` in ``kinds`` and no ``targets``, the latter's
        ``F.linear`` calls are checked as Linears (see :mod:`sdcscope.detect.abft.taps`)."""
        self._functional: dict[int, list[Layer]] = {}  # id(weight) -> its layer(s), one per expert
        if "linear" in cfg.kinds and cfg.targets is None:
            for name in self.unchecked_params:
                owner = owner_module(model, name)
                if not isinstance(owner, nn.RNNBase):  # fused recurrent kernels: no F.linear to see
                    self._add_functional(name, model.get_parameter(name), owner)
        if self.layers and self.skipped:
            warnings.warn(
                f"ABFT checks no GEMM of layers it cannot check: {listed(self.skipped)} "
                "(ABFTDetector.skipped: a subclass overriding forward -- name one computing "
                "x·Wᵀ + b in linear_subclasses --, a parametrization, a non-float weight)",
                stacklevel=2,
            )
        if not self.layers:
            why = (
                f"skipped {', '.join(self.skipped)} (see ABFTDetector.skipped)"
                if self.skipped
                else "submodules are checked, not the model itself: wrap a lone layer, nn.Sequential(layer)"
                if isinstance(model, (nn.Linear, *CONV_TYPES, *TRANSPOSED_TYPES)) or is_matmul(model)
                else "only nn.Linear, convolutions and MatMul-contract modules are covered"
            )
            warnings.warn(
                f"ABFT checks no GEMM of this {type(model).__name__}: it has no checkable submodule of "
                f"kinds {', '.join(cfg.kinds)} (nn.Linear, nn.ConvNd, MatMul-contract modules; {why})",
                stacklevel=2,
            )
        self._attached = False
        self._active: frozenset[str] = frozenset()
        self._chosen: list[Layer] = []
        self._step: int | None = None
        self._records: list[CheckRecord] = []
        self._micro_batch = 0  # micro-batches since the last check (see _call)
        self._backward_ran = False  # a backward pass since this micro-batch's first forward
        self._marked = False  # a tensor hook waits to tell that backward ran
        self._marker = self._shielded(self._backward_seen)
        self._error: Exception | None = None  # raised by a hook this step (see _shielded)
        self._operands: weakref.WeakValueDictionary[tuple, Operand] = weakref.WeakValueDictionary()
        self._models: dict[tuple, object] = {}  # rounding models of this step (torch settings)
        self._consts: dict[tuple, tuple] = {}  # hot path: line constants per (model, sizes)
        self._cs_name = str(self._cs)
        self._cal: dict[tuple[str, str], float] = {}
        self._c_eff: dict[tuple[str, str], float] = {}
        self._checked_steps = 0
        self.checks_run = 0
        self.unjudged = 0
        self.skipped_higher_order = 0
        """Calls whose backward checks were skipped: a create_graph backward ran through them."""
        self.max_ratio: dict[tuple[str, str], float] = {}
        self._sampler = Sampler(cfg, len(self.layers))
        self.sdpa = SDPACheck(
            model, rows=cfg.attention_rows if "sdpa" in cfg.kinds else 0, c=cfg.c, seed=cfg.seed, rank=rank
        )
        """The check of the model's ``F.scaled_dot_product_attention`` calls (:mod:`sdcscope.detect.attention`)."""
        self._sdpa_warned = False
        self._escalation: tuple[int, int] | None = None  # steps (first, last) checked in full
        self.compiled = False
        """A checked layer ran inside a ``torch.compile`` graph: its hooks do nothing there (no
        graph break; GEMMs the graph runs are not checked, see :meth:`check`'s warning) and every
        layer stays hooked from then on, so the graph's guards never change with the sampling."""
        self._compiled_seen = False
        self._announced = False  # the coverage logged (at the first attach)

    # ----------------------------------------------------------------- attach
    def attach(self) -> ABFTDetector:
        """Start checking; returns ``self``. Hooks live only on the layers sampled for the
        current step (forward ones last in each module's order): a layer that is not checked
        costs nothing."""
        if self._attached:
            return self
        if not self._announced:
            self._announced = True
            log.info("%s", self.coverage())
        self._attached = True
        if self.config.graph:
            self._install_graph()
        self.sdpa.attach()
        if self._step is None:
            self.begin_step(0)
        else:
            self._sync_hooks()
        return self

    def detach(self) -> None:
        self._attached = False
        self.sdpa.detach()
        self._remove_graph()
        self._sync_hooks()
        self._drop_pending()
        self._error = None

    def _sync_hooks(self) -> None:
        """Register the hooks of the chosen layers, remove those of the others."""
        want = self._active if self._attached else frozenset()
        if self._functional:
            (install_tap if want else remove_tap)(self)
        for layer in self.layers:
            if layer.graph is not None:  # checked by its graph taps
                continue
            if layer.kind == "fp8":  # a wrapper on its GEMM site, not module hooks
                self._sync_fp8(layer, layer.name in want)
            if layer.functional is not None or layer.kind == "fp8":
                self._sync_probe(layer, layer.name in want)
                continue
            if layer.name in want:
                if layer.fwd is None:
                    layer.fwd = layer.module.register_forward_hook(
                        self._fwd_hook(layer), prepend=False, with_kwargs=True
                    )
                    keep_last(layer)  # before a tensor-parallel plan's output hook
                self._sync_pre_hook(layer)
            else:
                for handle in (layer.fwd, layer.pre):
                    if handle is not None:
                        handle.remove()
                layer.fwd = layer.pre = None
            self._sync_probe(layer, layer.name in want)

    def _sync_pre_hook(self, layer: Layer) -> None:
        """The forward pre-hook (operand views for dX / dA / dB) is needed unless the layer is a
        Linear whose dX is read at its GEMM's autograd node (the fast path): possible when the
        graph has the known shape and no full backward hook (which may edit dX) stands
        between that node and the module's input."""
        slow = self_padding(layer.module) if layer.kind == "conv" else not layer.fast or backward_hooked(layer.module)
        if slow and layer.pre is None:
            layer.pre = layer.module.register_forward_pre_hook(self._pre_hook(layer), prepend=False, with_kwargs=True)
        elif not slow and layer.pre is not None:
            layer.pre.remove()
            layer.pre = None

    def __enter__(self) -> ABFTDetector:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # --------------------------------------------------------------- sampling
    def begin_step(self, step: int) -> None:
        """Choose the layers checked on ``step`` (:class:`~sdcscope.detect.abft.sampling.Sampler`)
        and move ABFT's forward hook of each back to the end of its module's hook order. Calling
        it again for the same step re-orders the hooks only; calling it for the step :meth:`check`
        just judged (a replay re-executing it) arms that step's layers again, and the rotation goes
        on as before."""
        step = int(step)
        if self._step != step:
            chosen = self._sampler.choose(step, self.layers, self.unreached)
            if self.compiled or self._escalated(step):  # every layer (a compiled graph: a fixed hook set)
                chosen = [x for x in self.layers if x.name not in self.unreached] or list(self.layers)
            self._step = step
            self._active = frozenset(layer.name for layer in chosen)
            self.sdpa.enabled = bool(chosen) or not self.layers
            self._chosen = chosen
            self._sync_hooks()
        for layer in self._chosen:
            if layer.functional is None and layer.graph is None and layer.kind != "fp8":
                keep_last(layer)
                self._sync_pre_hook(layer)

    def coverage_bound(self) -> tuple[int, int] | None:
        """(most layers checked on a checked step, steps within which every layer is checked) of
        the fixed rotation (``order: rotation``, no ``budget``): a persistent fault in any checked
        GEMM is found within that many steps, a transient one in its step with probability 1 /
        (that many steps). None where nothing bounds it: ``order: random``, a ``budget``, no
        layers. Layers found :attr:`unreached` leave the rotation without moving the others'."""
        bound = self._sampler.bound()
        return None if bound is None else bound[1:]

    def coverage(self) -> str:
        """:meth:`coverage_bound` in one sentence (logged at attach; ``sdcscope train --guard``
        prints it in its closing lines)."""
        cfg, n = self.config, len(self.layers)
        bound = self._sampler.bound()
        if not n:
            return "ABFT checks no GEMM layer"
        if cfg.graph:
            tapped = sum(graph_linear(x) for x in self.layers)
            rest = f"; {n - tapped} other GEMM layers by hooks, which a compiled graph leaves out" if n > tapped else ""
            return f"ABFT checks every Linear ({tapped}) every step through graph taps{rest}"
        if bound is None and cfg.budget is not None:
            return f"ABFT checks as many of its {n} GEMM layers as a {cfg.budget:.0%} overhead budget allows (no bound)"
        if bound is None:
            return (
                f"ABFT checks each of its {n} GEMM layers with probability {cfg.layer_fraction:g} a step "
                "(random draw: no bound on when a layer is checked)"
            )
        fewest, most, steps = bound
        when = "a step" if cfg.every == 1 else f"every {cfg.every} steps"
        if fewest >= n:
            return f"ABFT checks every GEMM layer ({n}) {'every step' if cfg.every == 1 else when}"
        per = str(most) if fewest == most else f"{fewest}-{most}"
        return f"ABFT checks every GEMM layer within {steps} steps ({per} of {n} {when})"

    def escalate(self, steps: int | None = None) -> None:
        """Full coverage after a finding of any detector: every layer is checked on a replay of
        the last checked step and on the next ``steps`` steps (default
        ``config.escalate_steps``); a sampled plan resumes after them. Call it before the replay
        (the guard does, for a spike or a non-finite; :meth:`check` does for its own mismatches)."""
        n = self.config.escalate_steps if steps is None else int(steps)
        last = self._sampler.last_checked
        start = last[0] if last is not None else (self._step if self._step is not None else 0)
        lo, hi = self._escalation if self._escalation is not None else (start, start)
        self._escalation = (min(lo, start), max(hi, start + n))
        armed, self._step = self._step, None  # re-arm the armed step with every layer
        if armed is not None:
            self.begin_step(armed)

    def _escalated(self, step: int) -> bool:
        e = self._escalation
        return e is not None and e[0] <= step <= e[1]

    @property
    def active_layers(self) -> frozenset[str]:
        return self._active

    @property
    def skipped_grad_weight(self) -> list[str]:
        """Linear and Conv layers whose dW is not checked now (frozen weight: there is no dW)."""
        return [x.name for x in self.layers if x.kind != "matmul" and not x.module.weight.requires_grad]

    def _on(self, layer: Layer) -> bool:
        """A sampled layer's call is checked in training mode, or whenever autograd records it (a
        model trained in eval mode: frozen dropout and batch norm), or with ``include_eval``."""
        return layer.name in self._active and (
            layer.module.training or torch.is_grad_enabled() or self.config.include_eval
        )

    # ------------------------------------------------------------------ check
    def _drop_pending(self) -> None:
        self._operands.clear()
        self._models.clear()
        for layer in self.layers:
            layer.open_ctx = None
            layer.calls = 0
        self._micro_batch, self._backward_ran, self._marked = 0, False, False

    def threshold(self, layer: str, gemm: str) -> float:
        """The c (in model stds) currently applied to (layer, gemm)."""
        return self._c_eff.get((layer, gemm), self.config.c)

    def check(self, step: int | CheckView | None = None) -> list[Event]:
        """Evaluate every check recorded since the last call (one host sync) -> events.

        Call after backward and before ``optimizer.step()``. Arms step + 1 unless
        :meth:`begin_step` is called for it. ``check(view)``: the guard's protocol
        (:mod:`sdcscope.detect.protocol`), of which ABFT reads only the step.
        """
        cfg = self.config
        if isinstance(step, CheckView):
            step = step.step
        step = self._step if step is None else int(step)
        self._graph_records()
        records, self._records = self._records, []
        error, self._error = self._error, None
        if error is not None:  # a check may have been left half-recorded: judge none of this step's
            records = []
        events: list[Event] = []
        if records:
            lines = [ln for r in records for ln in r.check.lines.values()]
            per_line = iter(line_ratios(lines).tolist())  # the sync
            ratios = [max(next(per_line) for _ in r.check.lines) for r in records]
            calibrating = self._checked_steps < cfg.calibration_steps
            self._checked_steps += 1
            for rec, ratio in zip(records, ratios):
                events.extend(self._judge(step, rec, ratio, calibrating))
            if events and step is not None and self.config.escalate_steps:
                self._escalation = (step, step + self.config.escalate_steps)  # the replay and after
            if calibrating and self._checked_steps == cfg.calibration_steps:
                for key, worst in self._cal.items():
                    self._c_eff[key] = min(cfg.c, max(cfg.c_min, cfg.calibration_margin * worst))
            self.checks_run += len(records)
        if self._compiled_seen and not self.compiled:
            self.compiled = True
            hooked = [x.name for x in self.layers if x.graph is None]
            if self.config.graph:
                log.warning(
                    "ABFT: the model runs inside a torch.compile graph: its Linears are checked there, "
                    "but %s (MatMul, convolution, functional layers) keep hooks, which the graph leaves "
                    "out: their GEMMs are not checked in compiled steps",
                    listed(hooked),
                )
            else:
                warnings.warn(
                    "ABFT: the model runs inside a torch.compile graph: its hooks are left out of the "
                    "graph (no graph break) and the GEMMs the graph runs -- forward, dX, dW -- are not "
                    "checked (abft graph: true checks every Linear inside the graph; sdcscope train "
                    "--compile sets it). The non-finite, spike and state checks still cover the "
                    "compiled steps",
                    stacklevel=2,
                )
        if not self.compiled:
            self._note_reached()
        events += self.sdpa.check(step)
        self._warn_sdpa()
        if cfg.budget is not None:
            self._sampler.update(step, len({r.layer for r in records}), len(self.layers))
        self._drop_pending()
        if step is not None:
            self._sampler.checked(step, self._chosen)
            self.begin_step(step + 1)
        if error is not None:
            raise RuntimeError(f"ABFT hook failed on step {step}; its checks were dropped: {error!r}") from error
        return events

    def _warn_sdpa(self) -> None:
        """Once: what of the model's SDPA calls stays unchecked."""
        calls = self.sdpa.calls
        if self._sdpa_warned or not calls:
            return
        self._sdpa_warned = True
        names = listed(sorted(calls))
        if not self.sdpa.rows:
            warnings.warn(
                f"ABFT does not check the fused attention (F.scaled_dot_product_attention) of {names}: "
                "its logits, softmax and ·V products are unchecked (add 'sdpa' to abft kinds, attention_rows > 0)",
                stacklevel=3,
            )
        else:
            log.info("SDPA of %s: %d query rows per call checked; dQ, dK, dV unchecked", names, self.sdpa.rows)

    def _judge(self, step: int, rec: CheckRecord, ratio: float, calibrating: bool) -> list[Event]:
        name, gemm, (micro_batch, call) = rec.layer, rec.gemm, rec.call
        key = (name, gemm)
        c = self.threshold(name, gemm)
        if ratio <= c:  # the common case: nothing more is read from the device
            self.max_ratio[key] = max(self.max_ratio.get(key, 0.0), ratio)
            if calibrating:
                self._cal[key] = max(self._cal.get(key, 0.0), ratio)
            return []
        s = rec.check.locate()  # a failing (or non-finite) check: read its details
        if not s["judged"]:
            self.unjudged += 1
            return []
        ratio = s["ratio"]
        self.max_ratio[key] = max(self.max_ratio.get(key, 0.0), ratio)
        if ratio <= c:
            return []
        row_hit = not math.isnan(s["row_ratio"]) and s["row_ratio"] > c
        col_hit = not math.isnan(s["col_ratio"]) and s["col_ratio"] > c
        row = int(s["row"]) if row_hit else None
        col = int(s["col"]) if col_hit else None
        index = rec.index(int(s["batch"]), row, col)
        side = "row" if (s["row_ratio"] if row_hit else -1) >= (s["col_ratio"] if col_hit else -1) else "col"
        evidence = {
            "ratio": ratio,
            "c": c,
            "residual": s[f"{side}_residual"],
            "threshold": c * s[f"{side}_threshold"],
            "row_residual": s["row_residual"],
            "row_threshold": c * s["row_threshold"],
            "col_residual": s["col_residual"],
            "col_threshold": c * s["col_threshold"],
            "dtype": rec.dtype,
            "inner_dim": int(rec.inner_dim),
            "micro_batch": micro_batch,
            "call": call,
        }
        if rec.operand is not None:
            evidence["operand"] = rec.operand
        if rec.layout == "tile":  # the residual beyond the tile's hard output-rounding bound
            evidence["tile"] = list(rec.dims[:2])
        evidence.update(self._shard_evidence(name, gemm, index))  # tensor parallel: shard and global index
        return [
            Event(
                step,
                self.name,
                "checksum_mismatch",
                module=name,
                gemm=gemm,
                rank=self.rank,
                index=index,
                evidence=evidence,
            )
        ]


register(
    Registration(
        "abft",
        ABFTConfig,
        lambda model, optimizer, config, rank: ABFTDetector(model, config, rank=rank),
        recheck=True,
        drain=True,
    )
)
