"""ABFT: checksum verification of every GEMM of a model, forward and backward, through hooks.

Covered products (production_sdc.md §5, §7 gap 1):

* every ``nn.Linear`` (Y = X Wᵀ + b): ``forward`` Y, ``grad_input`` dX = dY W, ``grad_weight``
  dW = dYᵀ X (the increment this backward added to ``weight.grad``); likewise transformers'
  ``Conv1D`` (GPT-2's projections: Y = X W + b, W stored (in, out)), its dW checked and
  localized as the Linear's (out, in) would be;
* every module following the MatMul contract (``is_matmul = True``, ``forward(a, b) = a @ b``,
  batched; see :func:`sdcscope.observe.is_matmul`): ``forward`` C, ``grad_input`` dA = dC bᵀ
  (operand ``a``), ``grad_weight`` dB = aᵀ dC (operand ``b``);
* every ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` (any stride, dilation, groups,
  padding mode): ``forward`` Y,
  ``grad_input`` dX, ``grad_weight`` dW, each the GEMM of im2col checked without forming it
  (:mod:`sdcscope.detect.convcheck`): per output position (Y), input position (dX) and weight
  column (dW), read at the call's ``ConvolutionBackward0`` node (where the injector's conv faults
  land too); the position is named, the channel summed over is not.

Each check compares column checksums (and, with ``checksums='both'``, row checksums) with the
rounding-error thresholds of :mod:`sdcscope.detect.checksum`; the event names the layer, the GEMM,
the failing column — with both sides, the element (the intersection of the failing row and
column) — and the residuals and thresholds.

Which call of a layer called several times (a shared layer, gradient accumulation): the event's
``evidence["micro_batch"]`` and ``evidence["call"]``, numbered as the injector numbers the
``call`` of its records (:mod:`sdcscope.inject.injector`), so that an event and an injected fault
name the same call: ``call`` is the 0-based index of the layer's forward call within the
micro-batch, in forward order, and the backward products (dX, dW) of forward call i are call i
too, whatever order the backward runs them in. ``micro_batch`` counts the micro-batches since the
last :meth:`ABFTDetector.check` (0-based): the first forward after a backward pass begins the
next one. A forward re-run inside the backward pass (an activation checkpoint's recompute) is no
new call: its checks carry ``call`` None.

Cost
----
On a CPU every check is a few memory passes plus Python dispatch; the statistics of a tensor
read by several GEMMs are computed once (:class:`~sdcscope.detect.checksum.Operand`), all checks
of a step are judged together in one fused pass and one host sync. The column checks of a Linear
computing in the checksum dtype (fp32 on CPU) take a hot path that builds their lines directly,
dY's statistics read once at the GEMM node (the same lines as ``gemm_lines``, less Python per
check: ABFT on every Linear of a d = 64 GPT went from +49 % to +42 % of the step, d = 128 from
+25 % to +20 %). The column side alone costs
about one pass over the result and the gradient operand per check; the row side adds two more
(hence the default ``'column'``). Layers of a tiny model (d = 64) have GEMMs so cheap that these
passes are a large share of them — and the hooks alone (no checksum work) cost +11.5 % of a
d = 64 step and +3.7 % at d = 128 on a 2-core CPU (``benchmarks/bench_guard_overhead.py
--hooks-only``; +16.7 % and +4.8 % before the Linear fast path below): there, sample
(``budget``) rather than check everything, or leave the attention products out
(``kinds=('linear',)``).

How the hooks see the values actually produced
----------------------------------------------
* **forward**: a forward hook registered with ``prepend=False``. Forward hooks run in
  registration order and each may replace the output, so ABFT's hook must run *last* to check the
  output the rest of the model consumes: attach ABFT after any injector; in addition
  :meth:`ABFTDetector.begin_step` moves ABFT's hook back to the end of each sampled module's
  order, so an injector attached later (but before the step starts) is still seen. A hook added
  in the middle of a step, after ``begin_step``, runs after the check.
* **dY and dX of a Linear (fast path)**: one post-hook on the call's GEMM node (``addmm`` /
  ``mm`` behind the reshapes of an N-d input), which receives dY and produces dX (flattened to
  (tokens, in); a bias gradient there is dY's column sums, reused) — no pre-hook, no view. Used
  from a layer's second call on, once its graph has that shape, while no full backward
  (pre-)hook is registered on the module or globally: such a hook may edit dX *after* the node
  (the injector's ``gemm.grad_input`` faults on a Linear edit it at the node, before ABFT's
  post-hook, registered later, reads it), so :meth:`ABFTDetector.begin_step`
  puts the view path below back for that layer. A full backward hook registered in the middle of
  a step, after ``begin_step``, is not seen by that step's dX check.
* **dY** (other calls): a tensor hook on the module's output (fires before its backward runs).
* **dX / dA / dB** (other calls): a forward pre-hook hands the module an identity view of each
  operand and registers a tensor hook on it. The view is consumed only by this module, so its
  gradient is this module's dX — after every full backward hook (a hook's edits included),
  whatever the registration order — and not the sum over the operand's other consumers.
* **dW**: a hook on the call's own autograd node that hands dW to the weight
  (:func:`sdcscope.inject.targets.weight_grad_edge`, where the injector's ``gemm.grad_weight``
  faults land too): the product of this call alone, before autograd sums it with the weight's
  other uses (a tied embedding, an explicit L2 term, another call of the module) and
  accumulates it into ``weight.grad`` — so none of those, nor gradient accumulation, enters the
  check. A fault in that sum or in ``.grad`` itself is not a GEMM's (the ``param_grad`` site).

Idle cost: hooks are registered only on the layers sampled for the current step (re-registered
by :meth:`ABFTDetector.begin_step` when the sample changes), so a step or layer that is not
checked runs no ABFT code at all. Sampling is deterministic: every ``every`` steps,
``layer_fraction`` of the layers in a rotation; with ``budget`` the detector checks at most every
other step and sizes the rotation from the measured wall time of checked and unchecked steps, so
that checking costs about ``budget`` × the step time (call :meth:`ABFTDetector.check` once per
step).

Not covered: the GEMMs inside fused recurrent kernels (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``:
one ATen call per sequence, no per-product result to hook; their faults surface through the
non-finite, spike and state-checksum detectors), products computed outside a module's ``forward``
other than by ``F.linear`` (``F.scaled_dot_product_attention``, ``torch.bmm`` or ``einsum`` on a
weight, a grouped-GEMM kernel: expose them as MatMul-contract modules to check them; a layer whose
weight is used only that way is listed in :attr:`ABFTDetector.unreached` after two sampled steps
that did not call it, and leaves the sampling rotation; see below for ``F.linear``),
``nn.Linear`` subclasses that override ``forward`` (a
LoRA layer's output is not XWᵀ + b; those named in ``ABFTConfig.linear_subclasses``, such as
transformers' ``FalconLinear``, are checked) and parametrized Linears (``spectral_norm``,
``weight_norm``: each read of ``.weight`` runs the parametrization again -- spectral norm's power
iteration advances -- so no hook can read the W the forward used), both listed in
:attr:`ABFTDetector.skipped` and named in a warning at construction, bias
gradients (a reduction, not a GEMM), and
the ``grad_weight`` of parameters that are not leaves of the call's graph (FSDP's flattened
parameters), and the backward products of a call a ``create_graph=True`` backward ran through (a
gradient penalty, a Hessian-vector product: the second backward's terms reach the same nodes; such
calls are counted in :attr:`ABFTDetector.skipped_higher_order`, their forward is still checked).

Weights a module applies itself
-------------------------------
A trainable weight of no hooked layer (:attr:`ABFTDetector.unchecked_params`: the 3-D expert
weights of transformers' MoE layers -- Mixtral, Qwen2-MoE --, a router's weight,
``nn.MultiheadAttention``'s ``in_proj_weight``) is checked where the module applies it with
``F.linear``: while such a layer is sampled, ``torch.nn.functional.linear`` is wrapped, and a call
whose weight is that parameter -- or, for a 3-D one, one expert's slice of it,
``gate_up_proj[e]`` -- gets the Linear checks (forward, dX and dW at the call's own autograd
nodes), named ``<parameter>`` or ``<parameter>[e]``. An expert that got no token on a step is
simply not called. A Linear whose own forward never runs on two sampled steps while its weight
gets gradients (``nn.MultiheadAttention``'s ``out_proj``, applied by the attention with
``F.linear``) is checked the same way from then on. The injector cannot target these products
(no module computes them alone).

Per step::

    abft = ABFTDetector(model, ABFTConfig()).attach()   # after injectors
    for step ...:
        abft.begin_step(step)          # optional: check() arms step + 1 by itself
        loss.backward(); events = abft.check(step)   # one host sync; before optimizer.step()
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from sdcscope._validate import check_bool, check_choice, check_float, check_non_negative, check_positive
from sdcscope.detect.checksum import (SIDES, GemmCheck, Line, Operand, frobenius, gemm_lines, line_coefs,
                                      line_ratios, norm_floor, rounding_model)
from sdcscope.detect.convcheck import (CONV_TYPES, TRANSPOSED_TYPES, Geometry, checkable_conv, conv_model,
                                       conv_node, forward_lines, grad_input_lines, grad_weight_lines)
from sdcscope.detect.events import GEMMS, Event
from sdcscope.inject.targets import in_backward, linear_nodes, weight_grad_edge, weight_in_out
from sdcscope.observe._util import autocast_on, is_matmul, match_modules, no_autocast

CHECKSUMS = ("both", "row", "column")
KINDS = ("linear", "matmul", "conv")
CHECKSUM_DTYPES = ("auto", "float64", "float32")
BUDGET_AIM = 0.75
"""Share of ``budget`` the sampling plan aims at (headroom for timing noise)."""


@dataclass(kw_only=True)
class ABFTConfig:
    targets: tuple[str, ...] | None = None
    """Module-name patterns; ``None`` = every module of ``kinds``."""
    kinds: tuple[str, ...] = KINDS
    """Which products: ``'linear'`` (``nn.Linear``), ``'matmul'`` (MatMul-contract modules),
    ``'conv'`` (``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d``)."""
    gemms: tuple[str, ...] = GEMMS
    checksums: str = "column"
    """``'column'``: 1ᵀC per check (names the column); ``'both'`` adds the row checksums C·1
    (names the element; about 2 more memory passes per check); ``'row'``: C·1 only."""
    c: float = 8.0
    """Threshold in model standard deviations (:mod:`sdcscope.detect.checksum`). Largest clean
    ratio measured on small transformers: ≤ 0.3 (fp32 GEMMs), ≤ 1.9 (bf16 GEMMs), and 3.4 over 200
    bf16 steps of ALBERT, whose one layer runs three times per forward."""
    checksum_dtype: str = "auto"
    """``'auto'`` = float32 (AEGIS: checksums at FP32-accumulator precision). ``'float64'`` makes
    the checksum arithmetic exact and the fp32 threshold ~30× tighter, but is not cheap: on the
    CPU benchmark (4-layer d=128 transformer, every Linear, every step) it raised the overhead
    from 1.30× to 1.89× (conversion copies of every operand)."""
    every: int = 1
    """Check on steps with ``step % every == 0``."""
    layer_fraction: float = 1.0
    """Share of the targeted layers checked on a checked step (deterministic rotation)."""
    budget: float | None = None
    """Target overhead (e.g. 0.02 = 2 % of step time): overrides ``every`` / ``layer_fraction``
    from measured step times (full coverage on step 0, none on step 1, then a rotation)."""
    calibration_steps: int = 0
    """Checked steps whose largest ratio per (layer, gemm) sets a tighter threshold
    ``max(c_min, calibration_margin × max ratio)`` (never above ``c``)."""
    calibration_margin: float = 4.0
    c_min: float = 5.0
    """Floor of a calibrated threshold: the model std is an upper bound, but a short calibration
    sees only part of the tail (a clean bf16 ratio of 0.78 after 20 calibrated steps at 0.15; the
    largest clean ratio measured anywhere is 3.4, see ``c``)."""
    include_eval: bool = False
    """Also check forward passes that autograd does not record in eval mode (evaluation under
    ``torch.no_grad()``). A model trained in eval mode is checked anyway."""
    linear_subclasses: tuple[str, ...] = ("FalconLinear",)
    """Class names of ``nn.Linear`` subclasses whose own ``forward`` still computes x·Wᵀ + b
    (transformers' ``FalconLinear``: ``input @ weight.T + bias``): checked as ``nn.Linear``. Other
    subclasses that override ``forward`` (a LoRA layer adds its own term) are skipped."""

    def __post_init__(self) -> None:
        if self.targets is not None:
            self.targets = _names("targets", self.targets)
            if not self.targets:
                raise ValueError("targets is empty; give module-name patterns, or null for every layer")
        self.gemms = _names("gemms", self.gemms)
        self.kinds = _names("kinds", self.kinds)
        for kind in self.kinds:
            check_choice("kind", kind, KINDS)
        if not self.kinds:
            raise ValueError(f"kinds is empty; allowed: {', '.join(KINDS)}")
        for g in self.gemms:
            check_choice("gemm", g, GEMMS)
        if not self.gemms:
            raise ValueError(f"gemms is empty; allowed: {', '.join(GEMMS)}")
        check_choice("checksums", self.checksums, CHECKSUMS)
        check_choice("checksum_dtype", self.checksum_dtype, CHECKSUM_DTYPES)
        check_float("c", self.c, low=0, low_open=True)
        check_positive("every", self.every)
        check_float("layer_fraction", self.layer_fraction, low=0, high=1, low_open=True)
        if self.budget is not None:
            check_float("budget", self.budget, low=0, high=1, low_open=True)
        check_non_negative("calibration_steps", self.calibration_steps)
        check_float("calibration_margin", self.calibration_margin, low=1.0)
        check_float("c_min", self.c_min, low=0, low_open=True)
        check_bool("include_eval", self.include_eval)
        self.linear_subclasses = _names("linear_subclasses", self.linear_subclasses)


def _names(key: str, value: object) -> tuple[str, ...]:
    """A string or a list of strings, as a tuple."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}={value!r} must be a name or a list of names")
    return tuple(value)


