"""Graph mode: faults on the GEMM sites of a ``torch.compile``d model, with no graph break and
no recompile per step (:class:`~sdcscope.inject.Injector` with ``graph=True``).

Hooks split a compiled graph; instead the injector puts a wrapper next to the GEMM of each
targeted ``nn.Linear`` or MatMul-contract module (:mod:`sdcscope.common.gemmsite`, ``order`` 0:
inside any detector's wrapper). The wrapper applies a *descriptor* -- an int64 tensor of rows
``[flat_index, and, or, xor]`` -- to Y (``gemm.forward``) or, in backward, to the operand's
gradient (``gemm.grad_input``: dX, d a; ``gemm.grad_weight``: dW, d b):
``bits = ((bits & and) | or) ^ xor`` on the integer view of the selected elements. Every
per-element fault model (flip, stuck-at, zero, random value) is such a function of the bits, and
every pattern picks its elements from the shape and the event's generator alone, so the host
resolves the spec exactly (:func:`descriptor`) and writes the rows in place before the
micro-batch; the graph reads the descriptor as an input. A descriptor that does not fire is
the identity (and=-1, or=0, xor=0); its row count only grows (one recompile) when an event
selects more elements than it holds.

Differences from the hook (eager) injector: every call of the module within the armed
micro-batch gets the fault (the graph keeps no per-call counter; eager hits a transient fault's
first call only); the records (written by the host when it arms a fault) have ``before`` and
``after`` null, ``call`` null and ``"graph": true``; the descriptor is resolved on the shape the
site had at its last call (a shape that changed since is warned about).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from sdcscope.common.fp8 import is_fp8_linear
from sdcscope.common.gemmsite import add_wrapper, remove_wrapper
from sdcscope.common.world import is_dtensor
from sdcscope.faults import FaultSpec, FaultSpecError
from sdcscope.faults.formats import fault_format, format_of
from sdcscope.inject.targets import Target, operand_channel_dims

log = logging.getLogger("sdcscope.inject.graph")

GRAPH_SITES = ("gemm.forward", "gemm.grad_input", "gemm.grad_weight")
"""The sites graph mode reaches inside the graph; the others keep their mechanism."""
OUTSIDE_GRAPH = ("weight", "optimizer_state", "param_grad", "checkpoint")
"""Sites applied between steps or by hooks that run outside the compiled graph (``param_grad``:
a post-accumulate-grad hook): unchanged in graph mode."""
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}
"""The integer view each compute dtype is faulted through."""
_OPERAND = {"gemm.grad_input": 0, "gemm.grad_weight": 1}  # ops[k]: x / a for dX, w / b for dW
_IDENTITY = (0, -1, 0, 0)


def corrupt(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``t`` with descriptor ``d`` applied, functionally (no in-place op on a dtype view, which
    inductor cannot compile faithfully)."""
    if t.numel() == 0:
        return t
    flat = t.reshape(-1)
    idx = d[:, 0] % flat.numel()
    sel = flat[idx].view(INT[t.dtype]).to(torch.int64)
    new = (((sel & d[:, 1]) | d[:, 2]) ^ d[:, 3]).to(INT[t.dtype]).view(t.dtype)
    return flat.index_put((idx,), new).view_as(t)


