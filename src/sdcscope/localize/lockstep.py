"""Lock-step comparison of a suspect execution with a reference, submodule by submodule.

The reference runs first with hooks that record, for every submodule, its forward output(s)
and, in the backward pass, its gradient w.r.t. its inputs; then the suspect runs with hooks
that compare each value, in execution order, with the recorded one. Parameter gradients are
compared after the suspect's backward (a gradient is final only then).

With ``sync=True`` (Ma et al.'s computation synchronization) every suspect value is overwritten
with the reference value after its comparison -- the next submodule computes from healthy
inputs, so each mismatch belongs to the submodule that produced it (level (a) of the three-level
analysis: mismatch frequency and severity per submodule). Without it, the first divergent
event is where the corruption entered and everything after it inherits it.

Event order: forward events in execution order, then backward events in execution order, then
parameter gradients in parameter order.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from sdcscope.inject import is_gemm
from sdcscope.localize.compare import TensorDiff, diff

__all__ = ["Divergence", "Mismatch", "LockstepReport", "lockstep", "first_divergence", "replica"]

DIRECTIONS = ("forward", "backward")


@dataclass
class Mismatch:
    """One compared value: a submodule output (forward), a gradient w.r.t. a submodule input or
    a parameter gradient (backward). ``gemm`` names the GEMM product for GEMM modules:
    ``forward`` (Y), ``grad_input`` (dX; for ``a @ b`` modules: d a) or ``grad_weight`` (dW; d b)."""

    order: int
    module: str
    direction: str
    gemm: str | None
    tensor: str
    call: int
    numel: int
    count: int
    frequency: float
    severity: float
    magnitude: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Divergence:
    """The first divergent value: where, which elements (multi-indices, largest difference
    first), how many and how large."""

    module: str
    direction: str
    gemm: str | None
    tensor: str
    call: int
    order: int
    index: list[list[int]]
    count: int
    numel: int
    magnitude: float
    relative: float
    reference: float | None
    suspect: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LockstepReport:
    events: list[Mismatch] = field(default_factory=list)
    first: Divergence | None = None

    @property
    def mismatched(self) -> list[Mismatch]:
        return [e for e in self.events if e.count]

    def by_module(self) -> dict[str, dict[str, dict[str, float]]]:
        """module -> direction -> {frequency, severity, magnitude} (maxima over its events)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for e in self.mismatched:
            d = out.setdefault(e.module, {}).setdefault(
                e.direction, {"frequency": 0.0, "severity": 0.0, "magnitude": 0.0}
            )
            for k in d:
                d[k] = max(d[k], getattr(e, k))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "first": None if self.first is None else self.first.to_dict(),
            "mismatched": [e.to_dict() for e in self.mismatched],
            "events": len(self.events),
        }


