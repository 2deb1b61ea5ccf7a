"""Attach fault specs to a live training run through removable hooks; log every fired fault."""

from sdcscope.common.modules import is_gemm
from sdcscope.inject.checkpoint import corrupt_checkpoint_file
from sdcscope.inject.comm import PHASES, CommInjector, CommInjectorCallback, comm_phase
from sdcscope.inject.injector import Injector, InjectorCallback
from sdcscope.inject.probe import probe_model
from sdcscope.inject.reexec import reexecution
from sdcscope.inject.targets import resolve_targets
from sdcscope.inject.validate import validate_specs

__all__ = [
    "corrupt_checkpoint_file",
    "Injector",
    "InjectorCallback",
    "reexecution",
    "is_gemm",
    "resolve_targets",
    "validate_specs",
    "probe_model",
    "CommInjector",
    "CommInjectorCallback",
    "comm_phase",
    "PHASES",
]