class _FaultResult(torch.autograd.Function):
    """Y as the faulty GEMM produced it; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, y, d):
        return corrupt(y, d)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FaultGrad(torch.autograd.Function):
    """The identity on an operand; in backward, its gradient as the faulty GEMM produced it."""

    @staticmethod
    def forward(ctx, t, d):
        ctx.save_for_backward(d)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        (d,) = ctx.saved_tensors
        return corrupt(grad, d), None


def identity_rows(k: int) -> torch.Tensor:
    return torch.tensor([_IDENTITY] * k, dtype=torch.int64)


class GemmFaults:
    """The injector's wrapper on one GEMM module: its faults' descriptors, applied in spec order.

    ``seen[(site, dtype, training)]`` is the shape the site had at its last call in that compute
    dtype and module mode (a store into a dict whose keys are all there from the start: dynamo
    replays it after the graph, without a break or a recompile)."""

    def __init__(self, device: torch.device) -> None:
        self.faults: list[tuple[str, dict[torch.dtype, torch.Tensor]]] = []
        self.seen: dict[tuple[str, torch.dtype, bool], tuple[int, ...] | None] = {}
        self.device = device

    def add(self, site: str, rows: int) -> dict[torch.dtype, torch.Tensor]:
        descs = {dt: identity_rows(rows).to(self.device) for dt in INT}
        self.faults.append((site, descs))
        for key in ((site, dt, mode) for dt in INT for mode in (True, False)):  # every key there
            self.seen.setdefault(key, None)  # before the first call: the graph guards on the keys
        return descs

    def around(self, gemm, ops: list, inner) -> torch.Tensor:
        """The GEMM with this module's faults: on its operands' gradients, then on Y."""
        ops = self._operands(gemm, ops)
        return self._result(gemm, inner(ops))

    def _operands(self, gemm, ops: list) -> list:
        ops = list(ops)
        for name, k in _OPERAND.items():
            if any(s == name for s, _ in self.faults):
                self.seen[(name, ops[k].dtype, gemm.module.training)] = tuple(ops[k].shape)
        for s, descs in self.faults:
            k = _OPERAND.get(s)
            if k is not None and ops[k].requires_grad:
                ops[k] = _FaultGrad.apply(ops[k], descs[ops[k].dtype])
        return ops

    def _result(self, gemm, y: torch.Tensor) -> torch.Tensor:
        forward = [descs for s, descs in self.faults if s == "gemm.forward"]
        if forward:
            self.seen[("gemm.forward", y.dtype, gemm.module.training)] = tuple(y.shape)
        for descs in forward:
            y = _FaultResult.apply(y, descs[y.dtype])
        return y


def refusal(spec: FaultSpec, t: Target) -> str | None:
    """Why graph mode cannot carry ``spec`` on target ``t`` (None: it can)."""
    m = t.module
    if spec.site == "activation":
        return (
            f"site 'activation' on {t.name!r} ({type(m).__name__}) needs a forward hook, which breaks a "
            f"compiled graph; graph mode reaches {', '.join(GRAPH_SITES)} on nn.Linear and MatMul modules"
        )
    if spec.site not in GRAPH_SITES:
        return None
    if is_fp8_linear(m):
        return (
            f"site {spec.site!r} on {t.name!r}: graph mode does not reach the torch._scaled_mm calls of an FP8 "
            "layer (Fp8Linear); use Injector(graph=False)"
        )
    if not (isinstance(m, nn.Linear) or getattr(m, "is_matmul", False)):
        return (
            f"site {spec.site!r} on {t.name!r}: graph mode reaches the GEMM of nn.Linear and MatMul-contract "
            f"modules only, not a {type(m).__name__}; use Injector(graph=False) (hooks, graph breaks)"
        )
    if spec.site == "gemm.forward" and spec.pattern.kind == "mac_cell":
        return (
            f"pattern 'mac_cell' on gemm.forward of {t.name!r} faults the weight operand inside the "
            "computation, which graph mode does not model; use Injector(graph=False)"
        )
    if is_dtensor(getattr(m, "weight", None)):
        return f"site {spec.site!r} on {t.name!r}: graph mode does not reach a tensor-parallel (DTensor) GEMM"
    if spec.format is not None and fault_format(torch.float32, spec.format).name not in ("fp32", "bf16", "fp16"):
        return (
            f"format {spec.format!r} of a fault on {spec.site!r} of {t.name!r}: a fault in a format other "
            "than the GEMM's compute dtype rounds the value into it, not a function of its bits alone"
        )
    return None


def kind_of(module: nn.Module) -> str:
    return "linear" if isinstance(module, nn.Linear) else "matmul"


def channel_dim(site: str, module: nn.Module):
    """The ``channel_dim`` the hook injector hands ``apply_spec`` at ``site`` of ``module``."""
    if site == "gemm.forward":
        return -1
    if site == "gemm.grad_weight" and isinstance(module, nn.Linear):
        return None
    return operand_channel_dims(module, _OPERAND[site])


def initial_rows(spec: FaultSpec) -> int:
    """Rows a descriptor starts with: what an ``element`` or ``burst`` pattern selects, else 1."""
    p = spec.pattern
    return p.length if p.kind == "burst" else 1


def descriptor(apply, spec: FaultSpec, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, rows)``: the flat indices the event's fault selects in a ``shape`` tensor of
    ``dtype`` and the rows ``[index, and, or, xor]`` that reproduce it bit for bit.

    ``apply(tensor)`` applies the event's fault in place (the injector's ``_apply``, same
    generator seed each call). Applied to all-zero and all-one bits, each bit of a selected
    element is f(0), f(1): (0, 1) kept, (1, 0) inverted, (0, 0) cleared, (1, 1) set."""
    if dtype not in INT:
        raise FaultSpecError(f"graph mode faults fp32, bf16, fp16 and fp64 GEMMs, not {dtype}")
    if fault_format(dtype, spec.format) != format_of(dtype):
        raise FaultSpecError(
            f"format {spec.format!r} on a {str(dtype)[6:]} GEMM: the value is rounded into that format "
            "and back, not a function of its bits alone; graph mode refuses it (use Injector(graph=False))"
        )
    ints = INT[dtype]
    zeros = torch.zeros(shape, dtype=ints).view(dtype)
    ones = torch.full(shape, -1, dtype=ints).view(dtype)
    rz, ro = apply(zeros), apply(ones)
    assert torch.equal(rz.index, ro.index), "a pattern drew on the values"
    z = rz.after.view(ints).to(torch.int64)
    o = ro.after.view(ints).to(torch.int64)
    rows = torch.stack([rz.index, z ^ o, z & o, z & ~o], dim=1)
    return rz.index, rows


