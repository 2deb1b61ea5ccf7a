"""TraceRecorder: what happened in each training step, observed through hooks, at ~1 host sync.

Usable with any loop::

    rec = TraceRecorder(model, optimizer, out="runs/ref1", schedulers=[sched]).attach()
    for step in range(n):
        rec.step_begin(step)
        ...  # the user's own zero_grad / forward / backward / clip / step
        rec.log_metrics(loss=loss)          # optional, any scalars (tensors are fine)
        rec.step_end()
    rec.detach()

or as an engine callback (``trainer.add_callback(rec)``; see :class:`EngineCallbacks`).

Per step it records one compact dict (written to ``trace.jsonl`` when ``out`` is given):

- ``calls``: ``[api, fields]`` in call order (the API vocabulary is ``spec.APIS``), with cheap
  arguments and outputs (``training`` flags at forward, ``max_norm`` and the clipped parameter
  set at ``clip_grad_norm_``, the loss a backward starts from and the unscaled loss given to
  ``GradScaler.scale``, the learning rate of each param group at step: ``lr``, ``group1.lr``,
  ..., the parameters whose group applies a weight decay where others apply none: ``decayed``
  (absent when the decay is the same for all), whether a scheduler's step sets this optimizer's
  learning rates: ``drives_optimizer``, and at forward, how the targets of the loss computed
  on its output relate to its input: ``target_shift``, and now and then whether its outputs
  depend on later inputs: ``causal_leak``, see ``TraceConfig``); an
  ``optimizer.step(closure)`` is recorded where the closure returned, after the calls it made;
- ``effects``: bit masks over the parameters: got a gradient in backward (gradient identity and
  version counter before vs after each ``backward``: two C-level sweeps instead of one Python
  hook call per parameter), changed by ``optimizer.step`` (its version counter moved and, with
  ``confirm_updates``, its values differ from a copy taken before the step: rewriting the same
  values in place, as a learning rate of 0 does, is no update), gradient cleared before the first
  backward (``None`` grad or a grad written since the last step), written within the step but
  outside ``optimizer.step`` (``outside``: its version counter moved before the step, or after
  it: a weight decay applied by hand as well, a weight edited by mistake);
- ``checksums``: exact full-tensor checksums of the watched tensors (for ``Consistent``);
- ``grad_norms``: the 2-norm of each parameter's gradient when ``optimizer.step`` returned (the
  gradients the update used), with the mask of the parameters that had one (for ``GradShare``);
- ``metrics``: whatever the loop logs.

Tensor-valued facts are kept on the device and fetched together at the end of the record, so a
step costs one device-to-host copy however many values it records.  Forwards and metrics seen
between steps form an ``eval`` record.  Backward and clipping are observed however they are
called (``torch.autograd.backward``, a ``clip_grad_norm_`` imported under a name of its own: see
``apis``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not, ne, not_
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sdcscope.detect.invariants import apis, probe
from sdcscope.detect.invariants.names import resolve, to_hex
from sdcscope.engine.rundir import JsonlWriter
from sdcscope.observe._util import dense_values

TRACE_FILE = "trace.jsonl"
TRACE_FORMAT = "sdcscope-trace/1"
MODE_SENSITIVE = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
"""Modules that compute differently in train and eval mode; their ``training`` flag is recorded."""
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 16
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}
# Per-parameter bookkeeping runs through these with map(): C-level loops, not Python ones.
_GRAD, _VERSION, _TRAINING = attrgetter("grad"), attrgetter("_version"), attrgetter("training")


def _chunk_weights(n: int, device: torch.device) -> torch.Tensor:
    """The first n of the fixed chunk of odd weights (cached views of one tensor per device)."""
    w = _weights.get((n, device))
    if w is None:
        full = _weights.get((_CHUNK, device))
        if full is None:
            g = torch.Generator().manual_seed(0x5DC5C0)
            full = _weights[(_CHUNK, device)] = (torch.randint(-(2**61), 2**61, (_CHUNK,), generator=g)
                                                 * 2 + 1).to(device)
        w = _weights[(n, device)] = full[:n]
    return w


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Exact integer checksum of a tensor's bits: a 0-d int64 tensor, computed on its device.

    ``Σ bits_i · w_(i mod L) · c_(i div L)  mod 2^64`` with odd weights: flipping any bit of any
    element changes it (the product of odd weights is odd), it depends on positions, and
    integer addition makes it independent of reduction order, so equal tensors give equal
    checksums on any device.  Unlike a hash of the first row of values scaled by 1e8, nothing
    of the tensor is left out.  The weights are one fixed chunk of L, so memory stays bounded.
    """
    flat = (t.detach() if t.requires_grad else t).reshape(-1)
    if flat.dtype != torch.int64:
        if flat.dtype == torch.bool or flat.is_floating_point():
            flat = flat.view(_INT_VIEW[flat.element_size()])
        flat = flat.to(torch.int64)
    n = flat.numel()
    if n <= _CHUNK:
        return (flat * _chunk_weights(n, flat.device)).sum()
    rows = n // _CHUNK
    total = (flat[rows * _CHUNK:] * _chunk_weights(n - rows * _CHUNK, flat.device)).sum()
    per_row = (flat[:rows * _CHUNK].view(rows, _CHUNK) * _chunk_weights(_CHUNK, flat.device)).sum(dim=1)
    return total + (per_row * (torch.arange(rows, device=flat.device) * 2 + 3)).sum()


