"""ABFT's configuration: which layers and products are checked, how often, and the threshold."""

from __future__ import annotations

from dataclasses import dataclass

from sdcscope.common.validate import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_non_negative,
    check_positive,
)
from sdcscope.detect.events import GEMMS

CHECKSUMS = ("both", "row", "column")
KINDS = ("linear", "matmul", "conv", "sdpa")
CHECKSUM_DTYPES = ("auto", "float64", "float32")
ORDERS = ("rotation", "random")


@dataclass(kw_only=True)
class ABFTConfig:
    targets: tuple[str, ...] | None = None
    """Module-name patterns; ``None`` = every module of ``kinds``."""
    kinds: tuple[str, ...] = KINDS
    """Which products: ``'linear'`` (``nn.Linear``), ``'matmul'`` (MatMul-contract modules),
    ``'conv'`` (``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d``), ``'sdpa'``
    (``F.scaled_dot_product_attention`` calls: sampled query rows recomputed,
    :mod:`sdcscope.detect.attention`)."""
    attention_rows: int = 2
    """Query rows per SDPA call recomputed in fp32 and compared (``'sdpa'`` in ``kinds``)."""
    gemms: tuple[str, ...] = GEMMS
    checksums: str = "column"
    """``'column'``: 1ᵀC per check (names the column); ``'both'`` adds the row checksums C·1
    (names the element; about 2 more memory passes per check); ``'row'``: C·1 only."""
    c: float = 8.0
    """Threshold in model standard deviations (:mod:`sdcscope.detect.checksum`), well above the
    largest clean ratios measured (``benchmarks/``), bf16 GEMMs and layers run several times per
    forward being the highest."""
    checksum_dtype: str = "auto"
    """``'auto'`` = float32 (AEGIS: checksums at FP32-accumulator precision). ``'float64'`` makes
    the checksum arithmetic exact and the fp32 threshold much tighter, but is not cheap (a
    conversion copy of every operand)."""
    every: int = 1
    """Check on steps with ``step % every == 0``."""
    layer_fraction: float = 1.0
    """Share of the targeted layers checked on a checked step (see ``order``)."""
    order: str = "rotation"
    """How ``layer_fraction`` picks a checked step's layers: ``'rotation'`` (the n layers dealt
    evenly into B = ⌈1 / layer_fraction⌉ slots, one slot a checked step in turn from an offset
    drawn from ``seed``: every layer is checked once every B checked steps, so a persistent fault
    is caught within B of them and a transient one in its step with probability 1/B;
    ``ABFTDetector.coverage_bound``) or ``'random'`` (each layer drawn with probability
    ``layer_fraction``, afresh each step: the same rate, no bound on when a layer is checked,
    but a fault pinned to one layer and period cannot alias with the sampling)."""
    seed: int = 0
    """Seed of the rotation's starting offset and of the ``'random'`` draw (either is a function
    of seed, step and the layers alone, so a replay of a step checks the same layers, two seeds
    check different layers on the same step, and the training RNG is never touched)."""
    escalate_steps: int = 10
    """After a checksum mismatch (or :meth:`ABFTDetector.escalate`, which the guard calls on any
    other finding), every layer is checked on the step's replay and this many steps after it."""
    tile: int | None = 8
    """bf16/fp16 results (autocast) are checked as sums over ``tile``×``tile`` tiles against the
    product of the operands' tile sums in fp32 -- what the hardware accumulated before rounding
    its output --, with the output rounding bounded per element (|round(y) − y| ≤ u·|y|, summed
    over the tile) instead of widened by c: a change of one element by more than u·Σ_tile|y| is
    caught. Costs a GEMM of 1/tile² of the checked one's work. ``None``: column checksums with the
    statistical output-rounding model (far cheaper, far less sensitive in bf16)."""
    budget: float | None = None
    """Target overhead (e.g. 0.02 = 2 % of step time): overrides ``every`` / ``layer_fraction``
    from measured step times (full coverage on step 0, none on step 1, then a rotation)."""
    calibration_steps: int = 0
    """Checked steps whose largest ratio per (layer, gemm) sets a tighter threshold
    ``max(c_min, calibration_margin × max ratio)`` (never above ``c``)."""
    calibration_margin: float = 4.0
    c_min: float = 5.0
    """Floor of a calibrated threshold: the model std is an upper bound, but a short calibration
    sees only part of the tail of the clean ratios."""
    graph: bool = False
    r"""Check every Linear's Y, dX and dW through traceable taps around its GEMM instead of hooks
    (:mod:`sdcscope.detect.abft.graph`): what a ``torch.compile``\ d model needs -- hooks do
    nothing inside a compiled graph -- and the recommended always-on mode there. Every Linear is
    checked on every step (``every``, ``layer_fraction``, ``order`` and ``budget`` apply to the
    layers left to hooks); MatMul and convolution layers keep their hooks, which a compiled graph
    skips. ``sdcscope train --compile`` turns it on."""
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
        check_choice("order", self.order, ORDERS)
        check_int("seed", self.seed, None)
        check_non_negative("escalate_steps", self.escalate_steps)
        check_non_negative("attention_rows", self.attention_rows)
        if self.tile is not None:
            check_positive("tile", self.tile)
        check_float("layer_fraction", self.layer_fraction, low=0, high=1, low_open=True)
        if self.budget is not None:
            check_float("budget", self.budget, low=0, high=1, low_open=True)
        check_non_negative("calibration_steps", self.calibration_steps)
        check_float("calibration_margin", self.calibration_margin, low=1.0)
        check_float("c_min", self.c_min, low=0, low_open=True)
        check_bool("include_eval", self.include_eval)
        check_bool("graph", self.graph)
        self.linear_subclasses = _names("linear_subclasses", self.linear_subclasses)


def _names(key: str, value: object) -> tuple[str, ...]:
    """A string or a list of strings, as a tuple."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key}={value!r} must be a name or a list of names")
    return tuple(value)
