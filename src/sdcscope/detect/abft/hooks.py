"""ABFT's module and tensor hooks: the forward pre-hook (operand views for dX / dA / dB), the
forward hook that records a call's checks, the call numbering, and the shield that keeps an error
in a hook from crashing training (:class:`ModuleHooks`, a part of :class:`ABFTDetector`)."""

from __future__ import annotations

import torch
from torch import nn

from sdcscope.common.graph import in_backward
from sdcscope.common.world import local
from sdcscope.detect.abft.records import CallContext, Layer
from sdcscope.detect.rounding import rounding_model


class ModuleHooks:
    """The :class:`ABFTDetector` part that builds its hooks (uses its ``config``, ``layers``,
    ``_active``, ``_models``, ``_cs``, ``_error`` and the Linear / Conv / MatMul checks)."""

    # ------------------------------------------------------------------ hooks
    def _shielded(self, hook):
        """``hook`` run inside the user's forward or backward pass: an error in it must not crash
        training. The first one is kept, its step's checks are dropped, and :meth:`check` raises
        it (the guard reports it as an ``internal_error`` event, or re-raises in strict mode).
        Inside a ``torch.compile`` graph the hook is traced as a no-op (a hook run eagerly would
        break the graph at every layer; traced, its Python bookkeeping would recompile the
        model's frames past dynamo's limit): see :attr:`ABFTDetector.compiled`."""

        def shielded(*args):
            try:
                return hook(*args)
            except Exception as exc:
                if self._error is None:
                    self._error = exc
                return None

        eager = torch.compiler.disable(shielded, recursive=True)

        def entry(*args):
            if torch.compiler.is_compiling():  # traced as a no-op: no graph break (see ``compiled``)
                self._compiled_seen = True
                return None
            return eager(*args)

        return entry

    def _model(self, cd: torch.dtype, device: torch.device):
        """The rounding model of this step's GEMMs in ``cd`` on ``device`` (torch settings)."""
        got = self._models.get((cd, device))
        if got is None:
            got = self._models[(cd, device)] = rounding_model(cd, device, self._cs)
        return got

    def _pre_hook(self, layer: Layer):
        grads = {"grad_input", "grad_weight"} & set(self.config.gemms)

        def hook(module, args, kwargs):
            if not self._on(layer):
                return None
            ctx = CallContext(call=self._call(layer))
            layer.open_ctx = ctx
            if not (grads and torch.is_grad_enabled()):
                return None
            new, new_kw = list(args), dict(kwargs)
            for pos, key in enumerate(layer.names):
                x = args[pos] if pos < len(args) else kwargs.get(key)
                if not isinstance(x, torch.Tensor) or not x.requires_grad:
                    continue
                gemm = "grad_input" if pos == 0 else "grad_weight"
                if gemm not in grads:
                    continue
                if pos == 0:
                    ctx.x = x
                view = x.view_as(x)
                view.register_hook(self._grad_operand_hook(layer, ctx, pos))
                ctx.need.add(f"op{pos}")
                if pos < len(args):
                    new[pos] = view
                else:
                    new_kw[key] = view
            return tuple(new), new_kw

        return self._shielded(hook)

    def _fwd_hook(self, layer: Layer):
        gemms = set(self.config.gemms)

        def hook(module, args, kwargs, out):
            ctx, layer.open_ctx = layer.open_ctx, None
            layer.hits += 1
            fast = ctx is None and layer.pre is None  # no pre-hook ran: the fast path's call
            if (ctx is None and not fast) or not self._on(layer) or not isinstance(out, torch.Tensor):
                return None
            if fast:
                ctx = CallContext(call=self._call(layer))
            if out.requires_grad and not self._marked and ctx.call[1] is not None:
                self._marked = True  # its gradient tells that this micro-batch's backward ran
                out.register_hook(self._marker)
            ops = [args[i] if i < len(args) else kwargs.get(k) for i, k in enumerate(layer.names)]
            if not all(isinstance(t, torch.Tensor) for t in ops):
                ctx.release()
                return None
            with torch.no_grad():
                if layer.kind == "linear":
                    self._linear_forward(layer, ctx, module, ops[0], out, gemms, fast)
                elif layer.kind == "conv":
                    self._conv_forward(layer, ctx, module, ops[0], out, gemms)
                elif not self._matmul_forward(layer, ctx, *ops, out, gemms):
                    return None
                if ctx.need and out.requires_grad:
                    if "dy" not in ctx.need:
                        out.register_hook(self._dy_hook(ctx))
                else:
                    ctx.release()  # no gradient check will come: drop the operands
            return None

        return self._shielded(hook)

    def _call(self, layer: Layer) -> tuple[int, int | None]:
        """(micro-batch, index) of this forward call of ``layer`` (see the package docstring): the
        first forward after a backward pass begins a new micro-batch; a forward inside the backward
        pass (a checkpoint's recompute) is no new call (index None)."""
        if in_backward():
            return self._micro_batch, None
        if self._backward_ran:
            self._backward_ran = self._marked = False
            self._micro_batch += 1
            for x in self.layers:
                x.calls = 0
        layer.calls += 1
        return self._micro_batch, layer.calls - 1

    def _backward_seen(self, grad=None) -> None:
        self._backward_ran, self._marked = True, False

    def _grad_operand_hook(self, layer: Layer, ctx: CallContext, pos: int):
        """Tensor hook on the view of operand ``pos`` the pre-hook handed the module: its gradient."""

        def hook(grad):
            if layer.kind == "conv":  # a self-padding conv: dX as the module's input receives it
                self._conv_module_dx(layer, ctx, grad)
            else:
                self._operand_grad(layer, ctx, pos, local(grad))  # tensor parallel: the local shard
            return None

        return self._shielded(hook)


