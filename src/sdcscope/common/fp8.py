"""FP8 linear layers: Y, dX and dW as per-tensor scaled FP8 GEMMs (``torch._scaled_mm``).

:class:`Fp8Linear` is an ``nn.Linear`` whose three GEMMs run in FP8 the way torchao's
``Float8Linear`` runs them with dynamic tensorwise scaling: each operand is scaled by its own
amax (``scale = amax / fp8_max``, the dequantization factor ``torch._scaled_mm`` takes), cast to
``float8_e4m3fn`` (X and W) or to the gradient format (dY: ``float8_e5m2`` by default), and the
product is accumulated and returned in fp32 (no output quantization); the bias is added after the
GEMM. X's and W's fp8 copies are kept for the backward GEMMs, as torchao keeps them.

torchao's ``Float8Linear`` (dynamic tensorwise recipe) gets the same site: while a wrapper is on
one, ``torch._scaled_mm`` is wrapped and the layer's hooks tell its Y, dX and dW calls apart.

Every GEMM goes through the layer's *site*: wrappers registered with :func:`add_fp8_wrapper`
see the GEMM's call (:class:`ScaledGemm`: which GEMM, the fp8 operands in C = A·B order, their
scales) and the result. Rooms register wrappers without knowing of each other: the injector's
(``order`` 0) sit next to the GEMM -- the hardware corrupts an operand, a scale or the result as
the unit reads or writes it --, a detector's (``order`` 1) outside them, so a check reads the
operands as the quantizer produced them and the result as the GEMM produced it. Without a
wrapper the layer trains bitwise as without a site.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The fp8 formats a layer's operands take (:mod:`sdcscope.faults.formats` knows both)."""

OPERANDS = {
    "forward": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}
"""The tensors each GEMM reads as its A and B: Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X."""

_EPS = 1e-12  # amax floor (torchao's): an all-zero tensor gets a finite scale


@dataclass
class ScaledGemm:
    """One FP8 GEMM C = (scale_a·A)·(scale_b·B) of a layer: ``a`` (n, k) and ``b`` (k, m) in fp8,
    ``scale_a``/``scale_b`` 1-element fp32 dequantization factors, ``state``: a dict shared by
    the three GEMMs of one forward call (wrappers keep their per-call data there)."""

    gemm: str
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    state: dict = field(default_factory=dict)

    def replace(self, **changes) -> ScaledGemm:
        return dataclasses.replace(self, **changes)


def quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to fp8 ``dtype`` with a dynamic per-tensor scale: (data, scale), data =
    sat(t / scale) and scale = max(amax(|t|), eps) / fp8_max (fp32, shape (1,))."""
    fmax = torch.finfo(dtype).max
    scale = (t.detach().abs().amax().float().clamp_min(_EPS) / fmax).reshape(1)
    data = (t.detach().float() / scale).clamp(-fmax, fmax).to(dtype)
    return data, scale


def scaled_mm(call: ScaledGemm) -> torch.Tensor:
    """The GEMM itself, accumulated and returned in fp32. On CUDA ``torch._scaled_mm`` wants A
    row-major and B column-major; the CPU kernel takes any layout."""
    a, b = call.a, call.b
    if a.is_cuda:
        a, b = a.contiguous(), b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=call.scale_a, scale_b=call.scale_b, out_dtype=torch.float32)


class _Fp8Matmul(torch.autograd.Function):
    """X·Wᵀ, dY·W and dYᵀ·X as FP8 GEMMs through ``module``'s site (X: (tokens, in))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
        fmt = FP8_DTYPES[module.fp8_format]
        xq, sx = quantize(x, fmt)
        wq, sw = quantize(weight, fmt)
        state: dict = {}
        y = module.run_gemm(ScaledGemm("forward", xq, wq.t(), sx, sw, state))
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.module, ctx.state, ctx.dtypes = module, state, (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xq, wq, sx, sw = ctx.saved_tensors
        module, state = ctx.module, ctx.state
        gq, sg = quantize(dy, FP8_DTYPES[module.grad_format])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = module.run_gemm(ScaledGemm("grad_input", gq, wq, sg, sw, state)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = module.run_gemm(ScaledGemm("grad_weight", gq.t(), xq, sg, sx, state)).to(ctx.dtypes[1])
        return dx, dw, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose Y, dX and dW are FP8 GEMMs (see the module docstring).

    ``fp8_format``: X's and W's format, ``'e4m3'``; ``grad_format``: dY's, ``'e5m2'`` (torchao's
    default recipe) or ``'e4m3'``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        fp8_format: str = "e4m3",
        grad_format: str = "e5m2",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._set_formats(fp8_format, grad_format)

    def _set_formats(self, fp8_format: str, grad_format: str) -> None:
        for name, value in (("fp8_format", fp8_format), ("grad_format", grad_format)):
            if value not in FP8_DTYPES:
                raise ValueError(f"{name}={value!r} is not an fp8 format; allowed: {list(FP8_DTYPES)}")
        self.fp8_format, self.grad_format = fp8_format, grad_format
        self.fp8_wrappers: list[tuple[int, object]] = []

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, fp8_format: str = "e4m3", grad_format: str = "e5m2") -> Fp8Linear:
        """An Fp8Linear holding ``linear``'s own parameters (not copies)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._set_formats(fp8_format, grad_format)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self)
        y = y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def run_gemm(self, call: ScaledGemm) -> torch.Tensor:
        return run_wrappers(self, call, scaled_mm)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_format}, grad={self.grad_format}"


def run_wrappers(module: nn.Module, call: ScaledGemm, gemm, depth: int | None = None) -> torch.Tensor:
    """``module``'s wrappers from the outermost (highest ``order``) in, then ``gemm(call)``."""
    wrappers = module.__dict__.get("fp8_wrappers", ())
    depth = len(wrappers) if depth is None else depth
    if depth == 0:
        return gemm(call)
    return wrappers[depth - 1][1].around(module, call, lambda c: run_wrappers(module, c, gemm, depth - 1))


def is_torchao_float8(module: object) -> bool:
    """torchao's ``Float8Linear`` (known by its class, so torchao need not be imported)."""
    cls = type(module)
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")


def is_fp8_linear(module: object) -> bool:
    """An FP8 layer whose GEMMs have a site: :class:`Fp8Linear` or torchao's ``Float8Linear``."""
    return isinstance(module, Fp8Linear) or is_torchao_float8(module)


def operand_dtype(module: nn.Module, gemm: str, operand: str) -> torch.dtype:
    """The stored dtype of operand ``a``/``b``/``scale_a``/``scale_b`` (or ``output``) of ``gemm``."""
    if operand.startswith("scale") or operand == "output":
        return torch.float32
    role = OPERANDS[gemm][0 if operand == "a" else 1]
    if is_torchao_float8(module):
        c = module.config
        key = {"input": "cast_config_input", "weight": "cast_config_weight", "grad_output": "cast_config_grad_output"}
        return getattr(c, key[role]).target_dtype
    return FP8_DTYPES[module.grad_format if role == "grad_output" else module.fp8_format]


class _Handle:
    def __init__(self, module: Fp8Linear, wrapper: object) -> None:
        self.module, self.wrapper = module, wrapper

    def remove(self) -> None:
        m = self.module
        m.fp8_wrappers = [e for e in m.fp8_wrappers if e[1] is not self.wrapper]
        if not m.fp8_wrappers and is_torchao_float8(m):
            _untap(m)


