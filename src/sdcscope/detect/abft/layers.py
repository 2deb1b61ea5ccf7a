"""Which layers of a model ABFT checks: each matching module classified as a Linear, a
convolution, a MatMul-contract module or an FP8 Linear, or skipped with a reason ABFT cannot
check it; and the trainable weights no layer holds (applied in some module's own ``forward``)."""

from __future__ import annotations

import inspect

from torch import nn
from torch.nn.utils import parametrize

from sdcscope.common.fp8 import is_fp8_linear
from sdcscope.common.modules import CONV_TYPES, TRANSPOSED_TYPES, is_matmul, match_modules, weight_in_out
from sdcscope.detect.abft.config import ABFTConfig
from sdcscope.detect.abft.convcheck import checkable_conv
from sdcscope.detect.abft.records import Layer
from sdcscope.detect.abft.taps import owner_module


def find_layers(model: nn.Module, cfg: ABFTConfig) -> tuple[list[Layer], list[str], dict[str, nn.Module]]:
    """``(layers, skipped, eligible)``: the checkable layers, the names of the matching modules
    ABFT cannot check, and every module ``cfg.targets`` and ``cfg.kinds`` matched by name."""
    eligible = match_modules(
        model,
        cfg.targets,
        option="ABFT targets",
        where=lambda m: (
            ("linear" in cfg.kinds and (isinstance(m, nn.Linear) or weight_in_out(m)))
            or ("matmul" in cfg.kinds and is_matmul(m))
            or ("conv" in cfg.kinds and isinstance(m, CONV_TYPES + TRANSPOSED_TYPES))
        ),
    )
    layers: list[Layer] = []
    skipped: list[str] = []
    for name, mod in eligible.items():
        kind = (
            "fp8"
            if is_fp8_linear(mod)
            else "linear"
            if isinstance(mod, nn.Linear) or weight_in_out(mod)
            else "conv"
            if isinstance(mod, CONV_TYPES + TRANSPOSED_TYPES)
            else "matmul"
        )
        if kind not in ("matmul", "fp8") and (parametrize.is_parametrized(mod) or not _checkable(mod, kind, cfg)):
            skipped.append(name)
            continue
        names = _operand_names(mod, 2 if kind == "matmul" else 1)
        layers.append(Layer(name, mod, kind, names=names, w_in_out=weight_in_out(mod)))
    return layers, skipped, eligible


def _checkable(mod: nn.Module, kind: str, cfg: ABFTConfig) -> bool:
    """A convolution ABFT models, or a Linear whose output is x·Wᵀ + b with a real float weight."""
    if kind == "conv":
        return checkable_conv(mod)
    linear = weight_in_out(mod) or type(mod).forward is nn.Linear.forward or type(mod).__name__ in cfg.linear_subclasses
    return bool(linear) and mod.weight.is_floating_point()


def unchecked_params(model: nn.Module, layers: list[Layer], skipped: list[nn.Module]) -> list[str]:
    """Trainable floating-point weights (2-D and up) held by neither a checked layer nor a
    skipped module, embeddings aside."""
    covered = {id(p) for m in [x.module for x in layers] + skipped for p in m.parameters()}
    return [
        n
        for n, p in model.named_parameters()
        if id(p) not in covered
        and p.dim() >= 2
        and p.requires_grad
        and p.is_floating_point()
        and not isinstance(owner_module(model, n), (nn.Embedding, nn.EmbeddingBag))
    ]


def listed(names: list[str], shown: int = 4) -> str:
    """``names`` joined, the first ``shown`` of them and a count of the rest."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" (and {more} more)" if more > 0 else "")


def _operand_names(module: nn.Module, n: int) -> tuple[str, ...]:
    """Names of the first ``n`` parameters of ``module.forward`` (operands passed by keyword)."""
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []
    return tuple(params[:n]) + tuple(f"_{i}" for i in range(len(params), n))
