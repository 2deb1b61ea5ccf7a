"""Re-executions of a step (a guard's replay or recompute) as every injector in the process sees
them: a transient or intermittent fault was one event in time and does not recur there; a
permanent one (a broken unit) acts again."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from sdcscope.inject.graphsites import disarm_for_reexecution

_REEXECUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("sdcscope_reexecuting", default=False)


@contextlib.contextmanager
def reexecution() -> Iterator[None]:
    """Mark a re-execution of a step (a guard's replay or recompute). A transient or
    intermittent fault was one event in time and does not recur; a permanent one (a broken
    unit) acts again. Every injector in the process honours it (a graph-mode one disarms its
    transient faults here, before the re-execution's forward)."""
    disarm_for_reexecution()
    token = _REEXECUTING.set(True)
    try:
        yield
    finally:
        _REEXECUTING.reset(token)


def reexecuting() -> bool:
    """Whether this runs inside :func:`reexecution`."""
    return _REEXECUTING.get()
