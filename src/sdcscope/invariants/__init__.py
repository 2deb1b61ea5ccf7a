"""Invariants: learn what a correct training run looks like, then check every run against it.

The TrainCheck idea (OSDI '25), native to sdcscope:

1. **Trace** clean runs with :class:`TraceRecorder` (hooks on the model, the optimizer, and
   wrapped torch functions for backward, clipping and the loss; one host sync per step) into
   ``RUN_DIR/trace.jsonl``; a user's own script, unchanged, with ``script.run_script``.
2. **Infer** with :func:`infer_invariants` the relations that hold in all of them
   (``Consistent``, ``EventContain``, ``ExclusiveWrite``, ``APISequence``, ``APICount``,
   ``APICountRatio``, ``APIArg``, ``APIArgRatio``, ``APIOutput``, ``MetricBound``,
   ``MetricTrend``, ``InitialLoss``, ``LossTrend``, ``Causal``, ``GradShare``, ``LRSchedule``), with learned
   preconditions; save them as editable YAML.
3. **Check** a run online with :class:`InvariantChecker` (in-process, records only what the
   invariants need) or offline with :func:`check_trace`; violations are ``events.jsonl`` events
   naming the invariant, the tensor or module, and the evidence.
"""

from sdcscope.invariants.checker import (
    EVENTS_FILE,
    InvariantChecker,
    bind_invariants,
    check_trace,
)
from sdcscope.invariants.files import load_invariants, parse_invariants, save_invariants
from sdcscope.invariants.infer import infer_invariants
from sdcscope.invariants.recorder import EngineCallbacks, TraceRecorder
from sdcscope.invariants.relations import RELATIONS, InferConfig, Relation
from sdcscope.invariants.spec import APIS, Invariant, Precondition
from sdcscope.invariants.traceconfig import TRACE_FILE, TraceConfig
from sdcscope.invariants.tracefile import Trace, load_trace
from sdcscope.invariants.values import checksum

__all__ = [
    "APIS",
    "Invariant",
    "Precondition",
    "TRACE_FILE",
    "EngineCallbacks",
    "TraceConfig",
    "TraceRecorder",
    "checksum",
    "Trace",
    "load_trace",
    "RELATIONS",
    "InferConfig",
    "Relation",
    "load_invariants",
    "parse_invariants",
    "save_invariants",
    "infer_invariants",
    "EVENTS_FILE",
    "InvariantChecker",
    "bind_invariants",
    "check_trace",
]
