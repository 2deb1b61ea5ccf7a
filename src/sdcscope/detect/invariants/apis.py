"""The two torch functions the recorder wraps, for as long as a recorder is attached.

Everything else is observed through hooks torch provides (module forward hooks, optimizer step
hooks) or through methods of the user's own objects (``zero_grad``, scheduler and scaler
methods).  Two facts have no hook:

- ``torch.nn.utils.clip_grad_norm_``: which tensors were clipped, to what norm, and the norm;
- ``torch.Tensor.backward``: that a backward pass runs, the loss it starts from, and (by
  comparing gradients before and after it) which parameters it gave a gradient.

Both are wrapped while at least one recorder is active and restored when the last one detaches
(TrainCheck instead wraps every function of ``torch``, which is where its 20-90x comes from).
A caller that bound ``clip_grad_norm_`` to a local name before attaching is not observed.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad


class Listener(Protocol):
    def on_clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                total: torch.Tensor) -> None: ...

    def on_backward_begin(self, root: torch.Tensor) -> None: ...

    def on_backward_end(self) -> None: ...


_lock = threading.Lock()
_listeners: list[Listener] = []
_originals: dict[str, Any] = {}
_CLIP_HOMES = (torch.nn.utils, torch.nn.utils.clip_grad)


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # Materialize once: a generator argument would otherwise be consumed by whoever looks first.
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = _originals["clip"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    for listener in list(_listeners):
        listener.on_clip(params, float(max_norm), float(norm_type), total)
    return total


def _backward(self, *args, **kwargs):
    listeners = list(_listeners)
    for listener in listeners:
        listener.on_backward_begin(self)
    result = _originals["backward"](self, *args, **kwargs)
    for listener in listeners:
        listener.on_backward_end()
    return result


def install(listener: Listener) -> None:
    with _lock:
        if not _listeners:
            _originals["clip"] = torch.nn.utils.clip_grad_norm_
            _originals["backward"] = torch.Tensor.backward
            for home in _CLIP_HOMES:
                home.clip_grad_norm_ = _clip_grad_norm_
            torch.Tensor.backward = _backward
        _listeners.append(listener)


def uninstall(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _originals:
            for home in _CLIP_HOMES:
                home.clip_grad_norm_ = _originals["clip"]
            torch.Tensor.backward = _originals["backward"]
            _originals.clear()