MAX_SHIFT = 3
"""The largest target shift looked for (see ``TraceConfig.target_shift``)."""
CONFIRM_EVERY = 4
"""With ``TraceConfig.confirm_updates``, updates are confirmed on every this-many-th step (the
others count a moved version counter): a parameter that stops changing is reported within that
many steps, at a quarter of the cost of copying and comparing every parameter each step."""
CAUSAL_EVERY = 10
"""Default steps between two causality probes (``TraceConfig.causal_probe``): a probe is one
forward of three sequences without gradients (~9% of a step of the tiny GPT at batch 16 on a
CPU, far less at real batch sizes), so under 1% of training, and two reference runs of 11 steps
give inference the support it needs (``InferConfig.min_support``).  A checker probes as often
as its ``Causal`` invariant says (``every``)."""


@dataclass(kw_only=True)
class TraceConfig:
    """What the recorder collects beyond the cheap always-on facts."""

    checksums: bool | tuple[str, ...] = True
    """Full-tensor checksums after each step: ``True`` every parameter and buffer (what
    inferring ``Consistent`` needs), a tuple of name patterns only those, ``False`` none."""
    input_fingerprint: bool = True
    """Checksum the model's first input at each forward (for "no batch repeats", and to tell a
    replay of the step from extra calls)."""
    target_shift: bool = True
    """For a forward on token ids, the shift k (0..``MAX_SHIFT``) at which the targets of the
    cross-entropy computed next equal the input (``target[..., :-k] == input[..., k:]``; 1 for
    next-token prediction, -1 for none): targets equal to the inputs (0) or shifted too far (2)
    train a model that learns nothing useful, at a normal-looking loss."""
    confirm_updates: bool = True
    """Count a parameter as updated by ``optimizer.step`` only if its values changed (a copy of
    the parameters before the step, compared after it: three fused passes, no per-parameter
    Python), on steps ``step % CONFIRM_EVERY == 0``; elsewhere and with ``False`` a moved version
    counter is enough (no data read)."""
    causal_probe: int = CAUSAL_EVERY
    """For a training forward on token ids (``[B, T]`` integers) that returns per-position
    outputs (``[B, T, ...]``): on the first such step and then every this-many steps, re-run the
    model on one sequence of the batch and on copies with the tokens from a cut t on replaced,
    and record at that forward how much its outputs before t changed relative to those from t
    on: ``causal_leak`` (0 for an autoregressive model), with ``causal_cut`` (t), ``causal_pos``
    (the output position that changed most) and ``causal_len`` (T); see ``probe``.  0: never.
    Costs one forward of a few sequences, without gradients, per probe."""
    grad_norms: bool = True
    """Record each parameter's gradient norm when ``optimizer.step`` returns: the gradients the
    update used, after every micro-batch, clipping and a GradScaler's unscaling (and after a
    closure ran).  One fused ``torch._foreach_norm`` pass over the gradients per step, fetched
    with the record's other values: far cheaper than the backward that made them."""
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.checksums, bool):
            if isinstance(self.checksums, str) or not all(isinstance(p, str) for p in self.checksums):
                raise TypeError(f"checksums must be a bool or a tuple of name patterns, "
                                f"not {self.checksums!r}")
            self.checksums = tuple(self.checksums)
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank={self.rank!r} must be an integer >= 0")
        every = self.causal_probe
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"causal_probe={self.causal_probe!r} must be an integer >= 0 "
                             "(probe every this many steps; 0: never)")


