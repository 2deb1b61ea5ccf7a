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
- ``metrics``: whatever the loop logs;
- ``resumed``: ``true`` on the record of the first update this recorder saw when the optimizer
  already held state then (moments, momentum buffers, a step count: loaded from a checkpoint), so
  the run continues one that trained before it, whatever its step numbers say (a new process may
  count from 0 again); absent otherwise.

Tensor-valued facts are kept on the device and fetched together at the end of the record, so a
step costs one device-to-host copy however many values it records.  Forwards and metrics seen
between steps form an ``eval`` record.  Backward and clipping are observed however they are
called (``torch.autograd.backward``, a ``clip_grad_norm_`` imported under a name of its own: see
``apis``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import compress
from operator import attrgetter, not_
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.engine.rundir import JsonlWriter
from sdcscope.invariants import apis, probe
from sdcscope.invariants.names import resolve, to_hex
from sdcscope.invariants.observers import Observers
from sdcscope.invariants.traceconfig import MODE_SENSITIVE, TRACE_FILE, TRACE_FORMAT, TraceConfig
from sdcscope.invariants.values import Pending, checksum, fetch

_VERSION = attrgetter("_version")


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


class TraceRecorder(Observers, EngineCallbacks):
    """Records calls, effects and checksums of one model + optimizer, step by step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        out: str | Path | None = None,
        schedulers: Iterable[Any] = (),
        scaler: Any = None,
        config: TraceConfig | None = None,
    ) -> None:
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
        watched = list(tensors) if spec is True else [] if spec is False else resolve(spec, list(tensors), "checksum")
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
        self._pending: list[Pending] = []
        self._finished: list[dict[str, Any]] = []
        self._step, self._done = -1, 0
        self._grad_mask = self._updated = 0
        self._cleared: int | None = None
        self._versions: list[int] = []  # the parameters' version counters when optimizer.step began
        self._expect: list[int] = []  # ... when the step began or optimizer.step last returned
        self._outside = 0  # parameters written in this step outside optimizer.step
        self._detached = [p.detach() for p in self._params]  # same storage: they see every update
        self._copies: list[torch.Tensor] | None = None  # the parameters before this optimizer.step
        self._moved: list[list] = []  # per optimizer.step: [bits of moved params, bit sums equal?]
        self._last_grads: tuple[list, list[int]] | None = None
        self._fwd: dict[str, Any] | None = None
        self._tokens: tuple[torch.Tensor, dict[str, Any]] | None = None  # last token input, its fields
        self._before: tuple[list, list[int] | None] | None = None
        self._step_call: int | None = None  # index of the open optimizer.step call in the record
        self._updates_seen = False  # whether an optimizer.step ran since attaching (see ``resumed``)
        self._decay_key: tuple | None = None
        self._decay_mask = 0
        self._probe = probe.CausalProbe(model) if self.config.causal_probe else None
        self._next_probe: int | None = None  # the first step the next causality probe may run at

    # -- header ------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        """What a trace needs to be read without the model: names, masks, shapes."""
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        return {
            "kind": "header",
            "format": TRACE_FORMAT,
            "rank": self.config.rank,
            "model": type(self.model).__name__,
            "optimizer": type(self.optimizer).__name__,
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
    def attach(self) -> TraceRecorder:
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
        self._handles += [
            m.register_forward_pre_hook(self._pre_forward),
            m.register_forward_hook(self._post_forward, with_kwargs=True),
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
        ]
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

    def __enter__(self) -> TraceRecorder:
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
            self._pend(torch.stack([checksum(t) for t in self._watched]), rec, "checksums", integer=True, vector=True)
        self._flush()
        updated = self._updated
        for bits, same in self._moved:
            updated |= sum(compress(bits, map(not_, same)))
        self._outside |= self._written_since(self._expect)
        rec["effects"] = {
            "grad": to_hex(self._grad_mask),
            "update": to_hex(updated),
            "cleared": None if self._cleared is None else to_hex(self._cleared),
            "outside": to_hex(self._outside),
        }
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

    # -- the open record (the observers in ``observers`` add to it) ---------------------------
    def _record(self) -> dict[str, Any]:
        if self._rec is None:
            self._rec = {"step": self._done, "phase": "eval", "calls": [], "metrics": {}}
        return self._rec

    def _call(self, api: str, fields: dict[str, Any]) -> None:
        self._record()["calls"].append([api, fields])

    # -- finishing records -------------------------------------------------------------------
    def _pend(
        self, t: torch.Tensor, target: dict | list, key: str | int, integer: bool = False, vector: bool = False
    ) -> None:
        self._pending.append((t.detach(), target, key, integer, vector))

    def _close_between(self) -> None:
        if self._rec is not None and not self._in_step:
            self._finish(self._rec)
            self._rec = None

    def _flush(self) -> None:
        if self._pending:
            fetch(self._pending)
            self._pending = []

    def _finish(self, rec: dict[str, Any]) -> None:
        self._flush()
        self._finished.append(rec)
        if self._writer is not None:
            self._writer.write(rec)

    def _drain(self) -> list[dict[str, Any]]:
        out, self._finished = self._finished, []
        return out
