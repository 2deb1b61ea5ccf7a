"""Detectors: non-finite values, spikes, ABFT checksums of every GEMM, the kernel canary
(sampled rows of a registered op against its reference), the MoE token-permutation check,
cross-rank signatures.

Each detector is a small class with a config dataclass and ``check(...) -> list[Event]``;
:class:`Event` is one line of ``events.jsonl``. The guard drives them through one protocol,
``check(view)``, and a registry (:mod:`sdcscope.detect.protocol`): importing this package
registers the built-ins, in the order of the imports below (the order the guard runs them in).
May import :mod:`sdcscope.observe`.
"""

from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.detect.canary import CanaryConfig, CanaryDetector, canary_function, canary_module
from sdcscope.detect.checksum import gemm_check
from sdcscope.detect.crossrank import CrossRankConfig, CrossRankDetector, ReplicaHashCheck
from sdcscope.detect.dispatch import DispatchCheck, DispatchConfig
from sdcscope.detect.events import GEMMS, Event
from sdcscope.detect.nonfinite import NonFiniteConfig, NonFiniteDetector
from sdcscope.detect.protocol import CheckView, Detector, Registration, register, registered, unregister
from sdcscope.detect.rounding import RoundingModel, rounding_model, unit_roundoff
from sdcscope.detect.signatures import Gathered, GradientSignatures, bitsum, bucket_norms, fletcher, grad_signatures
from sdcscope.detect.spike import SpikeConfig, SpikeDetector, SpikeState
from sdcscope.detect.state import StateChecksum, StateChecksumConfig

# isort: split
from sdcscope.detect.collectives import CollectiveCheck, CollectivesConfig  # registers last

ABFT = ABFTDetector

__all__ = [
    "ABFT",
    "ABFTConfig",
    "ABFTDetector",
    "CanaryConfig",
    "CanaryDetector",
    "CrossRankConfig",
    "CheckView",
    "CollectiveCheck",
    "CollectivesConfig",
    "CrossRankDetector",
    "Detector",
    "DispatchCheck",
    "DispatchConfig",
    "Event",
    "GEMMS",
    "Gathered",
    "GradientSignatures",
    "NonFiniteConfig",
    "NonFiniteDetector",
    "Registration",
    "ReplicaHashCheck",
    "RoundingModel",
    "SpikeConfig",
    "SpikeDetector",
    "SpikeState",
    "StateChecksum",
    "StateChecksumConfig",
    "bitsum",
    "bucket_norms",
    "canary_function",
    "canary_module",
    "fletcher",
    "gemm_check",
    "grad_signatures",
    "register",
    "registered",
    "rounding_model",
    "unit_roundoff",
    "unregister",
]