def _no_fields(*args, **kwargs) -> dict[str, Any]:
    return {}


def _zero_grad_fields(on: str) -> Callable[..., dict]:
    def fields(set_to_none: bool = True) -> dict[str, Any]:
        return {"on": on, "set_to_none": bool(set_to_none)}
    return fields


class EngineCallbacks:
    """Adapter from the engine's callback points to ``step_begin``/``step_end``/``eval_end``."""

    def before_step(self, ctx) -> None:
        self.step_begin(ctx.step)

    def after_step(self, ctx) -> None:
        self.log_metrics(ctx.metrics)
        self.step_end()

    def on_evaluate(self, result: dict) -> None:
        self.log_metrics(result)
        self.eval_end()


class TraceRecorder(EngineCallbacks):
    """Records calls, effects and checksums of one model + optimizer, step by step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 out: str | Path | None = None, schedulers: Iterable[Any] = (),
                 scaler: Any = None, config: TraceConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.schedulers, self.scaler = list(schedulers), scaler
        self.config = config or TraceConfig()
        self.out = None if out is None else Path(out)
        named = list(model.named_parameters())
        self.param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._bits = [1 << i for i in range(len(self._params))]
        self._bit = {id(p): b for p, b in zip(self._params, self._bits)}
        self._all = sum(self._bits)
        tensors = dict(named)
        tensors.update((n, b) for n, b in model.named_buffers() if b.dtype != torch.bool)
        spec = self.config.checksums
        watched = (list(tensors) if spec is True else [] if spec is False
                   else resolve(spec, list(tensors), "checksum"))
        self.watched_names = watched
        self._watched = [tensors[n] for n in watched]
        self._mode_names: dict[str, list[str]] = {}
        self._mode_groups: dict[str, list[nn.Module]] = {}
        for name, m in model.named_modules():
            if isinstance(m, MODE_SENSITIVE):
                key = f"{type(m).__name__}.training"
                self._mode_names.setdefault(key, []).append(name)
                self._mode_groups.setdefault(key, []).append(m)
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, bool, Any]] = []
        self._writer: JsonlWriter | None = None
        self._attached = False
        self._in_step = False
        self._rec: dict[str, Any] | None = None
        self._pending: list[tuple[torch.Tensor, dict, str, bool, bool]] = []
        self._finished: list[dict[str, Any]] = []
        self._step, self._done = -1, 0
        self._grad_mask = self._updated = 0
        self._cleared: int | None = None
        self._versions: list[int] = []   # the parameters' version counters when optimizer.step began
        self._expect: list[int] = []     # ... when the step began or optimizer.step last returned
        self._outside = 0                # parameters written in this step outside optimizer.step
        self._detached = [p.detach() for p in self._params]   # same storage: they see every update
        self._copies: list[torch.Tensor] | None = None          # the parameters before this optimizer.step
        self._moved: list[list] = []  # per optimizer.step: [bits of moved params, bit sums equal?]
        self._last_grads: tuple[list, list[int]] | None = None
        self._fwd: dict[str, Any] | None = None
        self._tokens: tuple[torch.Tensor, dict[str, Any]] | None = None  # last token input, its fields
        self._before: tuple[list, list[int] | None] | None = None
        self._step_call: int | None = None   # index of the open optimizer.step call in the record
        self._decay_key: tuple | None = None
        self._decay_mask = 0
        self._probe = probe.CausalProbe(model) if self.config.causal_probe else None
        self._next_probe: int | None = None   # the first step the next causality probe may run at

    # -- header ------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        """What a trace needs to be read without the model: names, masks, shapes."""
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return {
            "kind": "header", "format": TRACE_FORMAT, "rank": self.config.rank,
            "model": type(self.model).__name__, "optimizer": type(self.optimizer).__name__,
            "params": self.param_names,
            "trainable": to_hex(sum(self._bit[id(p)] for p in self._params if p.requires_grad)),
            "in_optimizer": to_hex(sum(self._bit[id(p)] for p in self._params if id(p) in in_opt)),
            "watched": self.watched_names,
            "shapes": [list(t.shape) for t in self._watched],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in self._watched],
            "mode_modules": self._mode_names,
            "schedulers": [type(s).__name__ for s in self.schedulers],
            "scaler": self.scaler is not None,
        }

    # -- attach / detach ---------------------------------------------------------------------
    def attach(self) -> "TraceRecorder":
        if self._attached:
            raise ValueError("this recorder is already attached")
        if self.out is not None:
            path = self.out / TRACE_FILE
            if path.exists() and path.stat().st_size:
                raise ValueError(f"{str(path)!r} already exists; give a new run directory")
            self.out.mkdir(parents=True, exist_ok=True)
            self._writer = JsonlWriter(path)
            self._writer.write(self.header())
        m, opt = self.model, self.optimizer
        self._handles += [m.register_forward_pre_hook(self._pre_forward),
                          m.register_forward_hook(self._post_forward, with_kwargs=True),
                          opt.register_step_pre_hook(self._pre_step),
                          opt.register_step_post_hook(self._post_step)]
        self._wrap(opt, "zero_grad", "zero_grad", _zero_grad_fields("optimizer"))
        self._wrap(m, "zero_grad", "zero_grad", _zero_grad_fields("model"))
        for s in self.schedulers:
            self._wrap(s, "step", "lr_scheduler.step", self._drives(s))
        if self.scaler is not None:
            self._wrap(self.scaler, "scale", "scaler.scale", self._scale_fields)
            for name in ("unscale_", "step", "update"):
                self._wrap(self.scaler, name, f"scaler.{name}")
        apis.install(self)
        self._attached = True
        return self

    def detach(self) -> list[dict[str, Any]]:
        """Remove every hook and wrapper; return the records finished by detaching."""
        if self._in_step:
            self.step_end()
        self._close_between()
        if self._attached:
            apis.uninstall(self)
            for h in self._handles:
                h.remove()
            for obj, name, had, prev in reversed(self._restore):
                if had:
                    setattr(obj, name, prev)
                else:
                    delattr(obj, name)
            self._handles, self._restore = [], []
            self._attached = False
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self._drain()

    def __enter__(self) -> "TraceRecorder":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _wrap(self, obj: Any, name: str, api: str, fields: Callable[..., dict] = _no_fields) -> None:
        """Shadow one method of the user's object (not of its class) with a recording wrapper;
        ``fields(*args, **kwargs)`` gives the call's fields."""
        had = name in vars(obj)
        orig = getattr(obj, name)

        def wrapper(*args, **kwargs):
            self._call(api, fields(*args, **kwargs))
            return orig(*args, **kwargs)

        self._restore.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, wrapper)

    def _drives(self, scheduler: Any) -> Callable[..., dict]:
        """Fields of a scheduler's step: whether it sets the learning rates of the optimizer
        being trained (its optimizer's param groups are this one's: true through an optimizer
        wrapper too; false when the optimizer was rebuilt after the scheduler was made)."""
        def fields(*args, **kwargs) -> dict[str, Any]:
            groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
            return {"drives_optimizer": None if groups is None else groups is self.optimizer.param_groups}
        return fields

    def _scale_fields(self, outputs: Any, *args, **kwargs) -> dict[str, Any]:
        """``GradScaler.scale``: the loss before scaling (the backward sees it times the scale)."""
        fields: dict[str, Any] = {}
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            self._pend(outputs, fields, "loss")
        return fields

    # -- step boundaries ---------------------------------------------------------------------
    def step_begin(self, step: int | None = None) -> None:
        if self._in_step:
            raise ValueError(f"step_begin({step}) while step {self._step} is open: call step_end() first")
        self._close_between()
        self._step = self._step + 1 if step is None else int(step)
        self._rec = {"step": self._step, "phase": "train", "calls": [], "metrics": {}}
        self._in_step = True
        self._grad_mask = self._updated = 0
        self._moved = []
        self._cleared = None
        self._expect, self._outside = list(map(_VERSION, self._params)), 0

    def step_end(self) -> list[dict[str, Any]]:
        """Close the step; return the records finished since the last call (eval, then step)."""
        if not self._in_step:
            raise ValueError("step_end() without step_begin()")
        rec = self._rec
        if self._watched:
            self._pend(torch.stack([checksum(t) for t in self._watched]), rec, "checksums",
                       integer=True, vector=True)
        self._flush()
        updated = self._updated
        for bits, same in self._moved:
            updated |= sum(compress(bits, map(not_, same)))
        self._outside |= self._written_since(self._expect)
        rec["effects"] = {"grad": to_hex(self._grad_mask), "update": to_hex(updated),
                          "cleared": None if self._cleared is None else to_hex(self._cleared),
                          "outside": to_hex(self._outside)}
        self._finish(rec)
        self._last_grads = self._grad_snapshot()
        self._in_step, self._rec = False, None
        self._done = self._step + 1
        return self._drain()

    def abandon_step(self) -> None:
        """Close the step without a record: its effects were discarded (a guard vetoed it or
        rolled the run back), so it is no evidence about the training loop."""
        if not self._in_step:
            raise ValueError("abandon_step() without step_begin()")
        self._pending = []  # all of them belong to this step: step_begin resolved the others
        self._last_grads = self._grad_snapshot()
        self._in_step, self._rec = False, None
        self._done = self._step + 1

    def eval_end(self) -> list[dict[str, Any]]:
        """Close the between-steps (evaluation) record, if one is open."""
        self._close_between()
        return self._drain()

    def log_metrics(self, metrics: dict[str, Any] | None = None, **more: Any) -> None:
        """Scalars for this step (or for the evaluation between steps); bools and 'step' skipped."""
        rec = self._record()
        for key, value in {**(metrics or {}), **more}.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                self._pend(value, rec["metrics"], key)
            elif isinstance(value, (int, float)):
                rec["metrics"][key] = float(value)

    # -- observers ---------------------------------------------------------------------------
    def _record(self) -> dict[str, Any]:
        if self._rec is None:
            self._rec = {"step": self._done, "phase": "eval", "calls": [], "metrics": {}}
        return self._rec

    def _call(self, api: str, fields: dict[str, Any]) -> None:
        self._record()["calls"].append([api, fields])

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if probe.running():   # a causality probe's forward (this recorder's or another's)
            return
        fields: dict[str, Any] = {"training": module.training}
        for key, mods in self._mode_groups.items():
            flags = set(map(_TRAINING, mods))
            fields[key] = flags.pop() if len(flags) == 1 else "mixed"
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.config.input_fingerprint and x is not None:
            self._pend(checksum(x), fields, "input", integer=True)
        if self.config.target_shift:
            tokens = x is not None and x.ndim > 0 and x.shape[-1] > MAX_SHIFT and not x.is_floating_point()
            self._tokens = (x, fields) if tokens else None
        self._fwd = fields
        self._call("forward", fields)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if probe.running():
            return
        if isinstance(output, torch.Tensor) and self._fwd is not None:
            self._fwd["out.dtype"] = str(output.dtype).removeprefix("torch.")
        if self._fwd is not None and self._probe is not None and self._in_step:
            self._causal(args, kwargs, output, self._fwd)
        self._fwd = None

    def _causal(self, args: tuple, kwargs: dict, output: Any, fields: dict[str, Any]) -> None:
        """The causality probe, on the first training forward on token ids of a step that is due
        (the first one seen, then every ``causal_probe`` steps); see ``probe``."""
        if self._next_probe is not None and self._step < self._next_probe:
            return
        where = probe.token_arg(args, kwargs)   # positional, or model(input_ids=...)
        x = probe.token_input(args, kwargs)
        found = None if x is None else self._probe(x, args, kwargs, output, where)
        if found is None:
            return
        self._next_probe = self._step + self.config.causal_probe
        self._pend(found["leak"], fields, "causal_leak")
        self._pend(found["cut"], fields, "causal_cut", integer=True)
        self._pend(found["pos"], fields, "causal_pos", integer=True)
        fields["causal_len"] = found["len"]

    def on_targets(self, target: Any) -> None:
        """The targets of a cross-entropy, against the last forward's token input (once)."""
        if self._tokens is None or probe.running():
            return
        (x, fields), self._tokens = self._tokens, None
        if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.numel() != x.numel():
            return
        n = x.shape[-1]
        x, y = x.reshape(-1, n), target.reshape(-1, n).to(x.device)
        windows = x.unfold(-1, n - MAX_SHIFT, 1)   # windows[:, k] = x[:, k:k + n - MAX_SHIFT], a view
        match = (windows == y[:, None, :n - MAX_SHIFT]).all(-1).all(0)
        self._pend(torch.where(match.any(), match.int().argmax(), -1), fields, "target_shift", integer=True)

    def on_backward_begin(self, root: torch.Tensor | None) -> None:
        if not self._in_step:
            return
        fields: dict[str, Any] = {}
        if root is not None and root.numel() == 1:
            self._pend(root, fields, "loss")
        grads = list(map(_GRAD, self._params))
        none = not any(map(is_not, grads, repeat(None)))
        if self._cleared is None:
            self._cleared = self._cleared_mask(grads, none)
        self._before = grads, None if none else [-1 if g is None else g._version for g in grads]
        self._call("backward", fields)

    def on_backward_end(self) -> None:
        """Parameters whose gradient this backward created or accumulated into."""
        if self._before is None:
            return
        (before, versions), self._before = self._before, None
        after = list(map(_GRAD, self._params))
        if versions is None:  # no gradient existed: every gradient there now is this backward's
            self._grad_mask |= sum(compress(self._bits, map(is_not, after, repeat(None))))
        else:
            self._grad_mask |= sum(bit for a, b, v, bit in zip(after, before, versions, self._bits)
                                   if a is not None and (a is not b or a._version != v))

    def _grad_snapshot(self) -> tuple[list, list[int]]:
        """Weak references to the gradients and their versions (weak: holding the gradients
        would keep them alive after ``zero_grad(set_to_none=True)`` and raise peak memory)."""
        grads = list(map(_GRAD, self._params))
        if all(map(is_not, grads, repeat(None))):
            return list(map(weakref.ref, grads)), list(map(_VERSION, grads))
        return ([None if g is None else weakref.ref(g) for g in grads],
                [0 if g is None else g._version for g in grads])

    def _cleared_mask(self, grads: list, none: bool) -> int:
        """Parameters whose gradient is None, or was written, since the previous step ended
        (with no previous step to compare with, every gradient counts as cleared)."""
        if none or self._last_grads is None:
            return self._all
        refs, versions = self._last_grads
        return sum(bit for g, bit, ref, v in zip(grads, self._bits, refs, versions)
                   if g is None or ref is None or ref() is not g or g._version != v)

    def on_clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float | None,
                total: torch.Tensor) -> None:
        if not self._in_step:
            return
        mask = sum(set(map(self._bit.get, map(id, params), repeat(0))))  # a set: listed twice counts once
        if not mask:
            return  # another model's parameters
        fields = {"max_norm": max_norm, "params": to_hex(mask)}
        if norm_type is not None:   # None: an aliased clip_grad_norm_, whose norm type is not seen
            fields["norm_type"] = norm_type
        self._pend(total, fields, "out")
        self._call("clip_grad_norm_", fields)

    def _written_since(self, versions: list[int]) -> int:
        """The parameters whose version counter moved since ``versions`` were taken."""
        return sum(compress(self._bits, map(ne, map(_VERSION, self._params), versions)))

    def _pre_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._in_step:
            self._outside |= self._written_since(self._expect)
        self._versions = list(map(_VERSION, self._params))
        if self.config.confirm_updates and self._step % CONFIRM_EVERY == 0:
            self._copies = torch._foreach_clone(self._detached)
        fields: dict[str, Any] = {}
        for i, group in enumerate(opt.param_groups):
            key, lr = "lr" if i == 0 else f"group{i}.lr", group["lr"]
            if isinstance(lr, torch.Tensor):
                self._pend(lr, fields, key)
            else:
                fields[key] = float(lr)
        decayed = self._decayed(opt.param_groups)
        if decayed:
            fields["decayed"] = to_hex(decayed)
        self._call("optimizer.step", fields)
        self._step_call = len(self._record()["calls"]) - 1

    def _decayed(self, groups: list[dict[str, Any]]) -> int:
        """The parameters whose param group applies a weight decay where other groups apply none;
        0 when the decay is the same for all (cached while the groups' membership and decays
        stay the same: one pass over the parameters when they change)."""
        key = tuple((id(g["params"]), len(g["params"]), g.get("weight_decay")) for g in groups)
        if self._decay_key != key:
            self._decay_key = key
            decayed = sum({self._bit.get(id(p), 0) for g in groups if g.get("weight_decay") for p in g["params"]})
            every = sum({self._bit.get(id(p), 0) for g in groups for p in g["params"]})
            self._decay_mask = decayed if decayed != every else 0
        return self._decay_mask

    def _post_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        calls = self._record()["calls"]
        if self._step_call is not None and self._step_call < len(calls) - 1:
            # A closure (optimizer.step(closure)) ran the forward and backward inside the step:
            # the update is applied when it returns, so that is where the step stands in the order.
            calls.append(calls.pop(self._step_call))
        self._step_call = None
        self._expect = list(map(_VERSION, self._params))
        moved = list(map(ne, self._expect, self._versions))
        if self._copies is None:
            self._updated |= sum(compress(self._bits, moved))
        elif any(moved):  # written: changed? resolved with the record
            diff = torch._foreach_sub(list(compress(self._detached, moved)), list(compress(self._copies, moved)))
            norms = torch._foreach_norm(diff)   # 0 where every value is the same (the 2-norm is the fast
            try:                                # one; only changes below ~1e-22 would underflow)
                same = torch.stack(norms) == 0
            except RuntimeError:   # parameters on several devices
                same = torch.stack([(n == 0).cpu() for n in norms])
            entry = [list(compress(self._bits, moved)), None]
            self._pend(same, entry, 1, integer=True, vector=True)
            self._moved.append(entry)
        self._copies = None
        if self.config.grad_norms and self._in_step:
            self._grad_norms()

    def _grad_norms(self) -> None:
        """The record's ``grad_norms``: ``{"params": mask of the parameters with a gradient,
        "norms": their gradients' 2-norms}`` (the last ``optimizer.step`` of the step wins)."""
        grads = list(map(_GRAD, self._params))
        have = list(map(is_not, grads, repeat(None)))
        present = list(compress(grads, have))
        if not present:
            return
        norms = torch._foreach_norm(dense_values(present), 2, dtype=torch.float32)
        try:
            stacked = torch.stack(norms)
        except RuntimeError:   # gradients on several devices
            stacked = torch.stack([n.to(norms[0].device) for n in norms])
        entry: dict[str, Any] = {"params": to_hex(sum(compress(self._bits, have)))}
        self._pend(stacked, entry, "norms", vector=True)
        self._record()["grad_norms"] = entry

    # -- finishing records -------------------------------------------------------------------
    def _pend(self, t: torch.Tensor, target: dict | list, key: str | int, integer: bool = False,
              vector: bool = False) -> None:
        self._pending.append((t.detach(), target, key, integer, vector))

    def _close_between(self) -> None:
        if self._rec is not None and not self._in_step:
            self._finish(self._rec)
            self._rec = None

    def _flush(self) -> None:
        if self._pending:
            self._resolve(self._pending)
            self._pending = []

    def _finish(self, rec: dict[str, Any]) -> None:
        self._flush()
        self._finished.append(rec)
        if self._writer is not None:
            self._writer.write(rec)

    @staticmethod
    def _resolve(pending: list[tuple[torch.Tensor, dict, str, bool, bool]]) -> None:
        """Fetch the pending values.  On an accelerator, all with one device-to-host copy
        (floats travel as the bits of float64 in an int64 buffer); on the CPU, where reading a
        value costs no synchronization, directly (cheaper than building the buffer)."""
        if all(t.device.type == "cpu" for t, *_ in pending):
            for t, target, key, _, vector in pending:
                target[key] = t.tolist() if vector else t.item()
            return
        device = pending[0][0].device
        floats = [p for p in pending if not p[3]]
        ints = [p for p in pending if p[3]]
        parts = [t.reshape(-1).to(device, torch.float64).view(torch.int64) for t, *_ in floats]
        parts += [t.reshape(-1).to(device, torch.int64) for t, *_ in ints]
        buf = torch.cat(parts).cpu().numpy()
        n_float = sum(t.numel() for t, *_ in floats)
        values = buf[:n_float].view(np.float64).tolist() + buf[n_float:].tolist()
        i = 0
        for t, target, key, _, vector in floats + ints:
            n = t.numel()
            target[key] = values[i:i + n] if vector else values[i]
            i += n

    def _drain(self) -> list[dict[str, Any]]:
        out, self._finished = self._finished, []
        return out
