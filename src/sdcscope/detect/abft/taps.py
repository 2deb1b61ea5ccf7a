"""Functional taps: ABFT's Linear checks on the ``F.linear`` calls a module makes on a weight of
its own (an MoE's expert weights, a router, ``nn.MultiheadAttention``'s projections), which no
module hook sees: ``torch.nn.functional.linear`` is wrapped while such a layer is sampled."""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from sdcscope.detect.abft.records import Layer

if TYPE_CHECKING:
    from sdcscope.detect.abft.detector import ABFTDetector


class FunctionalTaps:
    """The :class:`ABFTDetector` part that finds the layers whose weight is applied with ``F.linear``
    (or not reached at all) and checks those calls (uses its ``layers``, ``_functional``, ``_chosen``,
    ``_reached``, ``_misses``, ``unreached``, ``_attached``, ``_on`` and ``_fwd_hook``)."""

    def _add_functional(self, name: str, weight: nn.Parameter, owner: nn.Module) -> None:
        """Layers for the ``F.linear`` calls a module makes on its own weight ``name``: one for a
        2-D weight (a router), one per leading index of a 3-D one (``experts.gate_up_proj[e]``)."""
        if weight.dim() not in (2, 3):
            return
        names = [name] if weight.dim() == 2 else [f"{name}[{e}]" for e in range(weight.shape[0])]
        layers = [Layer(n, _Applied(owner, weight), "linear", names=("input",)) for n in names]
        for layer in layers:
            layer.functional = self._fwd_hook(layer)
        self._functional[id(weight)] = layers
        self.layers += layers

    def _applied_by_owner(self, layer: Layer) -> None:
        """A Linear sampled twice without its forward running while its weight got gradients:
        another module applies its weight with ``F.linear`` (``nn.MultiheadAttention``'s
        ``out_proj``). Its checks move to those calls."""
        for handle in (layer.fwd, layer.pre):
            if handle is not None:
                handle.remove()
        layer.fwd = layer.pre = None
        layer.module = _Applied(layer.module, layer.module.weight)
        layer.functional = self._fwd_hook(layer)
        self._functional[id(layer.module.weight)] = [layer]
        self._misses.pop(layer.name, None)  # two more such steps (no F.linear either): unreached

    def _functional_call(self, x, weight: torch.Tensor, bias, out) -> None:
        """An ``F.linear`` call anywhere: checked as a Linear when ``weight`` is one of the weights
        of :meth:`_add_functional` (or one expert's slice of it) and its layer is sampled."""
        base = weight if weight._base is None else weight._base
        layers = self._functional.get(id(base))
        if not layers:
            return
        if base.dim() == 3:  # one expert: a select along dim 0
            e, r = divmod(weight.storage_offset() - base.storage_offset(), base.stride(0))
            if r or not 0 <= e < len(layers) or weight.shape != base.shape[1:] or weight.stride() != base.stride()[1:]:
                return
            layer = layers[e]
        elif weight is base:
            layer = layers[0]
        else:
            return
        if not (self._attached and isinstance(x, torch.Tensor) and self._on(layer)):
            return
        applied = layer.module
        applied.weight, applied.bias = weight, bias
        try:
            layer.functional(applied, (x,), {}, out)
        finally:
            applied.weight, applied.bias = base, None

    def _sync_probe(self, layer: Layer, on: bool) -> None:
        """Until its forward hook has fired once, a sampled Linear's weight carries a hook: a step
        whose backward reached the weight without the module's forward (``F.linear`` on it) is
        evidence that the layer is :attr:`unreached`; a step that did not use it (a dropped
        block, an idle expert) is not."""
        w = layer.module.weight if layer.kind != "matmul" else None
        want = on and w is not None and w.requires_grad and layer.name not in self._reached
        if want and layer.probe is None:
            layer.probe = w.register_hook(lambda grad, layer=layer: setattr(layer, "grad_seen", True))
        elif not want and layer.probe is not None:
            layer.probe.remove()
            layer.probe = None

    def _note_reached(self) -> None:
        """A sampled layer whose forward hook never fired, on two checked steps whose backward
        reached its weight (see :meth:`_sync_probe`; a layer without that probe -- a MatMul, a
        frozen weight -- on any two checked steps), is :attr:`unreached` (warned once)."""
        new = []
        applied = {id(x.module.weight) for x in self._chosen if x.functional is not None and x.hits}
        for x in self._chosen:
            if x.hits:
                self._reached.add(x.name)
            elif x.functional is not None and id(x.module.weight) in applied:
                pass  # another expert of the same weight was called: this one got no token
            elif x.name not in self._reached and (x.grad_seen or x.probe is None):
                self._misses[x.name] = self._misses.get(x.name, 0) + 1
                if self._misses[x.name] == 2 and x.kind == "linear" and x.functional is None and not x.w_in_out:
                    self._applied_by_owner(x)  # its weight's F.linear calls are checked from now on
                elif self._misses[x.name] == 2:
                    new.append(x.name)
            x.hits, x.grad_seen = 0, False
        if new:
            self.unreached.update(new)
            warnings.warn(
                f"ABFT: {', '.join(new)} sampled but never called through their own forward (e.g. "
                "nn.MultiheadAttention's out_proj, which the attention applies with F.linear), or, "
                "for a weight a module applies itself, never by F.linear (bmm, einsum, a grouped "
                "GEMM kernel: transformers' MoE layers apply their experts with F.linear under "
                "experts_implementation='eager'): their GEMMs are not checked, and they leave the "
                "sampling rotation",
                stacklevel=3,
            )


class _Applied:
    """What ABFT's Linear hook reads of a module (``weight``, ``bias``, ``training``) for an
    ``F.linear`` call a module makes on its own weight: the call's weight and bias, set per call."""

    def __init__(self, owner: nn.Module, weight: nn.Parameter) -> None:
        self.owner, self.weight, self.bias = owner, weight, None

    @property
    def training(self) -> bool:
        return self.owner.training


_linear_taps: weakref.WeakSet[ABFTDetector] = weakref.WeakSet()  # a dropped detector leaves by itself
_linear_original: list = []


def _linear(input, weight, bias=None):
    out = _linear_original[0](input, weight, bias)
    if _linear_taps and not torch.compiler.is_compiling():
        for det in list(_linear_taps):
            det._functional_call(input, weight, bias, out)
    return out


def install_tap(det: ABFTDetector) -> None:
    """``torch.nn.functional.linear`` wrapped while a detector with functional layers is armed
    (``nn.Linear`` calls it too: they then pay one Python call and a dict lookup)."""
    if not _linear_original:
        _linear_original[:] = [torch.nn.functional.linear]
        torch.nn.functional.linear = _linear
    _linear_taps.add(det)


def remove_tap(det: ABFTDetector) -> None:
    _linear_taps.discard(det)
    if not _linear_taps and _linear_original:
        torch.nn.functional.linear = _linear_original.pop()


def owner_module(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])
