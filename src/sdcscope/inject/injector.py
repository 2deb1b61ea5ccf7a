"""Attach fault specs to a live model and optimizer through removable hooks.

Sites and how they are reached (all hooks are removed by :meth:`Injector.detach`):

==================  ==========================================================================
activation          forward hook on the module: its output is replaced (of a tuple, list or dict
                    output: the first floating-point tensor, :func:`~sdcscope.inject.targets.primary_output`)
gemm.forward        forward hook on a GEMM module (Linear, Conv, ConvTranspose, ``is_matmul``): Y is
                    replaced; with pattern ``mac_cell`` (not on ConvTranspose) the *weight operand*
                    of cell (a, b) is faulted in
                    the computation only (NVDLA software error model), Y gets exactly that error;
                    with an ``array`` the random cell is the same for every targeted GEMM, and a
                    ``swizzle: per_step`` mapping follows the injector's step (evaluation at step
                    t uses the mapping of step t)
gemm.grad_input     dX (for ``a @ b``: d a) is replaced by a post-hook on the call's autograd node
                    that hands it on (:func:`~sdcscope.inject.targets.operand_grad_edge`: the
                    ``addmm``/``mm`` of an ``nn.Linear``, a Conv's ``Convolution``, ...), in the
                    GEMM's compute dtype (bf16 under autocast), before any observer of the
                    operand sees it; the output is left alone, so an in-place op after the
                    module (``ReLU(inplace=True)``) stays legal. A call autograd does not
                    record (``torch.no_grad()``, a reentrant checkpoint's first pass) has no dX;
                    a checkpoint's recompute gets the fault
gemm.grad_weight    this GEMM's dW: a hook on the call's own autograd node that hands dW to the
                    weight, before it is summed with the weight's other uses and accumulated
                    into ``.grad``; for ``a @ b``: d b, as dX above
weight              memory fault on the parameter, applied before the forward of the event;
                    a permanent fault is re-applied after every optimizer update
param_grad          post-accumulate-grad hook of the step's last micro-batch: the ``.grad``
                    buffer summed over all micro-batches, as clipping and the optimizer read it
                    (the injector learns ``grad_accum`` from the engine callback, or pass it);
                    a sparse ``.grad`` (``nn.Embedding(sparse=True)``) is the rows it stores:
                    the pattern is resolved on its coalesced values, recorded at the
                    parameter's flat indices
optimizer_state     memory fault on the state tensors with a value per element (``exp_avg``, …;
                    never the ``step`` counter) resident between updates, applied at the start
                    of the step whose update reads them; a permanent fault is re-applied after
                    every update
==================  ==========================================================================

Whether a fault fires is :func:`sdcscope.faults.fires` of (spec, step, micro-batch, name, rank).
A call whose output is empty (an MoE expert routed no token) computes nothing and takes no fault:
a transient fault waits for the module's next call with work to do. A module called several
times in one micro-batch (a shared layer) is one site visited several times: a transient or intermittent fault is one event in time and corrupts only the *first* call
of the module at its position (for the backward sites: the first backward call, usually the
gradient of the module's *last* forward call); a permanent fault (a broken unit) corrupts every
call, each logged with its ``call`` index. Calls are numbered as ABFT numbers them
(``evidence["call"]`` of its events), so that an event and the fault behind it name the same
call: ``call`` is the 0-based index of the module's forward call within the micro-batch, in
forward order, and the backward sites carry the index of the forward call whose gradient they
corrupt (the dX or dW of forward call i is call i), whatever order the backward runs them in.
A forward re-run by activation checkpointing (a forward inside the backward pass) is no new call:
it gets the same corruption as the call it recomputes and is not logged again; the gradients of
a reentrant checkpoint's recompute (whose first pass recorded no graph) are logged with ``call``
None.
A training loop tells the injector where it is with :meth:`Injector.set_position`; the engine
does it through :meth:`Injector.callback`. A transient or intermittent fault is one event in
time: a re-execution of its step (a guard's replay, or training again after a rollback) does
not meet it again; a permanent fault (a broken unit, a stuck bit) acts on every execution.
A run resumed from its checkpoint (``resumed_at``) restored its weights and optimizer state
with its permanent memory faults in place: they are known as such, not applied again (a bit
flip applied twice would undo itself).

Records (``injections.jsonl``, :attr:`Injector.records`): one per fault application, with
``when``: ``"train"`` (an event of a training step), ``"after_update"`` (a permanent ``weight``
/ ``optimizer_state`` fault re-applied to the values an optimizer update wrote; logged only
when it changed a value bitwise) or ``"eval"`` (an evaluation pass: permanent faults only,
memory faults logged only when they changed a value; one record per spec and module per
evaluation at a step, however many batches it runs); and ``call``: for the module sites, the
0-based index of the module's forward call within the micro-batch (see above; None for the
parameter sites). Evaluation records
never suppress or replace training ones; count training injections as the records whose
``when`` is not ``"eval"``. A re-execution (:func:`reexecution`: its permanent faults act
again) logs nothing; training a step again after a rollback logs only events its first
execution did not.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope._io import JsonlWriter
from sdcscope.faults import STEP_SITES, FaultResult, FaultSpec, FaultSpecError, apply_spec, fault_generator, fires
from sdcscope.inject.targets import (CHANNELS_FIRST, MODULE_SITES, UNREACHED, Target, element_state, in_backward,
                                     operand_channel_dims, operand_grad_edge, primary_output, validate_specs,
                                     weight_grad_edge)

_REEXECUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("sdcscope_reexecuting", default=False)


@contextlib.contextmanager
def reexecution() -> Iterator[None]:
    """Mark a re-execution of a step (a guard's replay or recompute). A transient or
    intermittent fault was one event in time and does not recur; a permanent one (a broken
    unit) acts again. Every injector in the process honours it."""
    token = _REEXECUTING.set(True)
    try:
        yield
    finally:
        _REEXECUTING.reset(token)


MEMORY_SITES = ("weight", "optimizer_state")
MAC_ARRAY = "<mac-array>"
"""The name a ``mac_cell`` pattern with an ``array`` keys its fault generator on (one unit)."""
MAX_RECORDED = 64
"""Elements listed per record (a row or tensor-wide fault can hit thousands); ``count`` says all."""


class _Replace(torch.autograd.Function):
    """Forward returns the faulty tensor bit for bit; backward passes the gradient straight
    through (the corruption happened after the operation that produced the value)."""

    @staticmethod
    def forward(ctx, clean, faulty):  # noqa: D401
        return faulty.clone()   # a new tensor, not an input: an in-place op after it (ReLU(inplace=True)) is fine

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _replaced(clean: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
    return _Replace.apply(clean, faulty) if clean.requires_grad else faulty


def _in_backward() -> bool:
    """Whether this runs inside the autograd engine (a forward here is a checkpoint recompute)."""
    return in_backward()


def _changed(result) -> bool:
    """Whether a fault application changed at least one value, bit for bit."""
    before, after = result.before.reshape(-1), result.after.reshape(-1)
    if before.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[before.element_size()]
        before, after = before.view(ints), after.view(ints)
    return not torch.equal(before, after)


class Injector:
    """Holds fault specs for one model (and optimizer) on one rank.

    Use as a context manager (``with Injector(model, specs, optimizer) as inj:``) or call
    :meth:`attach` / :meth:`detach`. On exit every hook is gone; values already corrupted
    (a weight, an optimizer state) stay corrupted, as they would on the hardware.

    ``resumed_at``: the step a run resumed from a checkpoint that its own training, with these
    specs, wrote after step ``resumed_at - 1`` (0: a new run). The permanent memory faults that
    started before it are in the restored values already: they are marked in place, not applied
    again, so the resumed run goes on bitwise as the uninterrupted one.

    ``probe``: :func:`~sdcscope.inject.targets.probe_model` of the training's forward (under its
    autocast, if any), so a spec that does not fit a module's output or input gradient is refused
    here, as the CLI does; without it those are known only when the fault fires, and raise
    :class:`~sdcscope.faults.FaultSpecError` naming the spec, module, dtype and step then.
    Parameters, optimizer state and a GEMM's weight operand are checked here and again at
    :meth:`attach`.

    ``warn_unfired``: at :meth:`detach`, warn about every module-site spec whose schedule covered
    a training step but that never fired there (its module never ran its own forward -- a Linear
    its parent applies with ``F.linear`` -- or handed on no gradient); a campaign, which reports
    such a trial as ``not_fired``, turns it off.
    """

    def __init__(self, model: nn.Module, specs: Iterable[FaultSpec], optimizer: torch.optim.Optimizer | None = None,
                 *, rank: int = 0, world_size: int = 1, log: str | Path | Callable[[dict], None] | None = None,
                 grad_accum: int = 1, resumed_at: int = 0, probe: dict[str, list[Any]] | None = None,
                 warn_unfired: bool = True) -> None:
        self.model = model
        self.specs = list(specs)
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        self.targets = validate_specs(model, self.specs, optimizer, world_size, probe=probe)
        self.step, self.micro_batch = 0, 0
        self.grad_accum = grad_accum
        """Micro-batches per step: ``param_grad`` fires after the last one (the callback sets it)."""
        self.resumed_at = resumed_at
        self.evaluating = False
        self._begun: set[int] = set()   # steps whose execution has started at least once
        self._repeat = False            # this execution of the step is a re-execution
        self.records: list[dict[str, Any]] = []
        """Every record, as written to the log (``when``: train, after_update or eval)."""
        self._seen: set[tuple] = set()
        self._resident: dict[tuple[int, str], tuple] = {}  # permanent memory faults in place: (id, version, index)
        self._param_grad_fired: dict[tuple[int, str], int] = {}   # (spec, target) -> step a once-fault hit .grad
        self._calls: dict[tuple[int, str], int] = {}  # forward calls of the module met at this position
        self._acted: set[tuple[int, str]] = set()     # once-faults that acted at this position
        self._fired_input: dict[tuple[int, str], torch.Tensor] = {}  # input of a once-fault's call
        self._warned_accum = False
        self.warn_unfired = warn_unfired
        self._covered: dict[int, int] = {}   # module-site spec -> first training step it was live at
        self._reached: set[int] = set()      # module-site specs that met a call to act on
        self._attached = False
        self._optimizer_handles: list[Any] = []
        self._spec_handles: dict[int, list[Any]] = {}  # hooks of the specs live at this step
        self._file = JsonlWriter(log) if isinstance(log, (str, Path)) else None
        self._sink = log if callable(log) else None
        self.armed = True

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> "Injector":
        """Arm the injector. Hooks are registered lazily, only for the specs whose schedule can
        fire at the current step, so an injector waiting for a later step costs nothing."""
        if self._attached:
            return self
        # what is known without running the model (parameters, optimizer state, a GEMM's weight
        # operand) is checked again against the tensors as they are now: a model cast or moved
        # since the injector was built (model.to(torch.bfloat16)) fails here, not mid-training
        validate_specs(self.model, self.specs, self.optimizer, self.world_size)
        self._attached = True
        if self.optimizer is not None and any(s.site in MEMORY_SITES and s.schedule.kind == "permanent"
                                              for s in self.specs):
            self._optimizer_handles = [self.optimizer.register_step_post_hook(self._optimizer_post)]
        self._sync_hooks()
        return self

    def detach(self) -> None:
        if self.warn_unfired:
            self._warn_unfired()
        for h in self._optimizer_handles + [h for hs in self._spec_handles.values() for h in hs]:
            h.remove()
        self._optimizer_handles, self._spec_handles = [], {}
        self._attached = False

    def close(self) -> None:
        self.detach()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Injector":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- position ----------------------------------------------------------------------------
    def set_position(self, step: int, micro_batch: int = 0, *, evaluating: bool = False) -> None:
        """Call before the forward pass of each micro-batch (the engine does it for you).

        ``evaluating=True`` marks an evaluation pass at ``step``: only permanent faults (a unit
        that stays broken) act there; transient and intermittent ones belong to training events.
        """
        moved = (step, evaluating) != (self.step, self.evaluating)
        if not evaluating and micro_batch == 0:
            self._repeat = step in self._begun
            self._begun.add(step)
            moved = True
        self.step, self.micro_batch, self.evaluating = step, micro_batch, evaluating
        self._calls, self._acted, self._fired_input = {}, set(), {}
        if micro_batch >= self.grad_accum and not self._warned_accum and not evaluating \
                and any(s.site == "param_grad" for s in self.specs):
            self._warned_accum = True
            warnings.warn(f"micro-batch {micro_batch} at grad_accum={self.grad_accum}: param_grad faults "
                          f"fire after micro-batch grad_accum-1 only; pass Injector(grad_accum=...)",
                          stacklevel=2)
        if moved:
            self._sync_hooks()
        self._apply_memory_faults()

    def _live(self, spec: FaultSpec) -> bool:
        """Whether ``spec`` can fire at the current position (rank, schedule window, phase)."""
        once = spec.schedule.kind != "permanent"
        return (self._attached and (spec.rank is None or spec.rank == self.rank)
                and spec.schedule.covers(self.step)
                and not (once and (self.evaluating or self._repeat or _REEXECUTING.get())))

    def _warn_unfired(self) -> None:
        for i, step in self._covered.items():
            if i in self._reached:
                continue
            spec = self.specs[i]
            why = UNREACHED[spec.site] + (" (or the intermittent schedule drew no event)"
                                          if spec.schedule.kind == "intermittent" else "")
            if spec.site != "gemm.grad_input":
                why += ("; a Linear its parent applies with F.linear (nn.MultiheadAttention's out_proj) never "
                        "runs its own forward")
            warnings.warn(f"fault spec #{i} ({spec.site} on {', '.join(repr(t.name) for t in self.targets[i])}) never "
                          f"fired, though its schedule covered step {step} on: the module {why}. Check specs "
                          "before training: Injector(..., probe=sdcscope.inject.targets.probe_model(model, forward))",
                          stacklevel=3)
        self._covered = {}

    def _sync_hooks(self) -> None:
        for i, spec in enumerate(self.specs):
            live = self._live(spec)
            if live and not self.evaluating and spec.site in MODULE_SITES:
                self._covered.setdefault(i, self.step)
            if live and i not in self._spec_handles:
                self._spec_handles[i] = [h for t in self.targets[i] if (h := self._attach_one(i, spec, t))]
            elif not live and i in self._spec_handles:
                for h in self._spec_handles.pop(i):
                    h.remove()

    def callback(self) -> "InjectorCallback":
        return InjectorCallback(self)

    # -- hooks -------------------------------------------------------------------------------
    def _attach_one(self, i: int, spec: FaultSpec, t: Target):
        """Register the hook that reaches ``spec``'s site on target ``t``, ahead of other hooks
        (the hardware corrupts the value before any observer sees it). None: no hook needed:
        weight faults are applied in set_position, optimizer_state in the optimizer pre-hook,
        checkpoint faults by corrupt_checkpoint_file."""
        site = spec.site
        if site == "activation" or (site == "gemm.forward" and spec.pattern.kind != "mac_cell"):
            return t.module.register_forward_hook(self._output_hook(i, spec, t), prepend=True)
        if site == "gemm.forward":
            return t.module.register_forward_hook(self._mac_cell_hook(i, spec, t), prepend=True)
        if site == "gemm.grad_input" or (site == "gemm.grad_weight" and getattr(t.module, "is_matmul", False)):
            position = 1 if site == "gemm.grad_weight" else 0   # d b of a @ b
            return t.module.register_forward_hook(self._operand_grad_hook(i, spec, t, position), prepend=True)
        if site == "gemm.grad_weight":
            return t.module.register_forward_hook(self._grad_weight_hook(i, spec, t), prepend=True)
        if site == "param_grad":
            return t.param.register_post_accumulate_grad_hook(self._param_grad_hook(i, spec, t))
        return None

    def _event_micro_batch(self, spec: FaultSpec) -> int | None:
        return None if spec.site in STEP_SITES else self.micro_batch  # once per step: micro-batch 0

    def _fires(self, spec: FaultSpec, t: Target) -> bool:
        return self.armed and self._live(spec) and fires(spec, self.step, self._event_micro_batch(spec),
                                                         t.key, self.rank)

    def _index(self, i: int, t: Target) -> int | None:
        """The index of this forward call of ``t``'s module within the micro-batch (0-based, in
        forward order: the records' ``call``), counted for every call while spec ``i`` is live,
        whether it fires or not; None for a forward re-run inside the backward pass (a checkpoint's
        recompute), which is no new call. The backward hooks carry the index of their forward call."""
        if _in_backward():
            return None
        key = (i, t.name)
        k = self._calls.get(key, 0)
        self._calls[key] = k + 1
        return k

    def _call(self, i: int, spec: FaultSpec, t: Target, index: int | None, x=None, *,
              backward: bool = False) -> bool | None:
        """Whether ``spec`` acts on this call of ``t``'s module (``index``: :meth:`_index` of its
        forward call): None if not, else whether to log it (False: corrupt without a record, as
        in a checkpoint recompute or a re-execution). ``x``: the forward call's input;
        ``backward``: asked by a backward hook (dX, dW of the forward call ``index``)."""
        if not self._fires(spec, t):
            return None
        self._reached.add(i)
        key, once = (i, t.name), spec.schedule.kind != "permanent"
        if _REEXECUTING.get():  # only permanent faults are live: they act, already logged
            return False
        if not backward and index is None:  # activation checkpointing re-runs a forward call
            if not once:
                return False
            if key not in self._fired_input:  # the fault was not met in the forward pass
                return None
            ref = self._fired_input[key]
            same = (self._calls.get(key, 0) == 1 or not isinstance(x, torch.Tensor)
                    or not isinstance(ref, torch.Tensor)
                    or (ref.shape == x.shape and ref.dtype == x.dtype and torch.equal(ref, x)))
            return False if same else None
        if once:
            if key in self._acted:  # one event in time: the first call only
                return None
            self._acted.add(key)
            if not backward:  # its input tells its recomputation from another call's
                self._fired_input[key] = x.detach() if isinstance(x, torch.Tensor) else None
        return True

    def _apply(self, spec: FaultSpec, t: Target, tensor: torch.Tensor, *, suffix: str = "", channel_dim=None,
               step: int | None = None) -> FaultResult:
        """Apply this event's fault of ``spec`` to ``tensor`` in place (``step``: the one whose
        channel swizzle a ``mac_cell`` follows; default the current one)."""
        # A mac_cell on an array is one physical cell of the unit that runs every targeted GEMM:
        # its random cell (and value) is drawn once for the unit, not per module.
        unit = spec.pattern.kind == "mac_cell" and spec.pattern.array is not None
        gen = fault_generator(spec, self.step, self._event_micro_batch(spec),
                              MAC_ARRAY if unit else t.key + suffix, self.rank)
        try:
            return apply_spec(spec, tensor, gen, channel_dim=channel_dim, step=self.step if step is None else step)
        except FaultSpecError as exc:  # a tensor only known when it runs (a module output, dX, dW under autocast)
            i = next(k for k, s in enumerate(self.specs) if s is spec)
            raise FaultSpecError(
                f"fault spec #{i} ({spec.site} on {t.name + suffix!r}) does not fit the {str(tensor.dtype)[6:]} "
                f"tensor of shape {list(tensor.shape)} it landed on at step {self.step}: {exc} (check it before "
                "training: Injector(..., probe=sdcscope.inject.targets.probe_model(model, forward)))") from None

    def _corrupt(self, i: int, spec: FaultSpec, t: Target, tensor: torch.Tensor, *, suffix: str = "",
                 channel_dim=None, call: int | None = None, when: str | None = None, log: bool = True) -> FaultResult:
        result = self._apply(spec, t, tensor, suffix=suffix, channel_dim=channel_dim)
        if log:
            self._record(i, spec, t.name + suffix, result, call=call, when=when)
        return result

    def _output_hook(self, i, spec, t: Target):
        channel_dim = 1 if isinstance(t.module, CHANNELS_FIRST) else -1

        def hook(module, args, output):
            index = self._index(i, t)
            tensor, rebuild = primary_output(output)
            if tensor is None or tensor.numel() == 0:   # an idle expert: nothing computed, nothing to hit
                return None
            log = self._call(i, spec, t, index, args[0] if args else None)
            if log is None:
                return None
            faulty = tensor.detach().clone()
            self._corrupt(i, spec, t, faulty, channel_dim=channel_dim, call=index, log=log)
            return rebuild(_replaced(tensor, faulty))
        return hook

    def _mac_cell_hook(self, i, spec, t: Target):
        """Y' = Y + op(x, W' − W): the GEMM ran with weight[b, a] faulted in the MAC cell."""
        def hook(module, args, output):
            index = self._index(i, t)
            if output.numel() == 0:
                return None
            log = self._call(i, spec, t, index, args[0])
            if log is None:
                return None
            w = module.weight.detach()
            faulty_w = w.clone()
            self._corrupt(i, spec, t, faulty_w, call=index, log=log)
            delta = (faulty_w - w).to(output.dtype)
            x = args[0].detach()
            if isinstance(module, nn.Linear):
                err = F.linear(x, delta)
            else:  # the module's own padding (padding_mode 'circular', 'reflect', ... included)
                err = module._conv_forward(x, delta, None)
            return _replaced(output, output.detach() + err)
        return hook

    def _operand_grad_hook(self, i, spec, t: Target, position: int):
        """Forward hook: corrupt the gradient this call hands on to its operand ``position`` (dX;
        d b of ``a @ b``) where its autograd node produces it (:func:`operand_grad_edge`). A full
        backward hook would reach it too, but makes the module's output a view that an in-place op
        after it (``ReLU(inplace=True)``) may not modify."""
        channel_dim = operand_channel_dims(t.module, position)

        def hook(module, args, output):
            index = self._index(i, t)   # this call's: its dX is call `index` too
            try:
                edge = operand_grad_edge(module, output, args, position)
            except ValueError as exc:
                raise RuntimeError(f"{spec.site} on {t.name!r}: {exc}") from None
            if edge is None:   # no gradient flows to the operand in this call
                return None

            def corrupt(grad_inputs, grad_outputs):
                g = grad_inputs[edge.index]
                if g is None or g.numel() == 0 or (log := self._call(i, spec, t, index, backward=True)) is None:
                    return None
                faulty = g.clone(memory_format=torch.contiguous_format)   # a Linear's (tokens, in): as X
                self._corrupt(i, spec, t, faulty.view(edge.shape), channel_dim=channel_dim, call=index, log=log)
                return tuple(faulty if k == edge.index else gi for k, gi in enumerate(grad_inputs))
            edge.node.register_hook(corrupt)
            return None
        return hook

    def _grad_weight_hook(self, i, spec, t: Target):
        """Forward hook: reach this call's dW through its autograd node (weight_grad_edge)."""
        def hook(module, args, output):
            index = self._index(i, t)   # this call's: its dW is call `index` too
            if not isinstance(output, torch.Tensor) or not output.requires_grad or output.numel() == 0:
                return None   # (no tokens: dW = dYᵀX sums over none, no product computed)
            edge = weight_grad_edge(output, module.weight)
            if edge is None:
                raise RuntimeError(f"gemm.grad_weight on {t.name!r}: the weight's gradient does not "
                                   f"come from this call's autograd graph (a flattened or wrapped parameter?)")
            node, at = edge

            def corrupt(grad_inputs, grad_outputs):
                g = grad_inputs[at]
                if g is None or (log := self._call(i, spec, t, index, backward=True)) is None:
                    return None
                faulty = g.clone()
                self._corrupt(i, spec, t, faulty, call=index, log=log)
                return tuple(faulty if k == at else gi for k, gi in enumerate(grad_inputs))
            node.register_hook(corrupt)
            return None
        return hook

    def _param_grad_hook(self, i, spec, t: Target):
        def hook(param):
            # once per step, on the sum over all micro-batches: after the last one's backward (a
            # loop calling backward() twice there accumulates twice: a transient fault acts once)
            if param.grad is None or self.micro_batch != self.grad_accum - 1 or not self._fires(spec, t):
                return
            if spec.schedule.kind != "permanent":
                if self._param_grad_fired.get((i, t.name)) == self.step:
                    return
                self._param_grad_fired[(i, t.name)] = self.step
            if param.grad.is_sparse:
                self._corrupt_sparse_grad(i, spec, t, param)
            else:
                self._corrupt(i, spec, t, param.grad)
        return hook

    def _corrupt_sparse_grad(self, i: int, spec: FaultSpec, t: Target, param: torch.Tensor) -> None:
        """A sparse gradient is in memory as the values of the rows it holds: the fault lands on
        its coalesced values (``[rows, *dense dims]``, the pattern resolved on them), written back
        as ``.grad``; the record gives the elements' flat indices in the parameter."""
        grad = param.grad.coalesce()
        values = grad.values()
        result = self._apply(spec, t, values)
        row = math.prod(values.shape[1:])
        sparse_shape = grad.shape[:grad.sparse_dim()]
        strides = torch.tensor([math.prod(sparse_shape[d + 1:]) for d in range(len(sparse_shape))])
        rows = (grad.indices().cpu() * strides.unsqueeze(1)).sum(0)   # flat index of each stored row
        index = rows[result.index // row] * row + result.index % row
        param.grad = grad
        self._record(i, spec, t.name, FaultResult(index, result.before, result.after))

    def _active(self, site: str):
        """(index, spec) of the specs for ``site`` that can fire at the current position."""
        for i, spec in enumerate(self.specs):
            if spec.site == site and self._live(spec):
                yield i, spec

    def _apply_memory_faults(self, after_update: bool = False) -> None:
        """Weights and optimizer state are memory: a fault there is applied to the resident
        tensor (optimizer state once per step, at micro-batch 0). ``after_update``: re-apply
        the permanent ones to the values the update just wrote."""
        when = "after_update" if after_update else None
        for site in MEMORY_SITES:
            for i, spec in self._active(site):
                permanent = spec.schedule.kind == "permanent"
                if after_update and not permanent:
                    continue
                for t in self.targets[i]:
                    if not self._fires(spec, t):
                        continue
                    if site == "weight":   # .data: the write leaves param._version to the optimizer's
                        self._corrupt_resident(i, spec, t, t.param.data, t.param, "", when, permanent)
                    elif (after_update or self.micro_batch == 0) and self.optimizer is not None:
                        state = self.optimizer.state.get(t.param, {})
                        for key in element_state(state, t.param):
                            if spec.state_key in (None, key):
                                self._corrupt_resident(i, spec, t, state[key], state[key], f":{key}", when, permanent)

    def _corrupt_resident(self, i: int, spec: FaultSpec, t: Target, tensor: torch.Tensor, owner: torch.Tensor,
                          suffix: str, when: str | None, permanent: bool) -> None:
        """Corrupt a tensor held in memory. A permanent fault acts on each value written there
        (by an update) once: while ``owner``'s version says nothing rewrote it since the fault
        went in, it is in place -- applying it again would undo a bit flip. A resumed run meets
        the faults that started before it in place (see ``resumed_at``): where they lie is where
        their last application, at step ``resumed_at - 1``, put them."""
        key = (i, t.name + suffix)
        got = self._resident.get(key)
        if permanent and got is None and spec.schedule.start < self.resumed_at:
            index = self._apply(spec, t, tensor.clone(), suffix=suffix, step=self.resumed_at - 1).index
            got = self._resident[key] = (id(owner), owner._version, index)
        if permanent and got is not None and got[:2] == (id(owner), owner._version):
            values = tensor.reshape(-1)[got[2]].clone()   # in place: logged as such (before == after)
            self._record(i, spec, t.name + suffix, FaultResult(got[2], values, values), when=when)
            return
        result = self._corrupt(i, spec, t, tensor, suffix=suffix, when=when)
        if permanent:
            self._resident[key] = (id(owner), owner._version, result.index)

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        """A permanent memory fault survives the update: re-apply it to the new values."""
        self._apply_memory_faults(after_update=True)

    # -- records -----------------------------------------------------------------------------
    def _record(self, i: int, spec: FaultSpec, name: str, result, *, call: int | None = None,
                when: str | None = None) -> None:
        site = spec.site
        if _REEXECUTING.get():  # a replay: the permanent faults acting again were logged
            return
        when = when or ("eval" if self.evaluating else "train")
        if when != "train" and site in MEMORY_SITES and not _changed(result):
            return  # a re-application that found the fault already in place: nothing happened
        # an evaluation pass runs many batches at one position: one record per spec and module
        key = (i, name, self.step, self.micro_batch, when, None if when == "eval" else call)
        if key in self._seen and (when == "eval" or self._repeat):
            return  # the same event of a re-execution (or of an evaluation): logged once
        self._seen.add(key)
        values = result.to_dict()
        record = {
            "step": self.step, "micro_batch": self.micro_batch, "rank": self.rank, "site": site,
            "when": when, "call": call, "module": name, "spec": i, "model": spec.model,
            "bits": list(spec.bits) if spec.bits else None,
            "count": len(values["index"]),
            **{k: vals[:MAX_RECORDED] for k, vals in values.items()},
        }
        self.records.append(record)
        if self._file is not None:
            self._file.write(record)
        if self._sink is not None:
            self._sink(record)


class InjectorCallback:
    """Engine callback that keeps the injector's (step, micro-batch) position current."""

    def __init__(self, injector: Injector) -> None:
        self.injector = injector

    def before_step(self, ctx) -> None:
        self.injector.grad_accum = ctx.trainer.config.grad_accum
        self.injector.set_position(ctx.step, 0)

    def before_evaluate(self, trainer) -> None:
        self.injector.set_position(trainer.step, 0, evaluating=True)

    def after_backward(self, ctx) -> None:
        if ctx.micro_batch + 1 < ctx.trainer.config.grad_accum:
            self.injector.set_position(ctx.step, ctx.micro_batch + 1)
