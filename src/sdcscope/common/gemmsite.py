"""A module's GEMM as one traceable composition: what a compiled graph can carry.

Hooks cannot reach inside a ``torch.compile`` graph: a module hook run eagerly breaks the graph,
a traced one cannot register the autograd-node hooks that see dX and dW. A :class:`GemmSite`
instead replaces the ``forward`` of an ``nn.Linear`` (or of a MatMul-contract module, ``forward(a,
b) = a @ b``) by the same product with *wrappers* around it, each a few tensor ops or an
``autograd.Function`` that dynamo traces: a wrapper can act on an operand's gradient (dX, dW) in
backward and on Y. Rooms register wrappers without knowing of each
other: the injector's (``order`` 0) sit next to the GEMM -- the hardware corrupts a value before
anything reads it --, a detector's (``order`` 1) outside them, so a check sees a fault as the
GEMM produced it.

Under autocast the site casts the operands to the autocast dtype itself (what autocast does for
``F.linear`` and ``matmul``), so every wrapper sees the GEMM's operands, result and gradients in
its compute dtype (bf16 dX, not its fp32 upcast). The product itself is ``F.linear`` /
``torch.matmul``, unchanged: training with a site and no wrapper is bitwise training without one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_sdcscope_gemm_site"


class GemmSite:
    """The GEMM of ``module``: ``kind`` ``'linear'`` (Y = X·Wᵀ + b) or ``'matmul'`` (C = a·b).

    A wrapper is an object with ``around(site, ops, inner) -> y``: ``ops`` is the list ``[x, w,
    b]`` or ``[a, b]`` as the GEMM will consume them, ``inner(ops)`` runs the wrappers inside it
    and the GEMM."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module = module
        self.kind = kind
        self.wrappers: list[tuple[int, object]] = []
        self._had_forward = "forward" in module.__dict__
        self._own_forward = module.__dict__.get("forward")

    def add(self, wrapper: object, order: int) -> None:
        self.wrappers = sorted([*self.wrappers, (order, wrapper)], key=lambda e: e[0])

    def remove(self, wrapper: object) -> None:
        self.wrappers = [e for e in self.wrappers if e[1] is not wrapper]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        mod = self.module
        if self.kind == "linear":
            ops = [args[0] if args else kwargs["input"], mod.weight, mod.bias]
        else:
            ops = [*args, *kwargs.values()][:2]
        dev = ops[0].device.type
        if torch.is_autocast_enabled(dev):  # the casts autocast would make, made here
            cd = torch.get_autocast_dtype(dev)
            ops = [t if t is None or not t.is_floating_point() else t.to(cd) for t in ops]
            with torch.autocast(dev, enabled=False):
                return self._run(ops)
        return self._run(ops)

    def _run(self, ops: list, depth: int | None = None) -> torch.Tensor:
        """The wrappers from the outermost (highest ``order``: a detector's) in, then the GEMM."""
        depth = len(self.wrappers) if depth is None else depth
        if depth == 0:
            return F.linear(*ops) if self.kind == "linear" else torch.matmul(*ops)
        w = self.wrappers[depth - 1][1]

        def inner(o: list) -> torch.Tensor:
            return self._run(o, depth - 1)

        return w.around(self, ops, inner)


def site_of(module: nn.Module, kind: str | None = None) -> GemmSite | None:
    """The :class:`GemmSite` of ``module``; with ``kind``, created (its ``forward`` replaced) if
    there is none yet."""
    site = module.__dict__.get(_ATTR)
    if site is None and kind is not None:
        site = GemmSite(module, kind)
        module.__dict__[_ATTR] = site
        module.forward = site.forward
    return site


def add_wrapper(module: nn.Module, kind: str, wrapper: object, order: int) -> GemmSite:
    site = site_of(module, kind)
    site.add(wrapper, order)
    return site


def remove_wrapper(module: nn.Module, wrapper: object) -> None:
    """Remove ``wrapper``; the last one out restores the module's own ``forward``."""
    site = site_of(module)
    if site is None:
        return
    site.remove(wrapper)
    if not site.wrappers:
        del module.__dict__[_ATTR]
        if site._had_forward:
            module.forward = site._own_forward
        else:
            del module.__dict__["forward"]
