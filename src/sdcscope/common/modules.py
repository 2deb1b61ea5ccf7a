"""What kind of module a module is, and which modules a name pattern selects.

* GEMM modules: ``nn.Linear``, convolutions (transposed too), transformers' ``Conv1D`` (known by
  its class name, so transformers need not be imported), and the duck-typed **MatMul contract**: a
  module whose class (or instance) has ``is_matmul = True`` and whose ``forward(a, b)`` returns
  ``a @ b`` (batched, no bias). ``sdcscope.workloads.gpt.MatMul`` follows it; so can any user module.
* the duck-typed **dispatch contract** of a mixture-of-experts layer: a module with
  ``is_dispatch = True``, an ``n_expert`` and ``forward(x [N, d], experts [N, k])`` returning
  ``(rows, order, counts)`` -- the token rows sorted by expert, the assignment ``t·k + j`` each
  slot holds, the slots per expert (``sdcscope.workloads.moe.TokenDispatch``).
* shell-style module-name patterns (``fnmatch``, ``*`` also crosses dots) resolved against
  ``model.named_modules()``, with close matches in the error when a pattern matches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

from torch import nn

from sdcscope.common.validate import close_matches

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CHANNELS_FIRST = CONV_TYPES + TRANSPOSED_TYPES
"""GEMM modules whose outputs and input gradients hold their channels in dim 1."""
GEMM_TYPES = (nn.Linear, *CHANNELS_FIRST)


def is_matmul(module: nn.Module) -> bool:
    """True for modules following the MatMul contract (``is_matmul = True``, ``forward(a, b) = a @ b``)."""
    return getattr(module, "is_matmul", False) is True


def is_dispatch(module: nn.Module) -> bool:
    """True for an MoE token dispatch following the dispatch contract (see the module docstring)."""
    return getattr(module, "is_dispatch", False) is True


def weight_in_out(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (the GPT-2 family's projections): a Linear computing
    ``Y = X·W + b`` with W stored (in, out), the transpose of ``nn.Linear``'s -- known by its
    class name and ``nf`` (its output width), so transformers need not be imported."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(w, nn.Parameter)
        and w.dim() == 2
        and getattr(module, "nf", None) == w.shape[1]
    )


def has_weight_operand(module: nn.Module) -> bool:
    """A GEMM module whose second operand is its ``weight`` (Linear, Conv, ConvTranspose, Conv1D)."""
    return isinstance(module, GEMM_TYPES) or weight_in_out(module)


def is_gemm(module: nn.Module) -> bool:
    """A module whose forward is one GEMM: Linear, Conv, ConvTranspose, transformers' Conv1D, or
    the ``is_matmul`` contract (a @ b)."""
    return has_weight_operand(module) or getattr(module, "is_matmul", False)


def match_modules(
    model: nn.Module,
    patterns: Iterable[str] | None,
    *,
    where: Callable[[nn.Module], bool] = lambda m: True,
    option: str = "modules",
    strict: bool = True,
) -> dict[str, nn.Module]:
    """``{name: module}`` for modules accepted by ``where`` whose name matches any pattern.

    ``patterns=None`` selects every accepted module. With ``strict``, a pattern that matches no
    accepted module raises ``ValueError`` naming it and the closest candidate names.
    """
    candidates = {name: m for name, m in model.named_modules() if name and where(m)}
    if patterns is None:
        return candidates
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    chosen: dict[str, nn.Module] = {}
    for pat in patterns:
        hits = {n: m for n, m in candidates.items() if fnmatchcase(n, pat)}
        if not hits and strict:
            close = close_matches(pat, candidates, n=3, cutoff=0.4)
            hint = f"; closest: {', '.join(close)}" if close else ""
            shown = ", ".join(list(candidates)[:8]) + (", ..." if len(candidates) > 8 else "")
            raise ValueError(f"{option} pattern {pat!r} matches no eligible module{hint} (eligible: {shown or 'none'})")
        chosen.update(hits)
    return chosen
