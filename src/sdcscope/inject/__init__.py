"""Attach fault specs to a live training run through removable hooks; log every fired fault."""

from sdcscope.inject.checkpoint import corrupt_checkpoint_file
from sdcscope.inject.comm import PHASES, CommInjector, CommInjectorCallback, comm_phase
from sdcscope.inject.injector import Injector, InjectorCallback, reexecution
from sdcscope.inject.targets import is_gemm, resolve_targets, validate_specs

__all__ = ["corrupt_checkpoint_file", "Injector", "InjectorCallback", "reexecution", "is_gemm", "resolve_targets", "validate_specs",
           "CommInjector", "CommInjectorCallback", "comm_phase", "PHASES"]