class _Overwrite(torch.autograd.Function):
    """Forward: the reference value, bit for bit; backward: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, suspect, reference):  # noqa: D401
        return reference.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gemm(module: nn.Module, direction: str, position: int) -> str | None:
    if not is_gemm(module):
        return None
    if direction == "forward":
        return "forward"
    return "grad_weight" if position == 1 and getattr(module, "is_matmul", False) else "grad_input"


def _tensors(value: Any) -> list[tuple[int, torch.Tensor]]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [(i, t) for i, t in enumerate(items) if isinstance(t, torch.Tensor)]


def _label(kind: str, value: Any, i: int) -> str:
    return f"{kind}[{i}]" if isinstance(value, (tuple, list)) else kind


class _Session:
    """Hooks on one model for one pass: record values, or compare them with recorded ones."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        record: dict | None,
        compare: dict | None,
        report: LockstepReport | None,
        sync: bool,
        atol: float,
        rtol: float,
        limit: int,
    ) -> None:
        self.record, self.compare, self.report = record, compare, report
        self.sync, self.atol, self.rtol, self.limit = sync, atol, rtol, limit
        self.calls: dict[tuple[str, str], int] = {}
        modules = dict(model.named_modules())
        self.handles = []
        for name in names:
            m = modules[name]
            self.handles.append(m.register_forward_hook(self._forward(name)))
            self.handles.append(m.register_full_backward_hook(self._backward(name)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _call(self, name: str, direction: str) -> int:
        n = self.calls.get((name, direction), 0)
        self.calls[(name, direction)] = n + 1
        return n

    def visit(
        self, key: tuple, module: nn.Module | None, name: str, direction: str, gemm: str | None, value: torch.Tensor
    ) -> torch.Tensor | None:
        """Record or compare one value; returns the reference value when it should replace it."""
        if self.record is not None:
            self.record[key] = value.detach().clone()
            return None
        ref = self.compare.get(key)
        d: TensorDiff = (
            diff(value, ref, atol=self.atol, rtol=self.rtol, limit=self.limit)
            if ref is not None
            else TensorDiff(value.numel(), value.numel(), 0.0, 0.0, 0.0, [], None, None)
        )
        order = len(self.report.events)
        _, _, tensor, call = key
        self.report.events.append(
            Mismatch(order, name, direction, gemm, tensor, call, d.numel, d.count, d.frequency, d.severity, d.magnitude)
        )
        if d.count and self.report.first is None:
            self.report.first = Divergence(
                name,
                direction,
                gemm,
                tensor,
                call,
                order,
                d.index,
                d.count,
                d.numel,
                d.magnitude,
                d.relative,
                d.reference,
                d.suspect,
            )
        if d.count and self.sync and ref is not None:
            return ref.to(value.dtype, copy=True)
        return None

    def _forward(self, name: str):
        def hook(module, args, output):
            call = self._call(name, "forward")
            changed, items = False, list(output) if isinstance(output, (tuple, list)) else [output]
            for i, t in _tensors(output):
                key = ("forward", name, _label("output", output, i), call)
                ref = self.visit(key, module, name, "forward", _gemm(module, "forward", i), t)
                if ref is not None:
                    items[i] = _Overwrite.apply(t, ref) if t.requires_grad else ref
                    changed = True
            if not changed:
                return None
            return type(output)(items) if isinstance(output, (tuple, list)) else items[0]

        return hook

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            call = self._call(name, "backward")
            changed, items = False, list(grad_input)
            for i, g in _tensors(grad_input):
                key = ("backward", name, f"grad_input[{i}]", call)
                ref = self.visit(key, module, name, "backward", _gemm(module, "backward", i), g)
                if ref is not None:
                    items[i], changed = ref, True
            return tuple(items) if changed else None

        return hook


def _param_owners(model: nn.Module) -> dict[int, tuple[str, str, str | None]]:
    """id(param) -> (its first name, the module to name, gemm) -- a tied parameter is named by
    the GEMM module that uses it as weight when there is one."""
    modules = dict(model.named_modules())
    owners: dict[int, tuple[str, str, str | None]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        mname, _, leaf = pname.rpartition(".")
        gemm_weight = leaf == "weight" and is_gemm(modules[mname])
        if id(p) not in owners or (gemm_weight and owners[id(p)][2] is None):
            first = owners[id(p)][0] if id(p) in owners else pname
            owners[id(p)] = (first, mname, "grad_weight" if gemm_weight else None)
    return owners


def _run(fn: Callable[[], Any], models: list[nn.Module], rng: torch.Tensor) -> None:
    for m in models:
        for p in m.parameters():
            p.grad = None
    torch.set_rng_state(rng)
    with warnings.catch_warnings():  # embeddings: no input needs a gradient, the hook still fires
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        fn()


def lockstep(
    reference_fn: Callable[[], Any],
    suspect_fn: Callable[[], Any],
    reference_model: nn.Module,
    suspect_model: nn.Module | None = None,
    *,
    sync: bool = True,
    atol: float = 0.0,
    rtol: float = 0.0,
    modules: Sequence[str] | None = None,
    max_indices: int = 8,
) -> LockstepReport:
    """Run ``reference_fn`` then ``suspect_fn`` (each one forward + backward, e.g.
    ``lambda: loss_fn(model, batch).backward()``) and compare them submodule by submodule.

    ``reference_model``/``suspect_model``: the models the two functions run (the same object by
    default: the suspect differs by, e.g., an armed fault injector; or a :func:`replica` in higher
    precision as reference, then give ``atol``/``rtol``). Submodules are matched by qualified name;
    ``modules`` restricts them to shell patterns. Both functions start from the same global RNG
    state. Afterwards ``.grad`` of both models and the RNG state are as they were before the call;
    parameters are not touched by this function (a function that corrupts them must undo that).
    """
    suspect_model = reference_model if suspect_model is None else suspect_model
    names = [
        n
        for n, _ in reference_model.named_modules()
        if n and (modules is None or any(fnmatchcase(n, p) for p in modules))
    ]
    missing = [n for n in names if n not in dict(suspect_model.named_modules())]
    if missing:
        raise ValueError(f"suspect model lacks submodules of the reference: {missing[:5]}")
    models = [reference_model] if suspect_model is reference_model else [reference_model, suspect_model]
    saved_grads = [(p, p.grad) for m in models for p in m.parameters()]
    rng = torch.get_rng_state()
    recorded: dict[tuple, torch.Tensor] = {}
    report = LockstepReport()
    try:
        session = _Session(reference_model, names, recorded, None, None, sync, atol, rtol, max_indices)
        try:
            _run(reference_fn, models, rng)
        finally:
            session.close()
        ref_owners = _param_owners(reference_model)
        ref_grads = {
            ref_owners[id(p)][0]: (None if p.grad is None else p.grad.detach().clone())
            for p in reference_model.parameters()
        }
        session = _Session(suspect_model, names, None, recorded, report, sync, atol, rtol, max_indices)
        try:
            _run(suspect_fn, models, rng)
        finally:
            session.close()
        owners = _param_owners(suspect_model)
        for p in suspect_model.parameters():
            pname, mname, gemm = owners[id(p)]
            ref = ref_grads.get(pname)
            if p.grad is None and ref is None:
                continue
            key = ("backward", mname, f"grad:{pname}", 0)
            value = p.grad if p.grad is not None else torch.zeros_like(p)
            session.compare = {key: ref if ref is not None else torch.zeros_like(p)}
            session.visit(key, None, mname, "backward", gemm, value)
    finally:
        for p, g in saved_grads:
            p.grad = g
        torch.set_rng_state(rng)
    return report


def first_divergence(
    reference_fn: Callable[[], Any],
    suspect_fn: Callable[[], Any],
    reference_model: nn.Module,
    suspect_model: nn.Module | None = None,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    modules: Sequence[str] | None = None,
) -> Divergence | None:
    """Where the suspect execution first departs from the reference: the submodule, direction
    (``forward``/``backward``), GEMM product, element indices and magnitude; ``None`` when every
    compared value matches. Same arguments as :func:`lockstep` (without synchronization: the first
    divergence is where the corruption entered)."""
    return lockstep(
        reference_fn, suspect_fn, reference_model, suspect_model, sync=False, atol=atol, rtol=rtol, modules=modules
    ).first


def replica(model: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A hook-free copy of ``model`` in ``dtype`` (e.g. the float64 recomputation reference)."""
    copy_ = copy.deepcopy(model)
    for m in copy_.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            hooks.clear()
    for p in copy_.parameters():
        p.grad = None
    return copy_.to(dtype)