def add_fp8_wrapper(module: nn.Module, wrapper: object, order: int) -> _Handle:
    """Register ``wrapper`` (``around(module, call, inner) -> result``) on ``module``'s GEMMs
    (an :class:`Fp8Linear`, or torchao's ``Float8Linear``: see :func:`_tap`); the returned
    handle's ``remove()`` takes it off."""
    if is_torchao_float8(module) and not module.__dict__.get("fp8_wrappers"):
        _tap(module)
    module.fp8_wrappers = sorted([*module.__dict__.get("fp8_wrappers", ()), (order, wrapper)], key=lambda e: e[0])
    return _Handle(module, wrapper)


# -- torchao's Float8Linear: its torch._scaled_mm calls, told apart by the layer's hooks ----------
_ACTIVE: list[tuple[nn.Module, list[str], dict]] = []  # (layer, its GEMMs still to come, call state)
_TAPPED: dict[int, tuple] = {}  # id(layer) -> its hook handles
_ORIGINAL: list = []
_NODE = "matmul_with_hp_or_float8_args"  # torchao's autograd Function of Y, dX, dW


def _scaled_mm_tap(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """``torch._scaled_mm`` while a tapped layer runs: its call goes through the layer's wrappers
    (tensorwise scales, no bias or result scale: torchao's default recipe); any other call as is."""
    original = _ORIGINAL[0]
    top = _ACTIVE[-1] if _ACTIVE else None
    if top is None or not top[1] or bias is not None or scale_result is not None or scale_a.numel() != 1:
        return original(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
    module, gemms, state = top
    call = ScaledGemm(gemms.pop(0), a, b, scale_a, scale_b, state)

    def gemm(c: ScaledGemm) -> torch.Tensor:
        return original(c.a, c.b, c.scale_a, c.scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)

    return run_wrappers(module, call, gemm)


def _tap(module: nn.Module) -> None:
    """Hooks that tell which GEMM each ``torch._scaled_mm`` call of a torchao ``Float8Linear`` is:
    its forward (module hooks) makes Y; the backward of its ``matmul_with_hp_or_float8_args``
    node makes dX, then dW (torchao's order). ``torch._scaled_mm`` is wrapped while a layer is tapped."""

    def pre(mod, args):
        _ACTIVE.append((mod, ["forward"], {}))

    def post(mod, args, out):
        _, _, state = _ACTIVE.pop()
        node = _find_node(out.grad_fn if isinstance(out, torch.Tensor) else None)
        if node is not None:

            def enter(grads):
                _ACTIVE.append((mod, ["grad_input", "grad_weight"], state))

            def leave(grad_inputs, grads):
                _ACTIVE.pop()

            node.register_prehook(enter)
            node.register_hook(leave)

    if not _ORIGINAL:
        _ORIGINAL.append(torch._scaled_mm)
        torch._scaled_mm = _scaled_mm_tap
    _TAPPED[id(module)] = (module.register_forward_pre_hook(pre), module.register_forward_hook(post))


def _untap(module: nn.Module) -> None:
    for handle in _TAPPED.pop(id(module), ()):
        handle.remove()
    if not _TAPPED and _ORIGINAL:
        torch._scaled_mm = _ORIGINAL.pop()


def _find_node(fn, depth: int = 4):
    """The ``matmul_with_hp_or_float8_args`` node within ``depth`` steps of ``fn`` (the layer's
    output: a reshape, a bias add), or None."""
    frontier = [fn]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node is None:
                continue
            if node.name().startswith(_NODE):
                return node
            nxt += [f for f, _ in node.next_functions]
        frontier = nxt
    return None


def convert_to_fp8(model: nn.Module, names: str | tuple[str, ...] = "*", **formats) -> list[str]:
    """Replace the ``nn.Linear`` modules of ``model`` whose qualified name matches ``names``
    (shell patterns) by :class:`Fp8Linear` holding the same parameters; returns their names."""
    from fnmatch import fnmatchcase

    patterns = (names,) if isinstance(names, str) else tuple(names)
    done = []
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and any(fnmatchcase(name, p) for p in patterns):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, Fp8Linear.from_linear(mod, **formats))
            done.append(name)
    return done