@dataclass(slots=True)
class _Ctx:
    """One call of one sampled module, waiting for its gradients."""

    call: tuple[int, int | None]           # (micro-batch, call index): see the module docstring
    x: torch.Tensor | None = None          # Linear: the input as the caller passed it
    a: Operand | None = None               # X (Linear) / a (MatMul), in the compute dtype
    b: Operand | None = None               # W (Linear) / b (MatMul), in the compute dtype
    a_shape: tuple[int, ...] = ()                          # Linear: X's shape
    full: tuple[tuple[int, ...], ...] = ()                 # MatMul: broadcast operand shapes
    dy: torch.Tensor | None = None
    need: set[str] = field(default_factory=set)
    higher_order: bool = False             # a backward with create_graph ran through this call
    dy_norm: torch.Tensor | None = None    # hot path: ‖dY‖_F, read at the GEMM node for the dW check
    conv: tuple | None = None              # a self-padding conv's dX check, waiting for the module's dX
    _dy_op: Operand | None = None

    def dy_operand(self, cs: torch.dtype) -> Operand:
        """dY (…tokens…, out) in the GEMM's dtype, shared by the dX and dW checks."""
        if self._dy_op is None:
            dy, cd = self.dy, self.b.t.dtype
            self._dy_op = Operand(dy if dy.dtype == cd else dy.to(cd), cs, flat=True, bound=True)
        return self._dy_op

    def done(self, what: str) -> None:
        self.need.discard(what)
        if not self.need:
            self.release()

    def release(self) -> None:
        self.need.clear()
        self.a = self.b = self.dy = self._dy_op = self.x = self.dy_norm = self.conv = None


