"""The recorder's observers: what each hook and wrapped call adds to the open record.

A mixin of :class:`~sdcscope.invariants.recorder.TraceRecorder`, which owns the state these
methods read and write (the parameter bit masks, version counters, pending values) and installs
them as hooks on the model and optimizer and, through ``apis``, on torch's backward, clipping
and cross-entropy.  Forwards record their flags, input fingerprint, target shift and causality
probe; backward, clipping and ``optimizer.step`` record the calls and their effects on the
parameters (see the recorder's module doc for the record format).
"""

from __future__ import annotations

import weakref
from itertools import compress, repeat
from operator import attrgetter, is_not, ne
from typing import Any

import torch
from torch import nn

from sdcscope.common.tensors import dense_values
from sdcscope.invariants import probe
from sdcscope.invariants.names import to_hex
from sdcscope.invariants.traceconfig import CONFIRM_EVERY, MAX_SHIFT
from sdcscope.invariants.values import checksum

# Per-parameter bookkeeping runs through these with map(): C-level loops, not Python ones.
_GRAD, _VERSION, _TRAINING = attrgetter("grad"), attrgetter("_version"), attrgetter("training")


class Observers:
    """Hook callbacks of a ``TraceRecorder`` (see the module doc)."""

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if probe.running():  # a causality probe's forward (this recorder's or another's)
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
        where = probe.token_arg(args, kwargs)  # positional, or model(input_ids=...)
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
        windows = x.unfold(-1, n - MAX_SHIFT, 1)  # windows[:, k] = x[:, k:k + n - MAX_SHIFT], a view
        match = (windows == y[:, None, : n - MAX_SHIFT]).all(-1).all(0)
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
            self._grad_mask |= sum(
                bit
                for a, b, v, bit in zip(after, before, versions, self._bits)
                if a is not None and (a is not b or a._version != v)
            )

    def _grad_snapshot(self) -> tuple[list, list[int]]:
        """Weak references to the gradients and their versions (weak: holding the gradients
        would keep them alive after ``zero_grad(set_to_none=True)`` and raise peak memory)."""
        grads = list(map(_GRAD, self._params))
        if all(map(is_not, grads, repeat(None))):
            return list(map(weakref.ref, grads)), list(map(_VERSION, grads))
        return ([None if g is None else weakref.ref(g) for g in grads], [0 if g is None else g._version for g in grads])

    def _cleared_mask(self, grads: list, none: bool) -> int:
        """Parameters whose gradient is None, or was written, since the previous step ended
        (with no previous step to compare with, every gradient counts as cleared)."""
        if none or self._last_grads is None:
            return self._all
        refs, versions = self._last_grads
        return sum(
            bit
            for g, bit, ref, v in zip(grads, self._bits, refs, versions)
            if g is None or ref is None or ref() is not g or g._version != v
        )

    def on_clip(
        self, params: list[torch.Tensor], max_norm: float, norm_type: float | None, total: torch.Tensor
    ) -> None:
        if not self._in_step:
            return
        mask = sum(set(map(self._bit.get, map(id, params), repeat(0))))  # a set: listed twice counts once
        if not mask:
            return  # another model's parameters
        fields = {"max_norm": max_norm, "params": to_hex(mask)}
        if norm_type is not None:  # None: an aliased clip_grad_norm_, whose norm type is not seen
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
        if not self._updates_seen:
            self._updates_seen = True
            if any(opt.state.values()):  # state before this run's first update: a checkpoint's
                self._record()["resumed"] = True
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
            norms = torch._foreach_norm(diff)  # 0 where every value is the same (the 2-norm is the fast
            try:  # one; only changes below ~1e-22 would underflow)
                same = torch.stack(norms) == 0
            except RuntimeError:  # parameters on several devices
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
        except RuntimeError:  # gradients on several devices
            stacked = torch.stack([n.to(norms[0].device) for n in norms])
        entry: dict[str, Any] = {"params": to_hex(sum(compress(self._bits, have)))}
        self._pend(stacked, entry, "norms", vector=True)
        self._record()["grad_norms"] = entry
