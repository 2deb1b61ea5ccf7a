"""The torch functions the recorder wraps, for as long as a recorder is attached.

Everything else is observed through hooks torch provides (module forward hooks, optimizer step
hooks) or through methods of the user's own objects (``zero_grad``, scheduler and scaler
methods).  Three facts have no hook:

- gradient clipping: which tensors were clipped, to what norm, and the norm;
- ``torch.autograd.backward``: that a backward pass runs, the loss it starts from, and (by
  comparing gradients before and after it) which parameters it gave a gradient;
- ``torch.nn.functional.cross_entropy`` (which ``nn.CrossEntropyLoss`` calls too): the targets
  a loss is computed against, to compare with the model's input.  Called under a name bound
  before attaching, it goes unobserved (its facts are then missing, never wrong).

A caller may hold either function under a name of its own (``from torch.nn.utils import
clip_grad_norm_`` at import time), and a backward may be started without ``Tensor.backward``
(``torch.autograd.backward(loss)``), so the wrappers sit where every call passes through, not
(only) where callers look the function up:

- ``torch.autograd.backward``, which ``Tensor.backward`` calls too: one wrapper sees both, so
  a backward is recorded once.  A backward started while another one runs (reentrant
  activation checkpointing runs one inside the backward of each checkpointed segment, on
  whichever thread autograd runs it) is part of the outer one and is not recorded again;
- ``torch.nn.utils.clip_grad._clip_grads_with_norm_``, the private function that
  ``clip_grad_norm_`` calls to scale the gradients, under whatever name it was called: it is
  given the parameters, ``max_norm`` and the total norm.  The public ``clip_grad_norm_`` is
  wrapped as well: it lends the call its ``norm_type`` (an aliased call is recorded without
  it), and records the call itself when the private function did not see it (a torch without
  it, where an aliased call goes unobserved).

The wrappers are installed while at least one recorder is active and restored when the last
one detaches (TrainCheck instead wraps every function of ``torch``, which is where its 20-90x
comes from).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
import torch.autograd
import torch.nn.functional
import torch.nn.utils
import torch.nn.utils.clip_grad


class Listener(Protocol):
    def on_targets(self, target: Any) -> None: ...

    def on_clip(
        self, params: list[torch.Tensor], max_norm: float, norm_type: float | None, total: torch.Tensor
    ) -> None: ...

    def on_backward_begin(self, root: torch.Tensor | None) -> None: ...

    def on_backward_end(self) -> None: ...


_lock = threading.Lock()
_listeners: list[Listener] = []
_originals: dict[str, Any] = {}
_CLIP_HOMES = (torch.nn.utils, torch.nn.utils.clip_grad)
_CLIP_SCALE = "_clip_grads_with_norm_"
_SCALE_HOOK = hasattr(torch.nn.utils.clip_grad, _CLIP_SCALE)
_state = threading.local()  # of the wrapped clip_grad_norm_ call running on this thread:
# its norm_type, and whether the scaling wrapper recorded it
_running = [0]  # backward passes running (any thread): >0 means reentrant


def _notify_clip(params: list[torch.Tensor], max_norm: Any, norm_type: float | None, total: torch.Tensor) -> None:
    for listener in list(_listeners):
        listener.on_clip(params, float(max_norm), norm_type, total)


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # Materialize once: a generator argument would otherwise be consumed by whoever looks first.
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _state.norm_type, _state.recorded = float(norm_type), False
    try:
        total = _originals["clip"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    finally:
        _state.norm_type, recorded = None, _state.recorded
    if not recorded:  # this torch scaled the gradients some other way
        _notify_clip(params, max_norm, float(norm_type), total)
    return total


def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _originals["scale"](params, max_norm, total_norm, foreach)
    _state.recorded = True
    _notify_clip(params, max_norm, getattr(_state, "norm_type", None), total_norm)


def _cross_entropy(input, target, *args, **kwargs):
    for listener in list(_listeners):
        listener.on_targets(target)
    return _originals["cross_entropy"](input, target, *args, **kwargs)


def _root(tensors: Any) -> torch.Tensor | None:
    """The one tensor a backward starts from (None for several, or for gradient edges)."""
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
        tensors = tensors[0]
    return tensors if isinstance(tensors, torch.Tensor) else None


def _backward(tensors, *args, **kwargs):
    if _running[0]:
        return _originals["backward"](tensors, *args, **kwargs)
    if not isinstance(tensors, (torch.Tensor, list, tuple)):
        tensors = tuple(tensors)  # a generator: looked at here, then given to torch
    listeners = list(_listeners)
    for listener in listeners:
        listener.on_backward_begin(_root(tensors))
    _running[0] += 1
    try:
        result = _originals["backward"](tensors, *args, **kwargs)
    finally:
        _running[0] -= 1
    for listener in listeners:
        listener.on_backward_end()
    return result


def install(listener: Listener) -> None:
    with _lock:
        if not _listeners:
            _originals["clip"] = torch.nn.utils.clip_grad_norm_
            _originals["backward"] = torch.autograd.backward
            for home in _CLIP_HOMES:
                home.clip_grad_norm_ = _clip_grad_norm_
            if _SCALE_HOOK:
                _originals["scale"] = getattr(torch.nn.utils.clip_grad, _CLIP_SCALE)
                setattr(torch.nn.utils.clip_grad, _CLIP_SCALE, _clip_grads_with_norm_)
            torch.autograd.backward = _backward
            _originals["cross_entropy"] = torch.nn.functional.cross_entropy
            torch.nn.functional.cross_entropy = _cross_entropy
        _listeners.append(listener)


def uninstall(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _originals:
            for home in _CLIP_HOMES:
                home.clip_grad_norm_ = _originals["clip"]
            if _SCALE_HOOK:
                setattr(torch.nn.utils.clip_grad, _CLIP_SCALE, _originals["scale"])
            torch.autograd.backward = _originals["backward"]
            torch.nn.functional.cross_entropy = _originals["cross_entropy"]
            _originals.clear()
