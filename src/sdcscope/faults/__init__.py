"""Bit-exact fault models for tensors: formats, ops, specs, spatial and temporal patterns.

Pure functions and dataclasses on top of torch; no hooks, no module state. The
:mod:`sdcscope.inject` room attaches these to a live model.
"""

from .apply import apply_spec, check_spec
from .formats import FORMATS, Format, check_bits, fault_format, format_of, get_format
from .load import load_specs
from .ops import BIT_MODELS, MODELS, FaultResult, apply_fault, bitflip, random_value, stuck_at, zero
from .patterns import resolve_indices, sample_bit_errors, swizzle_permutation
from .schedule import fault_generator, fires
from .spec import FaultSpec, FaultSpecError, Pattern, Schedule
from .tokens import apply_token_fault
from .vocab import PATTERN_KINDS, RANDOM, SCHEDULE_KINDS, SITES, STEP_SITES, SWIZZLE_MODES, TOKEN_MODELS

__all__ = [
    "BIT_MODELS",
    "FORMATS",
    "MODELS",
    "PATTERN_KINDS",
    "RANDOM",
    "SCHEDULE_KINDS",
    "SITES",
    "STEP_SITES",
    "SWIZZLE_MODES",
    "TOKEN_MODELS",
    "FaultResult",
    "FaultSpec",
    "FaultSpecError",
    "Format",
    "Pattern",
    "Schedule",
    "apply_fault",
    "apply_spec",
    "apply_token_fault",
    "bitflip",
    "check_bits",
    "check_spec",
    "fault_format",
    "fault_generator",
    "fires",
    "format_of",
    "get_format",
    "load_specs",
    "random_value",
    "resolve_indices",
    "sample_bit_errors",
    "stuck_at",
    "swizzle_permutation",
    "zero",
]
