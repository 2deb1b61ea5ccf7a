"""The vocabulary of a fault spec: the sites a fault lands on, the spatial pattern and temporal
schedule kinds with the fields each takes, and which pattern fields mean something on which site."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shapes import Pattern

__all__ = [
    "SITES",
    "COLLECTIVE_SITES",
    "LINK_SITES",
    "DIRECTIONS",
    "STEP_SITES",
    "TOKEN_MODELS",
    "PATTERN_KINDS",
    "SCHEDULE_KINDS",
    "RANDOM",
    "ALL",
    "WARP_SIZE",
    "SWIZZLE_MODES",
    "GEMM_OPERANDS",
    "MAC_CELL_SINGLE_AXIS",
    "check_site_pattern",
]

SITES: tuple[str, ...] = (
    "weight",
    "activation",
    "gemm.forward",
    "gemm.grad_input",
    "gemm.grad_weight",
    "param_grad",
    "optimizer_state",
    "checkpoint",
    "comm",
    "dispatch",
    "comm.all_gather",
    "comm.reduce_scatter",
    "comm.all_to_all",
    "comm.p2p",
)
"""Where a fault can land (see docs/architecture.md, vocabulary). ``dispatch``: the token rows a
mixture-of-experts layer's dispatch hands its experts (the permutation's output, what an
expert-parallel all-to-all moves); the element fault models act on its bits, the
:data:`TOKEN_MODELS` on whole slots."""

TOKEN_MODELS: tuple[str, ...] = ("drop", "duplicate")
"""Fault models of site ``dispatch`` only, on one whole slot (a ``row`` pattern): ``drop`` (the
token never arrived: zeros) and ``duplicate`` (the next slot's token arrived in its place)."""

COLLECTIVE_SITES: dict[str, tuple[str, ...]] = {
    "comm.all_gather": ("forward", "backward"),
    "comm.reduce_scatter": (),
    "comm.all_to_all": ("dispatch", "combine", "combine_grad", "dispatch_grad"),
    "comm.p2p": ("forward", "backward"),
}
"""The collectives a fault can corrupt, on the rank the data arrived on, and the phases each
takes: FSDP2's (``comm.all_gather``: the ``forward`` all-gather or the ``backward`` re-gather),
an expert-parallel MoE layer's all-to-all (``comm.all_to_all``: the token rows' ``dispatch``
(the default), the expert outputs' ``combine``, and their gradients' moves back in backward) and
a pipeline's send/recv (``comm.p2p``: an activation ``forward``, a gradient ``backward``)."""
LINK_SITES: tuple[str, ...] = ("comm.all_gather", "comm.all_to_all", "comm.p2p")
"""Collective sites whose fault names a link: ``source`` (and ``direction``)."""
DIRECTIONS: tuple[str, ...] = ("recv", "send")
"""Which end of a link a collective fault lives at: ``recv`` (what arrived on ``rank`` from
``source``) or ``send`` (what left ``source``: every receiver's copy)."""

GEMM_OPERANDS: tuple[str, ...] = ("output", "a", "b", "scale_a", "scale_b")
"""What a fault on a GEMM site of an FP8 layer hits (the spec's ``operand``), as the GEMM unit
reads or writes it: ``output`` (the result C, the default), ``a`` / ``b`` (the fp8 operands of
C = (scale_a·A)·(scale_b·B): Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X, faulted in their fp8 format) or
``scale_a`` / ``scale_b`` (their fp32 per-tensor scales)."""

STEP_SITES: frozenset[str] = frozenset(
    {"param_grad", "optimizer_state", "checkpoint", "comm", *(s for s in COLLECTIVE_SITES if s != "comm.p2p")}
)
"""Sites touched once per optimizer step, so a schedule's ``micro_batch`` means nothing (a
pipeline's send/recv runs per micro-batch)."""

RANDOM = "random"
"""The value of an index-like pattern field that asks for a draw from the fault generator."""

PATTERN_KINDS: dict[str, tuple[str, ...]] = {
    "element": ("index",),
    "burst": ("length", "start"),
    "row": ("index",),
    "column": ("index",),
    "pe": ("array", "pe"),
    "mac_cell": ("input_channel", "output_channel", "array", "swizzle", "swizzle_seed"),
    "tensor": ("ber",),
    "strided": ("stride", "start", "count"),
    "warp": ("lanes", "warp", "stride", "count", "warp_size"),
}
"""Spatial pattern kinds and the fields each takes."""

WARP_SIZE = 32
"""Threads per warp on NVIDIA GPUs: the default ``warp_size`` of a ``warp`` pattern (AMD's
wavefronts are 64 wide)."""

ALL = "all"
"""The ``lanes`` value of a ``warp`` pattern that hits every lane (a whole warp's elements)."""

SWIZZLE_MODES: tuple[str, ...] = ("none", "per_step")
"""Channel swizzling of a ``mac_cell`` pattern: ``none`` (logical channel c always runs on
physical lane c) or ``per_step`` (a fresh permutation of the channels every training step)."""

SCHEDULE_KINDS: dict[str, tuple[str, ...]] = {
    "transient": ("step", "micro_batch"),
    "intermittent": ("p", "start", "stop"),
    "permanent": ("start",),
    "periodic": ("every", "start", "stop", "micro_batch"),
}
"""Temporal schedule kinds and the fields each takes."""

MAC_CELL_SINGLE_AXIS: dict[str, tuple[str, str]] = {
    "activation": (
        "input_channel",
        "a module output holds output channels only (dim 1 of a conv's, the last dim of others: "
        "cell (a, b) selects output channel b; the input channels were summed over)",
    ),
    "gemm.grad_input": (
        "output_channel",
        "dX = dY W holds input channels only (dim 1 of a conv's, the last dim of others: cell "
        "(a, b) selects input channel a; the output channels were summed over)",
    ),
}
"""Sites where a ``mac_cell`` pattern constrains one channel axis only: site -> (the field that
has no meaning there, why). Every other site a ``mac_cell`` reaches is weight-shaped (``weight``,
``param_grad``, ``optimizer_state``, ``checkpoint``, ``gemm.grad_weight``, ``gemm.forward``'s
weight operand) or a ``comm`` parameter gradient, and uses both."""


def check_site_pattern(site: str, pattern: Pattern) -> None:
    """Refuse a ``pattern`` field that would be silently ignored on ``site``: a fixed ``mac_cell``
    channel on the axis the site's tensor does not have (:data:`MAC_CELL_SINGLE_AXIS`:
    ``input_channel`` on ``activation``, ``output_channel`` on ``gemm.grad_input``). The default,
    ``"random"``, is accepted there: it asks for nothing."""
    if pattern.kind != "mac_cell" or site not in MAC_CELL_SINGLE_AXIS:
        return
    name, why = MAC_CELL_SINGLE_AXIS[site]
    value = getattr(pattern, name)
    if value is None or value == RANDOM:
        return
    other = "output_channel" if name == "input_channel" else "input_channel"
    where = (
        "site 'gemm.forward' (the weight operand of cell (a, b)) or 'weight'"
        if site == "activation"
        else "site 'gemm.grad_weight' or 'gemm.forward' (the weight operand of cell (a, b))"
    )
    raise ValueError(
        f"pattern mac_cell {name} {value!r} has no meaning on site {site!r}: {why}, so it would be "
        f"ignored; leave {name} out (or 'random') and give {other} only, or use {where} for a fault "
        f"that depends on both channels"
    )