def padded(rows: torch.Tensor, k: int) -> torch.Tensor:
    """``rows`` padded to ``k`` rows by repeating its last (an index written twice with the same
    value is deterministic); no rows: identity rows."""
    if rows.shape[0] == 0:
        return identity_rows(k)
    return torch.cat([rows, rows[-1:].expand(k - rows.shape[0], 4)])


@dataclass
class Entry:
    """One (spec, target) carried by a wrapper."""

    i: int
    spec: FaultSpec
    target: Target
    wrapper: GemmFaults
    descs: dict[torch.dtype, torch.Tensor]
    armed: dict[torch.dtype, tuple[int, ...]] = field(default_factory=dict)  # dtype -> shape resolved on
    failed: dict[torch.dtype, FaultSpecError] = field(default_factory=dict)  # guessed dtypes that did not fit
    training: bool = True  # the module mode it was armed for
    position: tuple = ()  # (step, micro-batch, evaluating) it was armed at

    def shapes(self, training: bool) -> dict[torch.dtype, tuple[int, ...]]:
        """The shape of the site at its last call in module mode ``training``, per compute dtype."""
        return {
            dt: s
            for (site, dt, mode), s in self.wrapper.seen.items()
            if site == self.spec.site and mode == training and s is not None
        }


def install(entries_for: list[tuple[int, FaultSpec, Target]], device: torch.device) -> list[Entry]:
    """Put one wrapper on each targeted module (``order`` 0: next to the GEMM); its descriptors
    live with the module's parameters, or on ``device`` (the model's) for a MatMul."""
    wrappers: dict[int, GemmFaults] = {}
    out = []
    for i, spec, t in entries_for:
        m = t.module
        w = wrappers.get(id(m))
        if w is None:
            w = wrappers[id(m)] = GemmFaults(next((p.device for p in m.parameters()), device))
            add_wrapper(m, kind_of(m), w, order=0)
        out.append(Entry(i, spec, t, w, w.add(spec.site, initial_rows(spec))))
    log.debug("graph mode: %d fault(s) on %d GEMM module(s)", len(out), len(wrappers))
    return out


def uninstall(entries: list[Entry]) -> None:
    for e in {id(e.wrapper): e for e in entries}.values():
        remove_wrapper(e.target.module, e.wrapper)


def write(e: Entry, dtype: torch.dtype, rows: torch.Tensor | None) -> None:
    """Write ``rows`` (None: the identity) into ``e``'s descriptor for ``dtype`` in place, growing
    it (a new tensor: one recompile) when the event selects more elements than it holds."""
    desc = e.descs[dtype]
    n = 0 if rows is None else rows.shape[0]
    if n > desc.shape[0]:
        k = 1 << (n - 1).bit_length()
        log.info(
            "graph mode: descriptor of fault spec #%d on %r grows to %d rows (the graph recompiles once)",
            e.i,
            e.target.name,
            k,
        )
        e.descs[dtype] = desc = torch.empty((k, 4), dtype=torch.int64, device=desc.device)
    with torch.no_grad():
        desc.copy_(identity_rows(desc.shape[0]) if rows is None else padded(rows, desc.shape[0]))


@dataclass(frozen=True)
class GraphResult:
    """What a record holds of a fault armed in a graph: its elements, not their values (the graph
    hands nothing back)."""

    index: torch.Tensor

    def to_dict(self) -> dict[str, list | None]:
        return {"index": self.index.tolist(), "before": None, "after": None}
