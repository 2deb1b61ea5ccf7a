"""Attach fault specs to a live model and optimizer through removable hooks.

The hooks that reach each site are :mod:`sdcscope.inject.hooks`; all are removed by
:meth:`Injector.detach`.

Whether a fault fires is :func:`sdcscope.faults.fires` of (spec, step, micro-batch, name, rank).
A call whose output is empty (an MoE expert routed no token) computes nothing and takes no fault:
a transient fault waits for the module's next call with work to do. A module called several
times in one micro-batch (a shared layer) is one site visited several times: a transient or
intermittent fault is one event in time and corrupts only the *first* call
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
parameter sites). ``index`` is the flat index of each element in the tensor this rank holds: of a
DTensor (a tensor-parallel GEMM's result or gradient, a sharded parameter), its local shard -- the
fault is made there, without a collective -- and the record has ``shard``: ``placement``,
``offset`` and ``local_shape`` of the shard, ``global_shape`` and ``global_index`` (the flat
indices in the global tensor; of a ``Partial`` sum, the same as ``index``). Evaluation records
never suppress or replace training ones; count training injections as the records whose
``when`` is not ``"eval"``. A graph-mode fault (``Injector(graph=True)``) is recorded when the
host arms it, with ``"graph": true``, ``before``/``after`` null (the graph hands no values back)
and ``call`` null (every call of the micro-batch got it). A re-execution (:func:`~sdcscope.inject.reexec.reexecution`:
its permanent faults act again) logs nothing; training a step again after a rollback logs only
events its first execution did not.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.graph import in_backward
from sdcscope.common.io import JsonlWriter
from sdcscope.common.world import local, shard_coords
from sdcscope.faults import STEP_SITES, FaultResult, FaultSpec, FaultSpecError, apply_spec, fault_generator, fires
from sdcscope.inject.fp8 import Fp8Sites
from sdcscope.inject.graphsites import GraphSites
from sdcscope.inject.hooks import MEMORY_SITES, SiteHooks
from sdcscope.inject.reexec import reexecuting
from sdcscope.inject.targets import MODULE_SITES, UNREACHED, Target
from sdcscope.inject.validate import validate_specs

MAC_ARRAY = "<mac-array>"
"""The name a ``mac_cell`` pattern with an ``array`` keys its fault generator on (one unit)."""
MAX_RECORDED = 64
"""Elements listed per record (a row or tensor-wide fault can hit thousands); ``count`` says all."""


def _changed(result) -> bool:
    """Whether a fault application changed at least one value, bit for bit."""
    before, after = result.before.reshape(-1), result.after.reshape(-1)
    if before.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[before.element_size()]
        before, after = before.view(ints), after.view(ints)
    return not torch.equal(before, after)


def _global_indices(shard: dict, index: list[int]) -> dict:
    """``shard`` (:func:`~sdcscope.common.tensors.shard_coords`: ``placements`` named
    ``placement`` as in ABFT's events) with ``global_index``: the flat local ``index`` of each
    element as a flat index in the global tensor (global = offset + local, per dimension)."""
    local_shape, global_shape, offset = shard["local_shape"], shard["global_shape"], shard["offset"]
    out = []
    for flat in index:
        g = 0
        for d in range(len(local_shape)):
            below = math.prod(local_shape[d + 1 :])
            g = g * global_shape[d] + (flat // below) % local_shape[d] + offset[d]
        out.append(g)
    return {
        "placement": shard["placements"],
        "offset": offset,
        "local_shape": local_shape,
        "global_shape": global_shape,
        "global_index": out,
    }


class Injector(SiteHooks, Fp8Sites, GraphSites):
    """Holds fault specs for one model (and optimizer) on one rank.

    Use as a context manager (``with Injector(model, specs, optimizer) as inj:``) or call
    :meth:`attach` / :meth:`detach`. On exit every hook is gone; values already corrupted
    (a weight, an optimizer state) stay corrupted, as they would on the hardware.

    ``resumed_at``: the step a run resumed from a checkpoint that its own training, with these
    specs, wrote after step ``resumed_at - 1`` (0: a new run). The permanent memory faults that
    started before it are in the restored values already: they are marked in place, not applied
    again, so the resumed run goes on bitwise as the uninterrupted one.

    ``probe``: :func:`~sdcscope.inject.probe.probe_model` of the training's forward (under its
    autocast, if any), so a spec that does not fit a module's output or input gradient is refused
    here, as the CLI does; without it those are known only when the fault fires, and raise
    :class:`~sdcscope.faults.FaultSpecError` naming the spec, module, dtype and step then.
    Parameters, optimizer state and a GEMM's weight operand are checked here and again at
    :meth:`attach`.

    ``warn_unfired``: at :meth:`detach`, warn about every module-site spec whose schedule covered
    a training step but that never fired there (its module never ran its own forward -- a Linear
    its parent applies with ``F.linear`` -- or handed on no gradient); a campaign, which reports
    such a trial as ``not_fired``, turns it off.

    ``graph``: reach ``gemm.forward``, ``gemm.grad_input`` and ``gemm.grad_weight`` of ``nn.Linear``
    and MatMul-contract targets inside a ``torch.compile`` graph, with no graph break and no
    recompile per step (:mod:`sdcscope.inject.graph`, :mod:`sdcscope.inject.graphsites`): every
    call of the module in the armed micro-batch gets the fault, records have ``before``/``after``
    null and ``"graph": true``. ``weight``, ``optimizer_state`` and ``param_grad`` act outside the
    graph as without it; ``activation``, GEMM sites of other modules (Conv) and a ``mac_cell``
    ``gemm.forward`` are refused here.
    """

    def __init__(
        self,
        model: nn.Module,
        specs: Iterable[FaultSpec],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        log: str | Path | Callable[[dict], None] | None = None,
        grad_accum: int = 1,
        resumed_at: int = 0,
        probe: dict[str, list[Any]] | None = None,
        warn_unfired: bool = True,
        targets: dict[int, list[Target]] | None = None,
        graph: bool = False,
    ) -> None:
        self.model = model
        self.specs = list(specs)
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        # ``targets``: the specs' targets on this model, validated by the caller (:func:`validate_specs`)
        # for the model as it will train; neither this nor :meth:`attach` checks them again
        self._checked = targets is not None
        self.targets = (
            targets if self._checked else validate_specs(model, self.specs, optimizer, world_size, probe=probe)
        )
        self.step, self.micro_batch = 0, 0
        self.grad_accum = grad_accum
        """Micro-batches per step: ``param_grad`` fires after the last one (the callback sets it)."""
        self.resumed_at = resumed_at
        self.evaluating = False
        self._begun: set[int] = set()  # steps whose execution has started at least once
        self._repeat = False  # this execution of the step is a re-execution
        self.records: list[dict[str, Any]] = []
        """Every record, as written to the log (``when``: train, after_update or eval)."""
        self._seen: set[tuple] = set()
        self._resident: dict[tuple[int, str], tuple] = {}  # permanent memory faults in place: (id, version, index)
        self._param_grad_fired: dict[tuple[int, str], int] = {}  # (spec, target) -> step a once-fault hit .grad
        self._calls: dict[tuple[int, str], int] = {}  # forward calls of the module met at this position
        self._acted: set[tuple[int, str]] = set()  # once-faults that acted at this position
        self._fired_input: dict[tuple[int, str], torch.Tensor] = {}  # input of a once-fault's call
        self._warned_accum = False
        self.warn_unfired = warn_unfired
        self._covered: dict[int, int] = {}  # module-site spec -> first training step it was live at
        self._reached: set[int] = set()  # module-site specs that met a call to act on
        self._attached = False
        self._optimizer_handles: list[Any] = []
        self._spec_handles: dict[int, list[Any]] = {}  # hooks of the specs live at this step
        self._file = JsonlWriter(log) if isinstance(log, (str, Path)) else None
        self._sink = log if callable(log) else None
        self.armed = True
        self._graph_setup(graph, probe)

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> Injector:
        """Arm the injector. Hooks are registered lazily, only for the specs whose schedule can
        fire at the current step, so an injector waiting for a later step costs nothing."""
        if self._attached:
            return self
        # what is known without running the model (parameters, optimizer state, a GEMM's weight
        # operand) is checked again against the tensors as they are now: a model cast or moved
        # since the injector was built (model.to(torch.bfloat16)) fails here, not mid-training
        if not self._checked:
            validate_specs(self.model, self.specs, self.optimizer, self.world_size)
        self._attached = True
        if self.optimizer is not None and any(
            s.site in MEMORY_SITES and s.schedule.kind == "permanent" for s in self.specs
        ):
            self._optimizer_handles = [self.optimizer.register_step_post_hook(self._optimizer_post)]
        self._sync_hooks()
        self._graph_attach()
        return self

    def detach(self) -> None:
        if self.warn_unfired:
            self._warn_unfired()
        for h in self._optimizer_handles + [h for hs in self._spec_handles.values() for h in hs]:
            h.remove()
        self._optimizer_handles, self._spec_handles = [], {}
        self._graph_detach()
        self._attached = False

    def close(self) -> None:
        self.detach()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Injector:
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
        if (
            micro_batch >= self.grad_accum
            and not self._warned_accum
            and not evaluating
            and any(s.site == "param_grad" for s in self.specs)
        ):
            self._warned_accum = True
            warnings.warn(
                f"micro-batch {micro_batch} at grad_accum={self.grad_accum}: param_grad faults "
                f"fire after micro-batch grad_accum-1 only; pass Injector(grad_accum=...)",
                stacklevel=2,
            )
        if moved:
            self._sync_hooks()
        self._apply_memory_faults()
        if self._graph_entries:
            self._graph_arm()

    def at_micro_batch(self, micro_batch: int) -> None:
        """The micro-batch whose work runs next, within the current step: a pipeline schedule
        interleaves micro-batches (1F1B runs one's backward between others' forwards)."""
        if micro_batch != self.micro_batch:
            self.micro_batch = micro_batch
            self._calls, self._acted, self._fired_input = {}, set(), {}

    def _live(self, spec: FaultSpec) -> bool:
        """Whether ``spec`` can fire at the current position (rank, schedule window, phase)."""
        once = spec.schedule.kind != "permanent"
        return (
            self._attached
            and (spec.rank is None or spec.rank == self.rank)
            and spec.schedule.covers(self.step)
            and not (once and (self.evaluating or self._repeat or reexecuting()))
        )

    def _warn_unfired(self) -> None:
        for i, step in self._covered.items():
            if i in self._reached:
                continue
            spec = self.specs[i]
            why = UNREACHED[spec.site] + (
                " (or the intermittent schedule drew no event)" if spec.schedule.kind == "intermittent" else ""
            )
            if spec.site != "gemm.grad_input":
                why += (
                    "; a Linear its parent applies with F.linear (nn.MultiheadAttention's out_proj) never "
                    "runs its own forward"
                )
            warnings.warn(
                f"fault spec #{i} ({spec.site} on {', '.join(repr(t.name) for t in self.targets[i])}) never "
                f"fired, though its schedule covered step {step} on: the module {why}. Check specs "
                "before training: Injector(..., probe=sdcscope.inject.probe_model(model, forward))",
                stacklevel=3,
            )
        self._covered = {}

    def _sync_hooks(self) -> None:
        for i, spec in enumerate(self.specs):
            live = self._live(spec)
            if live and not self.evaluating and spec.site in MODULE_SITES:
                self._covered.setdefault(i, self.step)
            if i in self._graph_specs:  # carried by a graph wrapper, armed by _graph_arm
                continue
            if live and i not in self._spec_handles:
                self._spec_handles[i] = [h for t in self.targets[i] if (h := self._attach_one(i, spec, t))]
            elif not live and i in self._spec_handles:
                for h in self._spec_handles.pop(i):
                    h.remove()

    def callback(self) -> InjectorCallback:
        return InjectorCallback(self)

    def _event_micro_batch(self, spec: FaultSpec) -> int | None:
        return None if spec.site in STEP_SITES else self.micro_batch  # once per step: micro-batch 0

    def _fires(self, spec: FaultSpec, t: Target) -> bool:
        return (
            self.armed and self._live(spec) and fires(spec, self.step, self._event_micro_batch(spec), t.key, self.rank)
        )

    def _index(self, i: int, t: Target) -> int | None:
        """The index of this forward call of ``t``'s module within the micro-batch (0-based, in
        forward order: the records' ``call``), counted for every call while spec ``i`` is live,
        whether it fires or not; None for a forward re-run inside the backward pass (a checkpoint's
        recompute), which is no new call. The backward hooks carry the index of their forward call."""
        if in_backward():
            return None
        key = (i, t.name)
        k = self._calls.get(key, 0)
        self._calls[key] = k + 1
        return k

    def _call(
        self, i: int, spec: FaultSpec, t: Target, index: int | None, x=None, *, backward: bool = False
    ) -> bool | None:
        """Whether ``spec`` acts on this call of ``t``'s module (``index``: :meth:`_index` of its
        forward call): None if not, else whether to log it (False: corrupt without a record, as
        in a checkpoint recompute or a re-execution). ``x``: the forward call's input;
        ``backward``: asked by a backward hook (dX, dW of the forward call ``index``)."""
        if not self._fires(spec, t):
            return None
        self._reached.add(i)
        key, once = (i, t.name), spec.schedule.kind != "permanent"
        if reexecuting():  # only permanent faults are live: they act, already logged
            return False
        if not backward and index is None:  # activation checkpointing re-runs a forward call
            if not once:
                return False
            if key not in self._fired_input:  # the fault was not met in the forward pass
                return None
            ref = self._fired_input[key]
            same = (
                self._calls.get(key, 0) == 1
                or not isinstance(x, torch.Tensor)
                or not isinstance(ref, torch.Tensor)
                or (ref.shape == x.shape and ref.dtype == x.dtype and torch.equal(local(ref), local(x)))
            )
            return False if same else None
        if once:
            if key in self._acted:  # one event in time: the first call only
                return None
            self._acted.add(key)
            if not backward:  # its input tells its recomputation from another call's (a DTensor:
                # compared on this rank's shard, as ``torch.equal`` of DTensors is a collective)
                self._fired_input[key] = x.detach() if isinstance(x, torch.Tensor) else None
        return True

    def _apply(
        self,
        spec: FaultSpec,
        t: Target,
        tensor: torch.Tensor,
        *,
        suffix: str = "",
        channel_dim=None,
        step: int | None = None,
    ) -> FaultResult:
        """Apply this event's fault of ``spec`` to ``tensor`` in place (``step``: the one whose
        channel swizzle a ``mac_cell`` follows; default the current one)."""
        # A mac_cell on an array is one physical cell of the unit that runs every targeted GEMM:
        # its random cell (and value) is drawn once for the unit, not per module.
        unit = spec.pattern.kind == "mac_cell" and spec.pattern.array is not None
        gen = fault_generator(
            spec, self.step, self._event_micro_batch(spec), MAC_ARRAY if unit else t.key + suffix, self.rank
        )
        tensor = local(tensor)  # a DTensor (FSDP2, tensor parallel): the shard this rank's hardware holds
        try:
            return apply_spec(spec, tensor, gen, channel_dim=channel_dim, step=self.step if step is None else step)
        except FaultSpecError as exc:  # a tensor only known when it runs (a module output, dX, dW under autocast)
            i = next(k for k, s in enumerate(self.specs) if s is spec)
            raise FaultSpecError(
                f"fault spec #{i} ({spec.site} on {t.name + suffix!r}) does not fit the {str(tensor.dtype)[6:]} "
                f"tensor of shape {list(tensor.shape)} it landed on at step {self.step}: {exc} (check it before "
                "training: Injector(..., probe=sdcscope.inject.probe_model(model, forward)))"
            ) from None

    def _corrupt(
        self,
        i: int,
        spec: FaultSpec,
        t: Target,
        tensor: torch.Tensor,
        *,
        suffix: str = "",
        channel_dim=None,
        call: int | None = None,
        when: str | None = None,
        log: bool = True,
        shard: dict | None = None,
    ) -> FaultResult:
        """Apply the event's fault to ``tensor`` in place (a DTensor: its local shard) and log it;
        ``shard``: :func:`~sdcscope.common.tensors.shard_coords` of the DTensor whose local values
        ``tensor`` is (default: of ``tensor`` itself), for the record."""
        result = self._apply(spec, t, tensor, suffix=suffix, channel_dim=channel_dim)
        if log:
            shard = shard if shard is not None else shard_coords(tensor)
            self._record(i, spec, t.name + suffix, result, call=call, when=when, shard=shard)
        return result

    # -- records -----------------------------------------------------------------------------
    def _record(
        self,
        i: int,
        spec: FaultSpec,
        name: str,
        result,
        *,
        call: int | None = None,
        when: str | None = None,
        shard: dict | None = None,
        graph: bool = False,
    ) -> None:
        site = spec.site
        if reexecuting():  # a replay: the permanent faults acting again were logged
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
            "step": self.step,
            "micro_batch": self.micro_batch,
            "rank": self.rank,
            "site": site,
            "when": when,
            "call": call,
            "module": name,
            "spec": i,
            "model": spec.model,
            "bits": list(spec.bits) if spec.bits else None,
            "count": len(values["index"]),
            **{k: None if vals is None else vals[:MAX_RECORDED] for k, vals in values.items()},
        }
        if graph:  # armed in a compiled graph: which elements, not their values
            record["graph"] = True
        if shard is not None:  # a DTensor's local shard: where its elements sit in the global tensor
            record["shard"] = _global_indices(shard, record["index"])
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
        self.injector.micro_batch_done()
        if ctx.micro_batch + 1 < ctx.trainer.config.grad_accum:
            self.injector.set_position(ctx.step, ctx.micro_batch + 1)
