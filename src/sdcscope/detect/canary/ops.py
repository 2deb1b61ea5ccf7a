"""The canary's op registry: any op -- a fused kernel, a custom autograd function, a module -- with
the reference implementation the canary recomputes its sampled rows with.

Two ways in. :func:`canary_function` wraps a function and returns the wrapper to call instead;
:func:`canary_module` hooks a module (a forward pre-hook and a forward hook, both cheap when no
canary is attached). Either way a call made while a canary detector is attached and due
(:class:`~sdcscope.detect.canary.detector.CanaryDetector`) is recorded: the sampled rows of the
output and of the *row arguments* (``row_args``: the positional arguments whose leading dims index
the same rows as the output's), the other arguments by reference; with a backward check the row
arguments and the output pass through identity autograd taps that keep the sampled rows of dY and
of this op's own dX. The reference takes the op's arguments -- the row arguments as those rows --
and returns those rows of the output; it must be row-wise (row i of the output depends on row i
of the row arguments and on the other arguments whole).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from sdcscope.common.validate import check_float, check_positive, did_you_mean

log = logging.getLogger("sdcscope.detect.canary")


@dataclass(eq=False)
class CanaryOp:
    """One registered op and how the canary checks it.

    ``reference(*args, **kwargs)``: the op's math that you trust, given the sampled rows of the
    row arguments (low-precision floating tensors cast to fp32) and the other arguments whole (cast
    likewise); it returns those rows of the output, computed in the dtype it is given (fp32; fp64
    when the canary confirms a flagged row -- cast parameters it closes over to that dtype). ``row_args``: the
    positional arguments split by rows (their leading ``row_dims`` dims equal the output's).
    ``row_dims``: how many leading dims of the output index rows (None: all but the last, at least
    one). ``backward``: also check the sampled rows of the op's input gradients -- ``True`` derives
    them by autograd through ``reference``; a callable ``backward(grad_output, *args, **kwargs)``
    returns them itself, one per row argument in ``row_args`` order (None for one not checked).
    ``rtol``: the relative tolerance beside the output dtype's rounding (None: the canary config's);
    ``atol``: an absolute one, in the output's units (the bound: :mod:`sdcscope.detect.canary`)."""

    name: str
    reference: Callable[..., torch.Tensor]
    row_args: tuple[int, ...] = (0,)
    row_dims: int | None = None
    backward: bool | Callable[..., Any] = False
    rtol: float | None = None
    atol: float = 0.0
    module: nn.Module | None = field(default=None, repr=False)
    """The hooked module (:func:`canary_module`); None for a wrapped function."""
    handles: list[Any] = field(default_factory=list, repr=False)
    opened: list[Any] = field(default_factory=list, repr=False)
    """Calls a module's pre-hook opened, for its forward hook to close."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"canary op name {self.name!r} must be a non-empty string")
        if not callable(self.reference):
            raise TypeError(f"canary op {self.name!r}: reference must be callable, got {self.reference!r}")
        rows = tuple(self.row_args) if isinstance(self.row_args, (list, tuple)) else None
        if rows is None or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in rows):
            raise TypeError(
                f"canary op {self.name!r}: row_args={self.row_args!r} must be argument positions (ints >= 0)"
            )
        if len(set(rows)) != len(rows):
            raise ValueError(f"canary op {self.name!r}: row_args={self.row_args!r} repeats a position")
        self.row_args = rows
        if self.row_dims is not None:
            check_positive(f"canary op {self.name!r} row_dims", self.row_dims)
        if not (isinstance(self.backward, bool) or callable(self.backward)):
            raise TypeError(f"canary op {self.name!r}: backward={self.backward!r} must be a bool or a callable")
        if self.backward is not False and not self.row_args:
            raise ValueError(f"canary op {self.name!r}: a backward check needs row_args (the inputs it checks)")
        if self.rtol is not None:
            check_float(f"canary op {self.name!r} rtol", self.rtol, low=0.0)
        check_float(f"canary op {self.name!r} atol", self.atol, low=0.0)

    def remove(self) -> None:
        """Unregister the op (its module's hooks removed; a wrapper passes calls straight through)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.opened.clear()
        if _OPS.get(self.name) is self:
            del _OPS[self.name]


class Recorder(Protocol):
    """What records the calls (the attached canary detector)."""

    def wants(self, op: CanaryOp) -> bool: ...

    def open(self, op: CanaryOp, args: tuple) -> Any: ...

    def close(self, call: Any, args: tuple, kwargs: dict, out: Any) -> Any: ...


_OPS: dict[str, CanaryOp] = {}
_ACTIVE: list[Recorder] = []  # the attached recorder, at most one


def ops() -> tuple[CanaryOp, ...]:
    """The registered ops, in registration order."""
    return tuple(_OPS.values())


def op(name: str) -> CanaryOp:
    """The registered op ``name``; ValueError naming the registered ones for an unknown name."""
    found = _OPS.get(name)
    if found is None:
        raise ValueError(
            f"unknown canary op {name!r}{did_you_mean(name, _OPS)}; registered: {', '.join(_OPS) or 'none'}"
        )
    return found


def activate(recorder: Recorder) -> None:
    """Make ``recorder`` the one that records (one canary at a time: a second replaces the first)."""
    if _ACTIVE and _ACTIVE[0] is not recorder:
        log.warning("canary: another canary detector was attached; this one records from now on")
    _ACTIVE[:] = [recorder]


def deactivate(recorder: Recorder) -> None:
    if _ACTIVE and _ACTIVE[0] is recorder:
        _ACTIVE.clear()


def _add(new: CanaryOp) -> CanaryOp:
    if new.name in _OPS:
        raise ValueError(f"a canary op {new.name!r} is registered already; remove() it first")
    _OPS[new.name] = new
    log.debug("canary op %r registered", new.name)
    return new


@torch.compiler.disable
def _open(op: CanaryOp, args: tuple) -> tuple[Any, tuple]:
    rec = _ACTIVE[0] if _ACTIVE else None
    if rec is None or not rec.wants(op):
        return None, args
    call = rec.open(op, args)
    return (None, args) if call is None else (call, call.args_in)


@torch.compiler.disable
def _close(call: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    rec = _ACTIVE[0] if _ACTIVE else None
    return out if rec is None else rec.close(call, args, kwargs, out)


def canary_function(name: str, fn: Callable[..., Any], reference: Callable[..., torch.Tensor], **options: Any):
    """Register ``fn`` as the canary op ``name`` and return the wrapper to call instead of it (the
    same result; recorded while a canary is attached). ``options``: the fields of :class:`CanaryOp`
    (``row_args``, ``row_dims``, ``backward``, ``rtol``, ``atol``). The wrapper's ``canary`` is the op."""
    if not callable(fn):
        raise TypeError(f"canary_function {name!r}: fn must be callable, got {fn!r}")
    registered = _add(CanaryOp(name, reference, **options))

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return fn(*args, **kwargs)
        call, args = _open(registered, args)
        out = fn(*args, **kwargs)
        return out if call is None else _close(call, args, kwargs, out)

    checked.canary = registered  # type: ignore[attr-defined]
    return checked


def canary_module(name: str, module: nn.Module, reference: Callable[..., torch.Tensor], **options: Any) -> CanaryOp:
    """Register ``module`` as the canary op ``name``: its calls are recorded through a forward
    pre-hook and a forward hook (``op.remove()`` takes them off). ``reference`` takes the
    module's forward arguments (close over the module for its parameters)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"canary_module {name!r}: module must be an nn.Module, got {module!r}")
    registered = _add(CanaryOp(name, reference, module=module, **options))

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not _ACTIVE:
            return None
        call, tapped = _open(registered, args)
        if call is None:
            return None
        registered.opened.append(call)
        return tapped, kwargs

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not registered.opened:
            return None
        return _close(registered.opened.pop(), args, kwargs, out)

    registered.handles += [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    ]
    return registered


def select(patterns: Sequence[str] | None, name: str) -> bool:
    """Whether the op ``name`` is one ``patterns`` (shell patterns; None: every op) select."""
    from fnmatch import fnmatchcase

    return patterns is None or any(fnmatchcase(name, p) for p in patterns)
