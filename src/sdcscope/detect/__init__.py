"""Detectors: non-finite values, spikes, ABFT checksums of every GEMM, cross-rank signatures.

Each detector is a small class with a config dataclass and ``check(...) -> list[Event]``;
:class:`Event` is one line of ``events.jsonl``. May import :mod:`sdcscope.observe`.
"""

from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.detect.checksum import gemm_check
from sdcscope.detect.crossrank import CrossRankConfig, CrossRankDetector, ReplicaHashCheck
from sdcscope.detect.events import GEMMS, Event
from sdcscope.detect.nonfinite import NonFiniteConfig, NonFiniteDetector
from sdcscope.detect.rounding import RoundingModel, rounding_model, unit_roundoff
from sdcscope.detect.signatures import Gathered, GradientSignatures, bitsum, bucket_norms, fletcher, grad_signatures
from sdcscope.detect.spike import SpikeConfig, SpikeDetector, SpikeState
from sdcscope.detect.state import StateChecksum, StateChecksumConfig

ABFT = ABFTDetector

__all__ = [
    "ABFT",
    "ABFTConfig",
    "ABFTDetector",
    "CrossRankConfig",
    "CrossRankDetector",
    "Event",
    "GEMMS",
    "Gathered",
    "GradientSignatures",
    "NonFiniteConfig",
    "NonFiniteDetector",
    "ReplicaHashCheck",
    "RoundingModel",
    "SpikeConfig",
    "SpikeDetector",
    "SpikeState",
    "StateChecksum",
    "StateChecksumConfig",
    "bitsum",
    "bucket_norms",
    "fletcher",
    "gemm_check",
    "grad_signatures",
    "rounding_model",
    "unit_roundoff",
]