def keep_last(layer: Layer) -> None:
    """Move ABFT's forward hook back to the end of the module's hook order, so that a hook
    registered after ``attach()`` (an injector editing the output) still runs before the check --
    but before a tensor-parallel plan's output hook (which reduces a rowwise layer's partial
    sums) or FSDP2's (which shards the weight again), and ABFT's pre-hook after the plan's input
    hook (:mod:`~sdcscope.detect.abft.tensorparallel`).
    Uses the module's ordered hook dicts (no public API reorders hooks)."""
    module = layer.module
    hooks = getattr(module, "_forward_hooks", None)
    hid = layer.fwd.id if layer.fwd is not None else None
    if hooks is None or hid not in hooks:
        return
    pre = getattr(module, "_forward_pre_hooks", None)
    pid = layer.pre.id if layer.pre is not None else None
    if pre is not None and pid in pre and next(reversed(pre)) != pid and any(map(_plan_hook, pre.values())):
        pre.move_to_end(pid)
    keys = [k for k in hooks if k != hid]
    plan = next((i for i, k in enumerate(keys) if _plan_hook(hooks[k])), len(keys))
    want = [*keys[:plan], hid, *keys[plan:]]
    if list(hooks) != want:
        for k in want[plan:]:  # ABFT's, then the plan's and those after it, in their order
            hooks.move_to_end(k)


def _plan_hook(fn) -> bool:
    """Whether a module hook is a sharding engine's: a tensor-parallel plan's (``distribute_module``,
    ``ParallelStyle``), or FSDP2's on a module ``fully_shard`` split itself (its pre-hook gathers
    the weight, its forward hook shards it again: ABFT's check reads the gathered one)."""
    fn = getattr(fn, "func", fn)  # a functools.partial
    return str(getattr(fn, "__module__", "") or "").startswith(("torch.distributed.tensor", "torch.distributed.fsdp"))


def backward_hooked(module: nn.Module) -> bool:
    """Full backward (pre-)hooks on ``module`` or on every module: they may edit dX or dY."""
    g = nn.modules.module
    return bool(
        module._backward_hooks or module._backward_pre_hooks or g._global_backward_hooks or g._global_backward_pre_hooks
    )
