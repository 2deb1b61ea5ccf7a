"""The ABFT detector: chooses the layers checked each step, registers their hooks, numbers their
calls, and judges the step's recorded checks in one host sync (:meth:`ABFTDetector.check`)."""

from __future__ import annotations

import inspect
import math
import warnings
import weakref

import torch
from torch import nn
from torch.nn.utils import parametrize

from sdcscope.common.graph import in_backward
from sdcscope.common.modules import CONV_TYPES, TRANSPOSED_TYPES, is_matmul, match_modules, weight_in_out
from sdcscope.detect.abft.config import ABFTConfig
from sdcscope.detect.abft.conv import ConvChecks, self_padding
from sdcscope.detect.abft.convcheck import checkable_conv
from sdcscope.detect.abft.linear import LinearChecks
from sdcscope.detect.abft.records import CallContext, CheckRecord, Layer
from sdcscope.detect.abft.sampling import Sampler
from sdcscope.detect.abft.taps import FunctionalTaps, install_tap, owner_module, remove_tap
from sdcscope.detect.checksum import Operand, line_ratios
from sdcscope.detect.events import Event
from sdcscope.detect.rounding import rounding_model


class ABFTDetector(LinearChecks, ConvChecks, FunctionalTaps):
    """Checksum detector for the GEMMs of ``model`` (see :mod:`sdcscope.detect.abft`)."""

    name = "abft"

    def __init__(self, model: nn.Module, config: ABFTConfig | None = None, *, rank: int | None = None) -> None:
        self.config = cfg = config or ABFTConfig()
        self.model = model
        self._cs = torch.float32 if cfg.checksum_dtype == "auto" else getattr(torch, cfg.checksum_dtype)
        self.rank = rank
        eligible = match_modules(
            model,
            cfg.targets,
            option="ABFT targets",
            where=lambda m: (
                ("linear" in cfg.kinds and (isinstance(m, nn.Linear) or weight_in_out(m)))
                or ("matmul" in cfg.kinds and is_matmul(m))
                or ("conv" in cfg.kinds and isinstance(m, CONV_TYPES + TRANSPOSED_TYPES))
            ),
        )
        self.layers: list[Layer] = []
        self.skipped: list[str] = []
        """``nn.Linear`` / ``nn.ConvNd`` subclasses overriding ``forward`` (their output is not
        XWᵀ + b), parametrized ones (the W their forward used cannot be read again) and those
        whose weight is not a real floating-point tensor (complex, quantized: no rounding model)."""
        for name, mod in eligible.items():
            kind = (
                "linear"
                if isinstance(mod, nn.Linear) or weight_in_out(mod)
                else "conv"
                if isinstance(mod, CONV_TYPES + TRANSPOSED_TYPES)
                else "matmul"
            )
            if kind != "matmul" and (
                parametrize.is_parametrized(mod)
                or not (
                    checkable_conv(mod)
                    if kind == "conv"
                    else (
                        weight_in_out(mod)
                        or type(mod).forward is nn.Linear.forward
                        or type(mod).__name__ in cfg.linear_subclasses
                    )
                    and mod.weight.is_floating_point()
                )
            ):
                self.skipped.append(name)
                continue
            self.layers.append(
                Layer(
                    name,
                    mod,
                    kind,
                    names=_operand_names(mod, 2 if kind == "matmul" else 1),
                    w_in_out=weight_in_out(mod),
                )
            )
        self.unreached: set[str] = set()
        """Layers sampled twice without a call ABFT could check while their weight got gradients
        (a weight applied by ``bmm`` or ``einsum`` instead of ``F.linear``): unchecked, and out of
        the sampling rotation."""
        self._reached: set[str] = set()
        self._misses: dict[str, int] = {}
        covered = {
            id(p)
            for x in self.layers + [eligible[n] for n in self.skipped]
            for p in (x.module if isinstance(x, Layer) else x).parameters()
        }
        self.unchecked_params = [
            n
            for n, p in model.named_parameters()
            if id(p) not in covered
            and p.dim() >= 2
            and p.requires_grad
            and p.is_floating_point()
            and not isinstance(owner_module(model, n), (nn.Embedding, nn.EmbeddingBag))
        ]
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
                f"ABFT checks no GEMM of layers it cannot check: {_listed(self.skipped)} "
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

    # ----------------------------------------------------------------- attach
    def attach(self) -> ABFTDetector:
        """Start checking; returns ``self``. Hooks live only on the layers sampled for the
        current step (forward ones last in each module's order): a layer that is not checked
        costs nothing."""
        if self._attached:
            return self
        self._attached = True
        if self._step is None:
            self.begin_step(0)
        else:
            self._sync_hooks()
        return self

    def detach(self) -> None:
        self._attached = False
        self._sync_hooks()
        self._drop_pending()
        self._error = None

    def _sync_hooks(self) -> None:
        """Register the hooks of the chosen layers, remove those of the others."""
        want = self._active if self._attached else frozenset()
        if self._functional:
            (install_tap if want else remove_tap)(self)
        for layer in self.layers:
            if layer.functional is not None:
                self._sync_probe(layer, layer.name in want)
                continue
            if layer.name in want:
                if layer.fwd is None:
                    layer.fwd = layer.module.register_forward_hook(
                        self._fwd_hook(layer), prepend=False, with_kwargs=True
                    )
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
        slow = self_padding(layer.module) if layer.kind == "conv" else not layer.fast or _backward_hooked(layer.module)
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
        """Choose the layers checked on ``step`` (deterministic rotation) and move ABFT's forward
        hook of each back to the end of its module's hook order. Calling it again for the same
        step re-orders the hooks only; calling it for the step :meth:`check` just judged (a replay
        re-executing it) arms that step's layers again, and the rotation goes on as before."""
        step = int(step)
        if self._step != step:
            chosen = self._sampler.choose(step, self.layers, self.unreached)
            self._step = step
            self._active = frozenset(layer.name for layer in chosen)
            self._chosen = chosen
            self._sync_hooks()
        for layer in self._chosen:
            if layer.functional is None:
                _keep_last(layer)
                self._sync_pre_hook(layer)

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

    # ------------------------------------------------------------------ hooks
    def _shielded(self, hook):
        """``hook`` run inside the user's forward or backward pass: an error in it must not crash
        training. The first one is kept, its step's checks are dropped, and :meth:`check` raises
        it (the guard reports it as an ``internal_error`` event, or re-raises in strict mode).
        Under ``torch.compile`` the hook runs eagerly (a graph break) rather than being traced
        into the model's graph: traced, its Python bookkeeping recompiled the model's frames
        past dynamo's limit."""

        def shielded(*args):
            try:
                return hook(*args)
            except Exception as exc:
                if self._error is None:
                    self._error = exc
                return None

        return torch.compiler.disable(shielded, recursive=True)

    def _model(self, cd: torch.dtype, device: torch.device):
        """The rounding model of this step's GEMMs in ``cd`` on ``device`` (torch settings)."""
        got = self._models.get((cd, device))
        if got is None:
            got = self._models[(cd, device)] = rounding_model(cd, device, self._cs)
        return got

    def _pre_hook(self, layer: Layer):
        grads = {"grad_input", "grad_weight"} & set(self.config.gemms)

        def hook(module, args, kwargs):
            if not self._on(layer):
                return None
            ctx = CallContext(call=self._call(layer))
            layer.open_ctx = ctx
            if not (grads and torch.is_grad_enabled()):
                return None
            new, new_kw = list(args), dict(kwargs)
            for pos, key in enumerate(layer.names):
                x = args[pos] if pos < len(args) else kwargs.get(key)
                if not isinstance(x, torch.Tensor) or not x.requires_grad:
                    continue
                gemm = "grad_input" if pos == 0 else "grad_weight"
                if gemm not in grads:
                    continue
                if pos == 0:
                    ctx.x = x
                view = x.view_as(x)
                view.register_hook(self._grad_operand_hook(layer, ctx, pos))
                ctx.need.add(f"op{pos}")
                if pos < len(args):
                    new[pos] = view
                else:
                    new_kw[key] = view
            return tuple(new), new_kw

        return self._shielded(hook)

    def _fwd_hook(self, layer: Layer):
        gemms = set(self.config.gemms)

        def hook(module, args, kwargs, out):
            ctx, layer.open_ctx = layer.open_ctx, None
            layer.hits += 1
            fast = ctx is None and layer.pre is None  # no pre-hook ran: the fast path's call
            if (ctx is None and not fast) or not self._on(layer) or not isinstance(out, torch.Tensor):
                return None
            if fast:
                ctx = CallContext(call=self._call(layer))
            if out.requires_grad and not self._marked and ctx.call[1] is not None:
                self._marked = True  # its gradient tells that this micro-batch's backward ran
                out.register_hook(self._marker)
            ops = [args[i] if i < len(args) else kwargs.get(k) for i, k in enumerate(layer.names)]
            if not all(isinstance(t, torch.Tensor) for t in ops):
                ctx.release()
                return None
            with torch.no_grad():
                if layer.kind == "linear":
                    self._linear_forward(layer, ctx, module, ops[0], out, gemms, fast)
                elif layer.kind == "conv":
                    self._conv_forward(layer, ctx, module, ops[0], out, gemms)
                elif not self._matmul_forward(layer, ctx, *ops, out, gemms):
                    return None
                if ctx.need and out.requires_grad:
                    if "dy" not in ctx.need:
                        out.register_hook(self._dy_hook(ctx))
                else:
                    ctx.release()  # no gradient check will come: drop the operands
            return None

        return self._shielded(hook)

    def _call(self, layer: Layer) -> tuple[int, int | None]:
        """(micro-batch, index) of this forward call of ``layer`` (see the package docstring): the
        first forward after a backward pass begins a new micro-batch; a forward inside the backward
        pass (a checkpoint's recompute) is no new call (index None)."""
        if in_backward():
            return self._micro_batch, None
        if self._backward_ran:
            self._backward_ran = self._marked = False
            self._micro_batch += 1
            for x in self.layers:
                x.calls = 0
        layer.calls += 1
        return self._micro_batch, layer.calls - 1

    def _backward_seen(self, grad=None) -> None:
        self._backward_ran, self._marked = True, False

    def _grad_operand_hook(self, layer: Layer, ctx: CallContext, pos: int):
        """Tensor hook on the view of operand ``pos`` the pre-hook handed the module: its gradient."""

        def hook(grad):
            if layer.kind == "conv":  # a self-padding conv: dX as the module's input receives it
                self._conv_module_dx(layer, ctx, grad)
            else:
                self._operand_grad(layer, ctx, pos, grad)
            return None

        return self._shielded(hook)

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

    def check(self, step: int | None = None) -> list[Event]:
        """Evaluate every check recorded since the last call (one host sync) -> events.

        Call after backward and before ``optimizer.step()``. Arms step + 1 unless
        :meth:`begin_step` is called for it.
        """
        cfg = self.config
        step = self._step if step is None else int(step)
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
            if calibrating and self._checked_steps == cfg.calibration_steps:
                for key, worst in self._cal.items():
                    self._c_eff[key] = min(cfg.c, max(cfg.c_min, cfg.calibration_margin * worst))
            self.checks_run += len(records)
        self._note_reached()
        if cfg.budget is not None:
            self._sampler.update(step, len({r.layer for r in records}), len(self.layers))
        self._drop_pending()
        if step is not None:
            self._sampler.checked(step, self._chosen)
            self.begin_step(step + 1)
        if error is not None:
            raise RuntimeError(f"ABFT hook failed on step {step}; its checks were dropped: {error!r}") from error
        return events

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


def _listed(names: list[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" (and {more} more)" if more > 0 else "")


def _keep_last(layer: Layer) -> None:
    """Move ABFT's forward hook back to the end of the module's hook order, so that a hook
    registered after ``attach()`` (an injector editing the output) still runs before the check.
    Uses the module's ordered hook dict (no public API reorders hooks)."""
    hooks = getattr(layer.module, "_forward_hooks", None)
    hid = layer.fwd.id if layer.fwd is not None else None
    if hooks is None or hid not in hooks or next(reversed(hooks)) == hid:
        return
    hooks.move_to_end(hid)


def _backward_hooked(module: nn.Module) -> bool:
    """Full backward (pre-)hooks on ``module`` or on every module: they may edit dX or dY."""
    g = nn.modules.module
    return bool(
        module._backward_hooks or module._backward_pre_hooks or g._global_backward_hooks or g._global_backward_pre_hooks
    )


def _operand_names(module: nn.Module, n: int) -> tuple[str, ...]:
    """Names of the first ``n`` parameters of ``module.forward`` (operands passed by keyword)."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []
    return tuple(params[:n]) + tuple(f"_{i}" for i in range(len(params), n))
