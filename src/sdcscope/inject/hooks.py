"""The hooks that reach each fault site on a live model (the :class:`SiteHooks` half of
:class:`~sdcscope.inject.Injector`: where a fault lands; the injector decides when it fires and
logs it).

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
                    that hands it on (:func:`~sdcscope.common.graph.operand_grad_edge`: the
                    ``addmm``/``mm`` of an ``nn.Linear``, a Conv's ``Convolution``, ...), in the
                    GEMM's compute dtype (bf16 under autocast), before any observer of the
                    operand sees it; the output is left alone, so an in-place op after the
                    module (``ReLU(inplace=True)``) stays legal. A call autograd does not
                    record (``torch.no_grad()``, a reentrant checkpoint's first pass) has no dX;
                    a checkpoint's recompute gets the fault
gemm.grad_weight    this GEMM's dW: a hook on the call's own autograd node that hands dW to the
                    weight, before it is summed with the weight's other uses and accumulated
                    into ``.grad``; for ``a @ b``: d b, as dX above
dispatch            forward hook on an MoE token dispatch (``is_dispatch``): the dispatched token
                    rows [slots, d] are faulted -- their bits by the element models, a whole slot
                    by ``drop`` / ``duplicate`` (:mod:`sdcscope.faults.tokens`)
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

A DTensor (a tensor-parallel GEMM's result or gradient -- a rowwise layer's output and a colwise
layer's dX are ``Partial`` sums -- or a sharded parameter) is faulted on this rank's local shard
and rewrapped with ``DTensor.from_local(..., run_check=False)``: an op on the DTensor itself could
redistribute it (an all-reduce) on the faulting rank alone, putting the ranks' collectives out of
step. Element indices are then in shard coordinates; the record's ``shard`` places them globally.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.graph import operand_grad_edge, weight_grad_edge
from sdcscope.common.modules import CHANNELS_FIRST
from sdcscope.common.world import is_dtensor, local, rewrap, shard_coords
from sdcscope.faults import FaultResult, FaultSpec
from sdcscope.inject.fp8 import fp8_site
from sdcscope.inject.optstate import element_state
from sdcscope.inject.targets import Target, operand_channel_dims, primary_output

MEMORY_SITES = ("weight", "optimizer_state")


def _local_copy(t: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """A copy of the values this rank holds of ``t``: a DTensor's local shard. An op on
    the DTensor itself (``clone``, ``+``, ``equal``) may redistribute it -- an all-reduce of a
    ``Partial`` GEMM result -- on the faulting rank alone, putting the ranks' collectives out of
    step; the fault is a change of this rank's hardware's values, so it is made on those."""
    return local(t).clone(memory_format=memory_format)


class _Replace(torch.autograd.Function):
    """Forward returns the faulty tensor bit for bit; backward passes the gradient straight
    through (the corruption happened after the operation that produced the value)."""

    @staticmethod
    def forward(ctx, clean, faulty):  # noqa: D401
        # a new tensor, not an input: an in-place op after it (ReLU(inplace=True)) is fine; of a
        # DTensor, a copy of its local shard, rewrapped (no collective)
        return rewrap(_local_copy(faulty), faulty)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _replaced(clean: torch.Tensor, faulty: torch.Tensor) -> torch.Tensor:
    return _Replace.apply(clean, faulty) if clean.requires_grad else faulty


class SiteHooks:
    """The per-site hooks of an :class:`~sdcscope.inject.Injector`, which provides the state they
    read (``specs``, ``targets``, ``optimizer``, the position) and the decisions they ask for
    (``_index``, ``_call``, ``_fires``, ``_live``, ``_apply``, ``_corrupt``, ``_record``)."""

    def _attach_one(self, i: int, spec: FaultSpec, t: Target):
        """Register the hook that reaches ``spec``'s site on target ``t``, ahead of other hooks
        (the hardware corrupts the value before any observer sees it). None: no hook needed:
        weight faults are applied in set_position, optimizer_state in the optimizer pre-hook,
        checkpoint faults by corrupt_checkpoint_file."""
        site = spec.site
        if fp8_site(spec, t):  # next to the layer's torch._scaled_mm (inject/fp8.py)
            return self._fp8_hook(i, spec, t)
        if site in ("activation", "dispatch") or (site == "gemm.forward" and spec.pattern.kind != "mac_cell"):
            return t.module.register_forward_hook(self._output_hook(i, spec, t), prepend=True)
        if site == "gemm.forward":
            return t.module.register_forward_hook(self._mac_cell_hook(i, spec, t), prepend=True)
        if site == "gemm.grad_input" or (site == "gemm.grad_weight" and getattr(t.module, "is_matmul", False)):
            position = 1 if site == "gemm.grad_weight" else 0  # d b of a @ b
            return t.module.register_forward_hook(self._operand_grad_hook(i, spec, t, position), prepend=True)
        if site == "gemm.grad_weight":
            return t.module.register_forward_hook(self._grad_weight_hook(i, spec, t), prepend=True)
        if site == "param_grad":
            return t.param.register_post_accumulate_grad_hook(self._param_grad_hook(i, spec, t))
        return None

    def _output_hook(self, i, spec, t: Target):
        channel_dim = 1 if isinstance(t.module, CHANNELS_FIRST) else -1

        def hook(module, args, output):
            index = self._index(i, t)
            tensor, rebuild = primary_output(output)
            if tensor is None or tensor.numel() == 0:  # an idle expert: nothing computed, nothing to hit
                return None
            log = self._call(i, spec, t, index, args[0] if args else None)
            if log is None:
                return None
            faulty = _local_copy(tensor.detach())  # a DTensor's local shard: indices in shard coordinates
            shard = shard_coords(tensor)
            self._corrupt(i, spec, t, faulty, channel_dim=channel_dim, call=index, log=log, shard=shard)
            return rebuild(_replaced(tensor, rewrap(faulty, tensor)))

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
            # of a tensor-parallel GEMM: this rank's local product, Y_local' = Y_local + op(x_local, ΔW_local)
            w = local(module.weight.detach())
            faulty_w = w.clone()
            self._corrupt(i, spec, t, faulty_w, call=index, log=log, shard=shard_coords(module.weight))
            delta = (faulty_w - w).to(output.dtype)
            x = local(args[0].detach())
            if isinstance(module, nn.Linear):
                err = F.linear(x, delta)
            else:  # the module's own padding (padding_mode 'circular', 'reflect', ... included)
                err = module._conv_forward(x, delta, None)
            return _replaced(output, rewrap(local(output.detach()) + err, output))

        return hook

    def _operand_grad_hook(self, i, spec, t: Target, position: int):
        """Forward hook: corrupt the gradient this call hands on to its operand ``position`` (dX;
        d b of ``a @ b``) where its autograd node produces it (:func:`operand_grad_edge`). A full
        backward hook would reach it too, but makes the module's output a view that an in-place op
        after it (``ReLU(inplace=True)``) may not modify."""
        channel_dim = operand_channel_dims(t.module, position)

        def hook(module, args, output):
            index = self._index(i, t)  # this call's: its dX is call `index` too
            try:
                edge = operand_grad_edge(module, output, args, position)
            except ValueError as exc:
                raise RuntimeError(f"{spec.site} on {t.name!r}: {exc}") from None
            if edge is None:  # no gradient flows to the operand in this call
                return None
            # the operand's shape on this rank: a tensor-parallel X (replicated, or split over
            # its features) is the DTensor whose local shard the local dX is shaped as
            shape = tuple(local(args[position]).shape) if is_dtensor(args[position]) else edge.shape

            def corrupt(grad_inputs, grad_outputs):
                g = grad_inputs[edge.index]
                if g is None or g.numel() == 0 or (log := self._call(i, spec, t, index, backward=True)) is None:
                    return None
                # a Linear's (tokens, in), viewed as X; of a DTensor (a colwise layer's Partial
                # dX), the local shard's, in shard coordinates
                faulty = _local_copy(g, torch.contiguous_format)
                view = faulty if is_dtensor(g) and faulty.numel() != math.prod(shape) else faulty.view(shape)
                shard = shard_coords(g)
                self._corrupt(i, spec, t, view, channel_dim=channel_dim, call=index, log=log, shard=shard)
                faulty = rewrap(faulty, g)
                return tuple(faulty if k == edge.index else gi for k, gi in enumerate(grad_inputs))

            edge.node.register_hook(corrupt)
            return None

        return hook

    def _grad_weight_hook(self, i, spec, t: Target):
        """Forward hook: reach this call's dW through its autograd node (weight_grad_edge)."""

        def hook(module, args, output):
            index = self._index(i, t)  # this call's: its dW is call `index` too
            if not isinstance(output, torch.Tensor) or not output.requires_grad or output.numel() == 0:
                return None  # (no tokens: dW = dYᵀX sums over none, no product computed)
            edge = weight_grad_edge(output, module.weight)
            if edge is None:
                raise RuntimeError(
                    f"gemm.grad_weight on {t.name!r}: the weight's gradient does not "
                    f"come from this call's autograd graph (a flattened or wrapped parameter?)"
                )
            node, at = edge

            def corrupt(grad_inputs, grad_outputs):
                g = grad_inputs[at]
                if g is None or (log := self._call(i, spec, t, index, backward=True)) is None:
                    return None
                faulty = _local_copy(g)  # a DTensor's local shard (no collective)
                self._corrupt(i, spec, t, faulty, call=index, log=log, shard=shard_coords(g))
                faulty = rewrap(faulty, g)
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
        sparse_shape = grad.shape[: grad.sparse_dim()]
        strides = torch.tensor([math.prod(sparse_shape[d + 1 :]) for d in range(len(sparse_shape))])
        rows = (grad.indices().cpu() * strides.unsqueeze(1)).sum(0)  # flat index of each stored row
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
                    if site == "weight":  # .data: the write leaves param._version to the optimizer's
                        self._corrupt_resident(i, spec, t, t.param.data, t.param, "", when, permanent)
                    elif (after_update or self.micro_batch == 0) and self.optimizer is not None:
                        state = self.optimizer.state.get(t.param, {})
                        for key in element_state(state, t.param):
                            if spec.state_key in (None, key):
                                self._corrupt_resident(i, spec, t, state[key], state[key], f":{key}", when, permanent)

    def _corrupt_resident(
        self,
        i: int,
        spec: FaultSpec,
        t: Target,
        tensor: torch.Tensor,
        owner: torch.Tensor,
        suffix: str,
        when: str | None,
        permanent: bool,
    ) -> None:
        """Corrupt a tensor held in memory. A permanent fault acts on each value written there
        (by an update) once: while ``owner``'s version says nothing rewrote it since the fault
        went in, it is in place -- applying it again would undo a bit flip. A resumed run meets
        the faults that started before it in place (see ``resumed_at``): where they lie is where
        their last application, at step ``resumed_at - 1``, put them."""
        key = (i, t.name + suffix)
        got = self._resident.get(key)
        if permanent and got is None and spec.schedule.start < self.resumed_at:
            index = self._apply(spec, t, _local_copy(tensor), suffix=suffix, step=self.resumed_at - 1).index
            got = self._resident[key] = (id(owner), owner._version, index)
        if permanent and got is not None and got[:2] == (id(owner), owner._version):
            values = local(tensor).reshape(-1)[got[2]].clone()  # in place: logged as such (before == after)
            result = FaultResult(got[2], values, values)
            self._record(i, spec, t.name + suffix, result, when=when, shard=shard_coords(tensor))
            return
        result = self._corrupt(i, spec, t, tensor, suffix=suffix, when=when)
        if permanent:
            self._resident[key] = (id(owner), owner._version, result.index)

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        """A permanent memory fault survives the update: re-apply it to the new values."""
        self._apply_memory_faults(after_update=True)