@dataclass
class _Layer:
    name: str
    module: nn.Module
    kind: str                              # 'linear' | 'matmul'
    names: tuple[str, ...]                 # forward's parameter names of the operands (keywords)
    calls: int = 0                         # forward calls (outside backward) in this micro-batch
    hits: int = 0                          # forward calls the hook saw since the last check (any mode)
    fwd: object = None                     # handle of the forward hook
    pre: object = None                     # handle of the forward pre-hook (slow path only)
    open_ctx: _Ctx | None = None           # created by the pre-hook, completed by the forward hook
    fast: bool | None = None               # Linear: its call's GEMM node is reachable (None: not seen yet)
    probe: object = None                   # handle of the weight hook (until the forward hook fires once)
    grad_seen: bool = False                # the weight got a gradient since the last check
    w_in_out: bool = False                 # weight stored (in, out): transformers' Conv1D, Y = X·W + b
    functional: object = None             # F.linear on a weight a module applies itself: its hook


class ABFTDetector:
    """Checksum detector for the GEMMs of ``model`` (see the module docstring)."""

    name = "abft"

    def __init__(self, model: nn.Module, config: ABFTConfig | None = None, *,
                 rank: int | None = None) -> None:
        self.config = cfg = config or ABFTConfig()
        self.model = model
        self._cs = torch.float32 if cfg.checksum_dtype == "auto" else getattr(torch, cfg.checksum_dtype)
        self.rank = rank
        eligible = match_modules(
            model, cfg.targets, option="ABFT targets",
            where=lambda m: ("linear" in cfg.kinds and (isinstance(m, nn.Linear) or weight_in_out(m)))
            or ("matmul" in cfg.kinds and is_matmul(m))
            or ("conv" in cfg.kinds and isinstance(m, CONV_TYPES + TRANSPOSED_TYPES)))
        self.layers: list[_Layer] = []
        self.skipped: list[str] = []
        """``nn.Linear`` / ``nn.ConvNd`` subclasses overriding ``forward`` (their output is not
        XWᵀ + b), parametrized ones (the W their forward used cannot be read again) and those
        whose weight is not a real floating-point tensor (complex, quantized: no rounding model)."""
        for name, mod in eligible.items():
            kind = "linear" if isinstance(mod, nn.Linear) or weight_in_out(mod) else \
                "conv" if isinstance(mod, CONV_TYPES + TRANSPOSED_TYPES) else "matmul"
            if kind != "matmul" and (parametrize.is_parametrized(mod) or not (
                    checkable_conv(mod) if kind == "conv" else
                    (weight_in_out(mod) or type(mod).forward is nn.Linear.forward
                     or type(mod).__name__ in cfg.linear_subclasses) and mod.weight.is_floating_point())):
                self.skipped.append(name)
                continue
            self.layers.append(_Layer(name, mod, kind, names=_operand_names(mod, 2 if kind == "matmul" else 1),
                                      w_in_out=weight_in_out(mod)))
        self.unreached: set[str] = set()
        """Layers sampled twice without a call ABFT could check while their weight got gradients
        (a weight applied by ``bmm`` or ``einsum`` instead of ``F.linear``): unchecked, and out of
        the sampling rotation."""
        self._reached: set[str] = set()
        self._misses: dict[str, int] = {}
        covered = {id(p) for x in self.layers + [eligible[n] for n in self.skipped]
                   for p in (x.module if isinstance(x, _Layer) else x).parameters()}
        self.unchecked_params = [n for n, p in model.named_parameters() if id(p) not in covered and p.dim() >= 2
                                 and p.requires_grad and p.is_floating_point()
                                 and not isinstance(_owner(model, n), (nn.Embedding, nn.EmbeddingBag))]
        """Trainable weights (2-D and up) that no checked or skipped layer holds, embeddings aside:
        those of layers left out by ``targets`` or ``kinds``, and those a module applies in its own
        ``forward`` (an MoE's 3-D expert weights, a router's weight, ``nn.MultiheadAttention``'s
        ``in_proj_weight``). With ``'linear'`` in ``kinds`` and no ``targets``, the latter's
        ``F.linear`` calls are checked as Linears (see the module docstring)."""
        self._functional: dict[int, list[_Layer]] = {}   # id(weight) -> its layer(s), one per expert
        if "linear" in cfg.kinds and cfg.targets is None:
            for name in self.unchecked_params:
                owner = _owner(model, name)
                if not isinstance(owner, nn.RNNBase):   # fused recurrent kernels: no F.linear to see
                    self._add_functional(name, model.get_parameter(name), owner)
        if self.layers and self.skipped:
            warnings.warn(f"ABFT checks no GEMM of layers it cannot check: {_listed(self.skipped)} "
                          "(ABFTDetector.skipped: a subclass overriding forward -- name one computing "
                          "x·Wᵀ + b in linear_subclasses --, a parametrization, a non-float weight)", stacklevel=2)
        if not self.layers:
            why = f"skipped {', '.join(self.skipped)} (see ABFTDetector.skipped)" if self.skipped else \
                "submodules are checked, not the model itself: wrap a lone layer, nn.Sequential(layer)" \
                if isinstance(model, (nn.Linear, *CONV_TYPES, *TRANSPOSED_TYPES)) or is_matmul(model) else \
                "only nn.Linear, convolutions and MatMul-contract modules are covered"
            warnings.warn(f"ABFT checks no GEMM of this {type(model).__name__}: it has no checkable submodule of "
                          f"kinds {', '.join(cfg.kinds)} (nn.Linear, nn.ConvNd, MatMul-contract modules; {why})", stacklevel=2)
        self._attached = False
        self._active: frozenset[str] = frozenset()
        self._chosen: list[_Layer] = []
        self._step: int | None = None
        self._rot = self._chosen_rot = 0
        self._last_checked: tuple[int, list[_Layer], int] | None = None   # (step, its layers, rotation)
        self._records: list[tuple] = []
        self._micro_batch = 0                    # micro-batches since the last check (see _call)
        self._backward_ran = False               # a backward pass since this micro-batch's first forward
        self._marked = False                     # a tensor hook waits to tell that backward ran
        self._marker = self._shielded(self._backward_seen)
        self._error: Exception | None = None     # raised by a hook this step (see _shielded)
        self._operands: weakref.WeakValueDictionary[tuple, Operand] = weakref.WeakValueDictionary()
        self._models: dict[tuple, object] = {}   # rounding models of this step (torch settings)
        self._consts: dict[tuple, tuple] = {}    # hot path: line constants per (model, sizes)
        self._cs_name = str(self._cs)
        self._cal: dict[tuple[str, str], float] = {}
        self._c_eff: dict[tuple[str, str], float] = {}
        self._checked_steps = 0
        self.checks_run = 0
        self.unjudged = 0
        self.skipped_higher_order = 0
        """Calls whose backward checks were skipped: a create_graph backward ran through them."""
        self.max_ratio: dict[tuple[str, str], float] = {}
        # budget control
        self._last_check: tuple[float, int] | None = None   # (wall time, step) of the last check
        self._plan = (len(self.layers), 2) if cfg.budget is not None else \
            (max(1, math.ceil(cfg.layer_fraction * len(self.layers))), cfg.every)
        self._cost_per_layer: float | None = None
        self._base_step: float | None = None

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

    def _add_functional(self, name: str, weight: nn.Parameter, owner: nn.Module) -> None:
        """Layers for the ``F.linear`` calls a module makes on its own weight ``name``: one for a
        2-D weight (a router), one per leading index of a 3-D one (``experts.gate_up_proj[e]``)."""
        if weight.dim() not in (2, 3):
            return
        names = [name] if weight.dim() == 2 else [f"{name}[{e}]" for e in range(weight.shape[0])]
        layers = [_Layer(n, _Applied(owner, weight), "linear", names=("input",)) for n in names]
        for layer in layers:
            layer.functional = self._fwd_hook(layer)
        self._functional[id(weight)] = layers
        self.layers += layers

    def _applied_by_owner(self, layer: _Layer) -> None:
        """A Linear sampled twice without its forward running while its weight got gradients:
        another module applies its weight with ``F.linear`` (``nn.MultiheadAttention``'s
        ``out_proj``). Its checks move to those calls."""
        for handle in (layer.fwd, layer.pre):
            if handle is not None:
                handle.remove()
        layer.fwd = layer.pre = None
        layer.module = _Applied(layer.module, layer.module.weight)
        layer.functional = self._fwd_hook(layer)
        self._functional[id(layer.module.weight)] = [layer]
        self._misses.pop(layer.name, None)   # two more such steps (no F.linear either): unreached

    def _functional_call(self, x, weight: torch.Tensor, bias, out) -> None:
        """An ``F.linear`` call anywhere: checked as a Linear when ``weight`` is one of the weights
        of :meth:`_add_functional` (or one expert's slice of it) and its layer is sampled."""
        base = weight if weight._base is None else weight._base
        layers = self._functional.get(id(base))
        if not layers:
            return
        if base.dim() == 3:   # one expert: a select along dim 0
            e, r = divmod(weight.storage_offset() - base.storage_offset(), base.stride(0))
            if r or not 0 <= e < len(layers) or weight.shape != base.shape[1:] or weight.stride() != base.stride()[1:]:
                return
            layer = layers[e]
        elif weight is base:
            layer = layers[0]
        else:
            return
        if not (self._attached and isinstance(x, torch.Tensor) and self._on(layer)):
            return
        applied = layer.module
        applied.weight, applied.bias = weight, bias
        try:
            layer.functional(applied, (x,), {}, out)
        finally:
            applied.weight, applied.bias = base, None

    def _sync_hooks(self) -> None:
        """Register the hooks of the chosen layers, remove those of the others."""
        want = self._active if self._attached else frozenset()
        if self._functional:
            (_install_linear_tap if want else _remove_linear_tap)(self)
        for layer in self.layers:
            if layer.functional is not None:
                self._sync_probe(layer, layer.name in want)
                continue
            if layer.name in want:
                if layer.fwd is None:
                    layer.fwd = layer.module.register_forward_hook(self._fwd_hook(layer), prepend=False,
                                                                   with_kwargs=True)
                self._sync_pre_hook(layer)
            else:
                for handle in (layer.fwd, layer.pre):
                    if handle is not None:
                        handle.remove()
                layer.fwd = layer.pre = None
            self._sync_probe(layer, layer.name in want)

    def _sync_probe(self, layer: _Layer, on: bool) -> None:
        """Until its forward hook has fired once, a sampled Linear's weight carries a hook: a step
        whose backward reached the weight without the module's forward (``F.linear`` on it) is
        evidence that the layer is :attr:`unreached`; a step that did not use it (a dropped
        block, an idle expert) is not."""
        w = layer.module.weight if layer.kind != "matmul" else None
        want = on and w is not None and w.requires_grad and layer.name not in self._reached
        if want and layer.probe is None:
            layer.probe = w.register_hook(lambda grad, layer=layer: setattr(layer, "grad_seen", True))
        elif not want and layer.probe is not None:
            layer.probe.remove()
            layer.probe = None

    def _sync_pre_hook(self, layer: _Layer) -> None:
        """The forward pre-hook (operand views for dX / dA / dB) is needed unless the layer is a
        Linear whose dX is read at its GEMM's autograd node (the fast path): possible when the
        graph has the known shape and no full backward hook (which may edit dX) stands
        between that node and the module's input."""
        slow = _self_padding(layer.module) if layer.kind == "conv" else \
            not layer.fast or _backward_hooked(layer.module)
        if slow and layer.pre is None:
            layer.pre = layer.module.register_forward_pre_hook(self._pre_hook(layer), prepend=False,
                                                               with_kwargs=True)
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
            again = self._last_checked
            if again is not None and again[0] == step:
                _, chosen, self._rot = again
            else:
                k, every = self._plan
                pool = [x for x in self.layers if x.name not in self.unreached] or self.layers
                if step % every:
                    chosen = []
                else:
                    n = len(pool)
                    k = min(k, n)
                    chosen = [pool[(self._rot + i) % n] for i in range(k)]
                    self._rot = (self._rot + k) % max(n, 1)
            self._step, self._chosen_rot = step, self._rot
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

    def _on(self, layer: _Layer) -> bool:
        """A sampled layer's call is checked in training mode, or whenever autograd records it (a
        model trained in eval mode: frozen dropout and batch norm), or with ``include_eval``."""
        return layer.name in self._active and (layer.module.training or torch.is_grad_enabled()
                                               or self.config.include_eval)

    # ------------------------------------------------------------------ hooks
    def _shielded(self, hook):
        """``hook`` run inside the user's forward or backward pass: an error in it must not crash
        training. The first one is kept, its step's checks are dropped, and :meth:`check` raises
        it (the guard reports it as an ``internal_error`` event, or re-raises in strict mode).
        Under ``torch.compile`` the hook runs eagerly (a graph break) rather than being traced
        into the model's graph: traced, its Python bookkeeping recompiled the model's frames
        past dynamo's limit (77 s for 6 steps of the tiny GPT with inductor, 14 s so)."""
        def shielded(*args):
            try:
                return hook(*args)
            except Exception as exc:
                if self._error is None:
                    self._error = exc
                return None
        return torch.compiler.disable(shielded, recursive=True)

    def _operand(self, t: torch.Tensor, cd: torch.dtype, *, bound: bool = True) -> Operand:
        """The step's :class:`Operand` of ``t`` as the GEMM consumed it (cast to ``cd``): a tensor
        several GEMMs read (q/k/v's input; X in forward and dW) gets its statistics once."""
        key = (id(t), cd)
        got = self._operands.get(key)
        if got is None:  # alive while a pending check holds it; it holds t, so the id stays unique
            got = self._operands[key] = Operand(t if t.dtype == cd else t.to(cd), self._cs, flat=True,
                                                bound=bound, src=t)
        return got

    def _weight(self, layer: _Layer, cd: torch.dtype) -> Operand:
        """The weight as ``nn.Linear`` holds it, (out, in)."""
        w = layer.module.weight
        return self._operand(w.t() if layer.w_in_out else w, cd, bound=False)

    def _model(self, cd: torch.dtype, device: torch.device):
        """The rounding model of this step's GEMMs in ``cd`` on ``device`` (torch settings)."""
        got = self._models.get((cd, device))
        if got is None:
            got = self._models[(cd, device)] = rounding_model(cd, device, self._cs)
        return got

    def _record(self, layer: _Layer, gemm: str, call: tuple, c_dims: tuple | None, batch_dims: tuple,
                a: Operand, b: Operand, c: torch.Tensor, *, bias=None, operand: str | None = None) -> None:
        cd = a.t.dtype
        which = self.config.checksums
        lines = gemm_lines(a, b, c, model=self._model(cd, c.device), bias=bias, which=which)
        self._records.append((layer.name, gemm, call, c_dims, batch_dims, a.shape[1], str(cd),
                              operand, GemmCheck(lines, SIDES[which])))

    # -- hot path: a Linear's column checks built directly (what gemm_lines builds for them) -------
    def _lean_ok(self, x: torch.Tensor, out: torch.Tensor, module: nn.Module) -> bool:
        """Column checksums of a GEMM whose operands, output and checksums share one fp32/fp64
        dtype (no cast, no output-rounding pass), outside autocast: the common CPU case, checked
        with the least Python per check (the same lines as :func:`gemm_lines`)."""
        cs, bias = self._cs, module.bias
        return (self.config.checksums == "column" and out.dtype == cs and x.dtype == cs
                and module.weight.dtype == cs and (bias is None or bias.dtype == cs) and out.dim() >= 2
                and not autocast_on(out.device))

    def _lean_line(self, layer: _Layer, gemm: str, call: tuple, c_dims: tuple | None, k: int,
                   act, exp, v, scale, s1, counts: tuple[int, int, int, int], device) -> None:
        """Record the column line of a hot-path check; ``counts`` = (checksum length summed, inner
        dim, elements of the s1 norm, elements of each scale norm) fix its constants."""
        model = self._model(self._cs, device)
        key = (model, counts)
        consts = self._consts.get(key)
        if consts is None:
            if len(self._consts) > 4096:
                self._consts.clear()
            consts = self._consts[key] = (*line_coefs(model, counts[0], counts[1]),
                                          norm_floor(counts[2], self._cs), norm_floor(counts[3], self._cs))
        a1, a2, beta, s1_floor, scale_floor = consts
        line = Line(act, exp, scale, s1, v, a1, a2, beta, 1, act.shape[0], s1_floor, scale_floor)
        self._records.append((layer.name, gemm, call, c_dims, (), k, self._cs_name, None,
                              GemmCheck([line], ("col",))))

    def _lean_forward(self, layer: _Layer, call: tuple, a: Operand, w: Operand, out: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
        """Y = X·Wᵀ + b: 1ᵀY vs W·(1ᵀX) + n·b."""
        n, k = a.shape
        s0 = a.stat("s0")
        exp = torch.mv(w.t, s0) if bias is None else torch.addmv(bias, w.t, s0, beta=n)
        act = out.sum(tuple(range(out.dim() - 1)))
        self._lean_line(layer, "forward", call, tuple(out.shape[:-1]), k, act, exp, s0, w.stat("rn"),
                        a.stat("fn"), (n, k, n * k, k), out.device)

    # -- convolutions (:mod:`sdcscope.detect.convcheck`) ---------------------------------------
    def _conv_forward(self, layer: _Layer, ctx: _Ctx, module: nn.Module, x, out: torch.Tensor,
                      gemms: set[str]) -> None:
        """Check Y; hook the call's ``ConvolutionBackward0`` node for dX and dW. The node holds
        the input as the GEMM consumed it (padded by the module, cast under autocast) and the
        convolution's parameters; without one (no grad), the module convolves the checksum."""
        with no_autocast(out.device):
            self._conv_checks(layer, ctx, module, x, out, gemms)
        if not ctx.need:
            ctx.release()   # a conv keeps no operands in the context: its node has them

    def _conv_checks(self, layer: _Layer, ctx: _Ctx, module: nn.Module, x, out: torch.Tensor,
                     gemms: set[str]) -> None:
        call = ctx.call
        transposed = isinstance(module, TRANSPOSED_TYPES)
        # Saved-tensor hooks (non-reentrant activation checkpointing, offloading) would run on the
        # node's saved operands if read here: a checkpoint recomputes its region at once and keeps
        # the result (its memory saving lost); such a call's forward is checked from the module's
        # input, its dX and dW are not (nor can a hook read them in backward: a checkpoint lets each
        # saved tensor be unpacked once, by the node itself).
        hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        found = conv_node(out, module.weight, transposed) if out.requires_grad and not hooked else None
        y = out if out.dim() == module.weight.dim() else out.unsqueeze(0)   # unbatched input
        cd = out.dtype
        model = conv_model(self._model(cd, out.device), out.device)
        if found is not None:
            node, geo = found
            xc, w = node._saved_input, node._saved_weight
        else:
            xc = x.to(cd) if x.dim() == y.dim() else x.to(cd).unsqueeze(0)
            w = module.weight.to(cd)
            geo = Geometry(tuple(module.stride), tuple(module.padding), tuple(module.dilation), module.groups) \
                if transposed else None
        if "forward" in gemms:
            bias = None if module.bias is None else module.bias.to(cd)
            if transposed:     # the forward of a transposed conv is a conv's dX product
                lines = grad_input_lines(xc, w, y, geo, model=model, cs=self._cs, bias=bias)
                k = (w.shape[0] // geo.groups) * math.prod(w.shape[2:])
            else:
                conv = geo.conv if found is not None else (lambda a, b: module._conv_forward(a, b, None))
                lines = forward_lines(xc, w, bias, y, conv, model=model, cs=self._cs)
                k = math.prod(w.shape[1:])
            self._conv_record(layer, "forward", call, lines, "row", (y.shape[0], *y.shape[2:]), k, cd)
        pad = None   # a module padding its input itself: dX is checked where the module's input gets it
        if "op0" in ctx.need:
            pad = _padding_of(module, node) if found is not None else None
            if pad is None:
                ctx.done("op0")
        if found is None or not ({"grad_input", "grad_weight"} & gemms):
            return
        node.register_hook(self._shielded(lambda grad_inputs, grad_outputs: self._conv_backward(
            layer, call, geo, transposed, xc, w, grad_inputs, grad_outputs, gemms,
            None if pad is None else (ctx, pad))))

    def _conv_backward(self, layer: _Layer, call: tuple, geo: Geometry, transposed: bool, xc: torch.Tensor,
                       w: torch.Tensor, grad_inputs, grad_outputs, gemms: set[str], deferred=None) -> None:
        """Post-hook of a convolution's node: dY in, dX and dW out (after any fault an injector's
        earlier hook on the node wrote into them); ``xc``, ``w``: the operands the node saved. A
        transposed convolution's dX is a convolution of dY, its dW a conv's dW, roles swapped.
        ``deferred`` = (context, padding): the dX check waits for the module's own dX (the
        gradient of its unpadded input, :meth:`_grad_operand_hook`), where the injector's faults
        on it land and whose coordinates the event names."""
        dy, dx, dw = grad_outputs[0], grad_inputs[0], grad_inputs[1]
        self._backward_ran = True
        if dy is None:
            return None
        if torch.is_grad_enabled():   # a create_graph backward (see _set_dy): not this call's alone
            self.skipped_higher_order += 1
            return None
        with torch.no_grad(), no_autocast(dy.device):
            model = conv_model(self._model(dy.dtype, dy.device), dy.device)
            if deferred is not None:
                ctx, pad = deferred
                ctx.conv = (dy, w, geo, model, pad, dx.shape[2:])
            elif dx is not None and "grad_input" in gemms:
                if transposed:
                    lines = forward_lines(dy, w, None, dx, geo.conv, model=model, cs=self._cs)
                    k = math.prod(w.shape[1:])
                else:
                    lines = grad_input_lines(dy, w, dx, geo, model=model, cs=self._cs)
                    k = (dy.shape[1] // geo.groups) * math.prod(w.shape[2:])
                self._conv_record(layer, "grad_input", call, lines, "row", (dx.shape[0], *dx.shape[2:]), k, dy.dtype)
            if dw is not None and "grad_weight" in gemms:
                a, b = (dy, xc) if transposed else (xc, dy)   # (the conv's input, its output gradient)
                lines = grad_weight_lines(b, a, dw, geo, model=model, cs=self._cs)
                self._conv_record(layer, "grad_weight", call, lines, "col", tuple(dw.shape[1:]),
                                  b.shape[0] * math.prod(b.shape[2:]), dy.dtype)
        return None

    def _conv_record(self, layer: _Layer, gemm: str, call: tuple, lines: list, side: str,
                     dims: tuple[int, ...], k: int, cd: torch.dtype) -> None:
        """Record a convolution check; its event index: forward / grad_input (n, None, *position)
        — the checksum sums the group's channels —, grad_weight (None, input channel, *tap)."""
        if side == "row":
            index = lambda b, row, col: (row, None) if row is None else \
                (lambda n, *p: (n, None, *p))(*_unravel(row, dims))  # noqa: E731
        else:
            index = lambda b, row, col: (None, None) if col is None else (None, *_unravel(col, dims))  # noqa: E731
        self._records.append((layer.name, gemm, call, index, (), k, str(cd), None, GemmCheck(lines, (side,))))

    def _pre_hook(self, layer: _Layer):
        grads = {"grad_input", "grad_weight"} & set(self.config.gemms)

        def hook(module, args, kwargs):
            if not self._on(layer):
                return None
            ctx = _Ctx(call=self._call(layer))
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

    def _fwd_hook(self, layer: _Layer):
        gemms = set(self.config.gemms)

        def hook(module, args, kwargs, out):
            ctx, layer.open_ctx = layer.open_ctx, None
            layer.hits += 1
            fast = ctx is None and layer.pre is None   # no pre-hook ran: the fast path's call
            if (ctx is None and not fast) or not self._on(layer) or not isinstance(out, torch.Tensor):
                return None
            if fast:
                ctx = _Ctx(call=self._call(layer))
            if out.requires_grad and not self._marked and ctx.call[1] is not None:
                self._marked = True   # its gradient tells that this micro-batch's backward ran
                out.register_hook(self._marker)
            ops = [args[i] if i < len(args) else kwargs.get(k) for i, k in enumerate(layer.names)]
            if not all(isinstance(t, torch.Tensor) for t in ops):
                ctx.release()
                return None
            with torch.no_grad():
                cd = out.dtype
                if layer.kind == "linear":
                    x = ctx.x if ctx.x is not None else ops[0]   # before ABFT's own view
                    a = self._operand(x, cd)
                    b = self._weight(layer, cd)
                    lean = self._lean_ok(x, out, module)
                    if "forward" in gemms:
                        bias = module.bias
                        if lean:
                            self._lean_forward(layer, ctx.call, a, b, out, bias)
                        else:
                            if bias is not None and bias.dtype != cd:
                                bias = bias.to(cd)
                            self._record(layer, "forward", ctx.call, tuple(out.shape[:-1]), (),
                                         a, b.T, out, bias=bias)
                    ctx.a, ctx.b, ctx.a_shape = a, b, tuple(x.shape)
                    want_dw = module.weight.requires_grad and "grad_weight" in gemms
                    nodes = None
                    if out.requires_grad and (want_dw or "grad_input" in gemms) and (fast or layer.fast is None):
                        nodes = linear_nodes(out, module.weight)
                        layer.fast = nodes is not None   # learnt here; the next step's hooks follow
                    lean = lean and fast and nodes is not None   # dY's statistics come from the node
                    if fast:
                        if nodes is not None:   # one hook at the GEMM's node: dY and dX
                            if "grad_input" in gemms and x.requires_grad:
                                ctx.need.add("op0")
                            ctx.need.add("dy")
                            nodes[0].register_hook(self._gemm_node_hook(layer, ctx, nodes[1], lean))
                        # else: an unexpected graph (dX unchecked for this call; the pre-hook returns)
                    edge = None
                    if want_dw and out.requires_grad:
                        edge = nodes[2:] if nodes is not None else weight_grad_edge(out, module.weight)
                    if edge is not None:
                        ctx.need.add("dw")
                        edge[0].register_hook(self._dw_hook(layer, ctx, edge[1], lean))
                elif layer.kind == "conv":
                    self._conv_forward(layer, ctx, module, ops[0], out, gemms)
                else:
                    a, b = ops
                    if a.dim() < 2 or b.dim() < 2:
                        ctx.release()
                        return None
                    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
                    a_e = Operand(_expand(a.to(cd), batch), self._cs)
                    b_e = Operand(_expand(b.to(cd), batch), self._cs)
                    if "forward" in gemms:
                        self._record(layer, "forward", ctx.call, None, tuple(batch),
                                     a_e, b_e, out)
                    ctx.a, ctx.b = a_e, b_e
                    ctx.full = ((*batch, *a.shape[-2:]), (*batch, *b.shape[-2:]))
                if ctx.need and out.requires_grad:
                    if "dy" not in ctx.need:
                        out.register_hook(self._dy_hook(ctx))
                else:
                    ctx.release()  # no gradient check will come: drop the operands
            return None
        return self._shielded(hook)

    def _call(self, layer: _Layer) -> tuple[int, int | None]:
        """(micro-batch, index) of this forward call of ``layer`` (see the module docstring): the
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

    def _dy_hook(self, ctx: _Ctx):
        def hook(grad):
            self._set_dy(ctx, grad)
        return self._shielded(hook)

    def _set_dy(self, ctx: _Ctx, dy: torch.Tensor | None) -> None:
        ctx.dy = dy
        self._backward_ran = True
        if torch.is_grad_enabled() and not ctx.higher_order:
            # A backward with create_graph=True (a gradient penalty, a Hessian-vector product):
            # this call's gradient graph feeds another backward, whose contributions reach the
            # same autograd nodes (dW sums dYᵀX with the penalty's term): no product of this
            # call can be checked alone.
            ctx.higher_order = True
            self.skipped_higher_order += 1

    def _gemm_node_hook(self, layer: _Layer, ctx: _Ctx, xi: int, lean: bool = False):
        """Fast path of a Linear: post-hook of the call's GEMM node, which sees dY (its gradient
        output) and dX (its ``xi``-th gradient input, flattened to (tokens, in)) together."""
        def hook(grad_inputs, grad_outputs):
            self._set_dy(ctx, grad_outputs[0])
            db = grad_inputs[0] if xi == 1 else None
            if lean:
                self._lean_backward(layer, ctx, db, grad_inputs[xi])
                return None
            if db is not None and ctx.dy is not None and ctx.b is not None and db.dtype == self._cs:
                ctx.dy_operand(self._cs).seed("s0", db)   # autograd's bias gradient: dY's column sums
            if "op0" in ctx.need:
                dx = grad_inputs[xi]
                if dx is not None and ctx.dy is not None and ctx.a is not None and not ctx.higher_order:
                    with torch.no_grad():
                        self._record(layer, "grad_input", ctx.call, ctx.a_shape[:-1], (),
                                     ctx.dy_operand(self._cs), ctx.b, dx)
                ctx.done("op0")
            ctx.done("dy")
            return None
        return self._shielded(hook)

    def _lean_backward(self, layer: _Layer, ctx: _Ctx, db, dx) -> None:
        """Hot path at the GEMM node: dY's statistics (1ᵀdY: autograd's bias gradient when there
        is one) for the dX and dW checks; dX = dY·W: 1ᵀdX vs Wᵀ·(1ᵀdY)."""
        dy = ctx.dy
        if dy is not None and ctx.b is not None and not ctx.higher_order:
            with torch.no_grad(), no_autocast(dy.device):
                s0 = db if db is not None and db.dtype == dy.dtype else dy.sum(0)
                fn = ctx.dy_norm = frobenius(dy)
                if "op0" in ctx.need and dx is not None:
                    n, m = dy.shape
                    w = ctx.b
                    self._lean_line(layer, "grad_input", ctx.call, ctx.a_shape[:-1], m, dx.sum(0),
                                    torch.mv(w.t.t(), s0), s0, w.stat("cn"), fn, (n, m, n * m, m), dx.device)
        ctx.done("op0")
        ctx.done("dy")

    def _grad_operand_hook(self, layer: _Layer, ctx: _Ctx, pos: int):
        def hook(grad):
            if layer.kind == "conv":   # a self-padding conv: dX as the module's input receives it
                if ctx.conv is not None:
                    dy, w, geo, model, pad, padded = ctx.conv
                    with torch.no_grad(), no_autocast(grad.device):
                        g = grad if grad.dim() == w.dim() else grad.unsqueeze(0)
                        lines = grad_input_lines(dy, w, g, geo, model=model, cs=self._cs, pad=(padded, pad))
                        self._conv_record(layer, "grad_input", ctx.call, lines, "row", (g.shape[0], *g.shape[2:]),
                                          (dy.shape[1] // geo.groups) * math.prod(w.shape[2:]), dy.dtype)
                ctx.done("op0")
                return None
            if ctx.dy is None or ctx.a is None or ctx.higher_order:
                ctx.done(f"op{pos}")
                return None
            with torch.no_grad():
                dy = ctx.dy
                if layer.kind == "linear":   # dX = dY · W
                    self._record(layer, "grad_input", ctx.call, ctx.a_shape[:-1], (),
                                 ctx.dy_operand(self._cs), ctx.b, grad)
                else:
                    full = ctx.full[pos]
                    if tuple(grad.shape) == full:  # operand was not broadcast
                        batch = full[:-2]
                        dc = Operand(dy.to(ctx.a.t.dtype), self._cs)
                        if pos == 0:   # dA = dC · bᵀ
                            self._record(layer, "grad_input", ctx.call, None, batch,
                                         dc, ctx.b.T, grad, operand="a")
                        else:          # dB = aᵀ · dC
                            self._record(layer, "grad_weight", ctx.call, None, batch,
                                         ctx.a.T, dc, grad, operand="b")
            ctx.done(f"op{pos}")
            return None
        return self._shielded(hook)

    def _dw_hook(self, layer: _Layer, ctx: _Ctx, index: int, lean: bool = False):
        """Post-hook of the call's node handing dW to the weight: dW = dYᵀ · X of this call."""
        def hook(grad_inputs, grad_outputs):
            g = grad_inputs[index]
            if g is not None and layer.w_in_out:
                g = g.t()   # dW as nn.Linear's, (out, in)
            if g is not None and ctx.dy is not None and ctx.a is not None and not ctx.higher_order:
                with torch.no_grad(), no_autocast(g.device):
                    if lean:   # hot path: 1ᵀdW vs (dY·1)ᵀ·X (X's column norms bounded by ‖X‖_F)
                        dy, fn, a = ctx.dy, ctx.dy_norm, ctx.a   # dy_norm: set with ctx.dy at the node
                        n, m = dy.shape
                        r = dy.sum(1)
                        self._lean_line(layer, "grad_weight", ctx.call, None, n, g.sum(0),
                                        torch.mv(a.stat("xt"), r), r, a.stat("cn"), fn,
                                        (m, n, n * m, n * g.shape[1]), g.device)
                    else:
                        self._record(layer, "grad_weight", ctx.call, None, (),
                                     ctx.dy_operand(self._cs).T, ctx.a, g)
            ctx.done("dw")
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
        if error is not None:   # a check may have been left half-recorded: judge none of this step's
            records = []
        events: list[Event] = []
        if records:
            lines = [ln for r in records for ln in r[-1].lines.values()]
            per_line = iter(line_ratios(lines).tolist())  # the sync
            ratios = [max(next(per_line) for _ in r[-1].lines) for r in records]
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
            self._update_plan(step, n_checked=len({r[0] for r in records}))
        self._drop_pending()
        if step is not None:
            self._last_checked = (step, self._chosen, self._chosen_rot)
            self.begin_step(step + 1)
        if error is not None:
            raise RuntimeError(f"ABFT hook failed on step {step}; its checks were dropped: {error!r}") from error
        return events

    def _note_reached(self) -> None:
        """A sampled layer whose forward hook never fired, on two checked steps whose backward
        reached its weight (see :meth:`_sync_probe`; a layer without that probe -- a MatMul, a
        frozen weight -- on any two checked steps), is :attr:`unreached` (warned once)."""
        new = []
        applied = {id(x.module.weight) for x in self._chosen if x.functional is not None and x.hits}
        for x in self._chosen:
            if x.hits:
                self._reached.add(x.name)
            elif x.functional is not None and id(x.module.weight) in applied:
                pass   # another expert of the same weight was called: this one got no token
            elif x.name not in self._reached and (x.grad_seen or x.probe is None):
                self._misses[x.name] = self._misses.get(x.name, 0) + 1
                if self._misses[x.name] == 2 and x.kind == "linear" and x.functional is None and not x.w_in_out:
                    self._applied_by_owner(x)   # its weight's F.linear calls are checked from now on
                elif self._misses[x.name] == 2:
                    new.append(x.name)
            x.hits, x.grad_seen = 0, False
        if new:
            self.unreached.update(new)
            warnings.warn(f"ABFT: {', '.join(new)} sampled but never called through their own forward (e.g. "
                          "nn.MultiheadAttention's out_proj, which the attention applies with F.linear), or, "
                          "for a weight a module applies itself, never by F.linear (bmm, einsum, a grouped "
                          "GEMM kernel: transformers' MoE layers apply their experts with F.linear under "
                          "experts_implementation='eager'): their GEMMs are not checked, and they leave the "
                          "sampling rotation",
                          stacklevel=3)

    def _judge(self, step: int, rec: tuple, ratio: float, calibrating: bool) -> list[Event]:
        name, gemm, (micro_batch, call), c_dims, batch_dims, k, dtype, operand, chk = rec
        key = (name, gemm)
        c = self.threshold(name, gemm)
        if ratio <= c:  # the common case: nothing more is read from the device
            self.max_ratio[key] = max(self.max_ratio.get(key, 0.0), ratio)
            if calibrating:
                self._cal[key] = max(self._cal.get(key, 0.0), ratio)
            return []
        s = chk.locate()  # a failing (or non-finite) check: read its details
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
        batch = _unravel(int(s["batch"]), batch_dims) if batch_dims else ()
        if callable(c_dims):    # a convolution's own layout
            index = c_dims(int(s["batch"]), row, col)
        elif c_dims is not None:  # rows of a flattened (…, n) result (none: a 1-D one)
            lead = _unravel(row, c_dims) if row is not None else (None,) * len(c_dims)
            index = (*lead, col)
        else:
            index = (*batch, row, col)
        side = "row" if (s["row_ratio"] if row_hit else -1) >= (s["col_ratio"] if col_hit else -1) \
            else "col"
        evidence = {
            "ratio": ratio, "c": c, "residual": s[f"{side}_residual"],
            "threshold": c * s[f"{side}_threshold"],
            "row_residual": s["row_residual"], "row_threshold": c * s["row_threshold"],
            "col_residual": s["col_residual"], "col_threshold": c * s["col_threshold"],
            "dtype": dtype, "inner_dim": int(k), "micro_batch": micro_batch, "call": call,
        }
        if operand is not None:
            evidence["operand"] = operand
        return [Event(step, self.name, "checksum_mismatch", module=name, gemm=gemm,
                      rank=self.rank, index=index, evidence=evidence)]

    def _update_plan(self, step: int | None, n_checked: int) -> None:
        """Budget mode: size the rotation from measured step times. Checked and unchecked steps
        alternate (the plan checks at most every other step), so the wall time of an unchecked
        step is the baseline and a checked step's excess over it, per layer, is the whole cost
        of checking — hooks, autograd nodes, memory traffic, the judgement — not just the part a
        timer around the hooks would see. Layers per checked step = 2·AIM·budget·base/cost: the
        plan aims below the budget (:data:`BUDGET_AIM`), since step times are noisy estimates and
        unchecked steps carry a small fixed cost the measurement cannot separate."""
        now = time.perf_counter()
        last, self._last_check = self._last_check, (now, step)
        if last is None or step is None or last[1] is None or step <= last[1]:
            return
        dt = (now - last[0]) / (step - last[1])
        ema = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
        if n_checked == 0:
            self._base_step = ema(self._base_step, dt)
        elif self._base_step is not None:
            self._cost_per_layer = ema(self._cost_per_layer,
                                       max(dt - self._base_step, 0.0) / n_checked)
        if self._base_step is None or self._cost_per_layer is None:
            return
        per_step = BUDGET_AIM * self.config.budget * self._base_step / max(self._cost_per_layer, 1e-12)
        n = len(self.layers)
        self._plan = (min(n, max(1, int(2 * per_step))), 2) if 2 * per_step >= 1 else \
            (1, min(10_000, math.ceil(1 / per_step)))


class _Applied:
    """What ABFT's Linear hook reads of a module (``weight``, ``bias``, ``training``) for an
    ``F.linear`` call a module makes on its own weight: the call's weight and bias, set per call."""

    def __init__(self, owner: nn.Module, weight: nn.Parameter) -> None:
        self.owner, self.weight, self.bias = owner, weight, None

    @property
    def training(self) -> bool:
        return self.owner.training


_linear_taps: weakref.WeakSet[ABFTDetector] = weakref.WeakSet()   # a dropped detector leaves by itself
_linear_original: list = []


def _linear(input, weight, bias=None):
    out = _linear_original[0](input, weight, bias)
    if _linear_taps and not torch.compiler.is_compiling():
        for det in list(_linear_taps):
            det._functional_call(input, weight, bias, out)
    return out


def _install_linear_tap(det: ABFTDetector) -> None:
    """``torch.nn.functional.linear`` wrapped while a detector with functional layers is armed
    (``nn.Linear`` calls it too: they then pay one Python call and a dict lookup)."""
    if not _linear_original:
        _linear_original[:] = [torch.nn.functional.linear]
        torch.nn.functional.linear = _linear
    _linear_taps.add(det)


def _remove_linear_tap(det: ABFTDetector) -> None:
    _linear_taps.discard(det)
    if not _linear_taps and _linear_original:
        torch.nn.functional.linear = _linear_original.pop()


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _listed(names: list[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" (and {more} more)" if more > 0 else "")


def _self_padding(module: nn.Module) -> bool:
    """A convolution that pads its input itself before the GEMM (``padding_mode`` other than
    ``'zeros'``; ``padding='same'``, asymmetric for an even kernel): its GEMM's dX is the padded
    input's gradient, not the module's."""
    return getattr(module, "padding_mode", "zeros") != "zeros" or getattr(module, "padding", None) == "same"


def _padding_of(module: nn.Module, node):
    """The module's own padding of its input as a function of a g-channel proxy, or ``None``
    when this call's GEMM consumed the input unpadded (an odd kernel's symmetric ``'same'``)."""
    if module.padding_mode != "zeros":
        pads, mode = module._reversed_padding_repeated_twice, module.padding_mode
    else:
        pad_node = node.next_functions[0][0]
        if type(pad_node).__name__ != "ConstantPadNdBackward0":
            return None
        pads, mode = tuple(pad_node._saved_pad), "constant"
    return lambda z: torch.nn.functional.pad(z, pads, mode=mode)


def _keep_last(layer: _Layer) -> None:
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
    return bool(module._backward_hooks or module._backward_pre_hooks
                or g._global_backward_hooks or g._global_backward_pre_hooks)


def _operand_names(module: nn.Module, n: int) -> tuple[str, ...]:
    """Names of the first ``n`` parameters of ``module.forward`` (operands passed by keyword)."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []
    return tuple(params[:n]) + tuple(f"_{i}" for i in range(len(params), n))


def _expand(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    return t if tuple(t.shape[:-2]) == tuple(batch) else t.expand(*batch, *t.shape[-2:])


def _unravel(flat: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(flat % d)
        flat //= d
    return tuple(reversed(out))
