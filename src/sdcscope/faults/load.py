"""Fault files: a YAML (or JSON) list of mappings, one :class:`~.spec.FaultSpec` per mapping::

- site: gemm.forward            # Y = X Wᵀ of an nn.Linear, in the forward pass
  target: blocks.0.attn.q_proj  # shell pattern(s) on module names
  model: bitflip
  bits: [30]
  pattern: {kind: element, index: random}
  schedule: {kind: transient, step: 5}
  rank: 0
  seed: 1
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from sdcscope.common.io import load_yaml, read_text
from sdcscope.common.validate import brief

from .spec import FaultSpec

__all__ = ["load_specs"]


def load_specs(source: str | os.PathLike[str]) -> list[FaultSpec]:
    """Fault specs from a YAML/JSON file path or from YAML/JSON text.

    The document is a list of mappings, or a single mapping (one spec). A ``str`` without
    a newline that names an existing file is read as a path; any other ``str`` as text.
    Errors name the file (or ``<text>``) and the position of the bad spec.
    """
    if isinstance(source, os.PathLike) or ("\n" not in source and os.path.isfile(source)):
        where = os.fspath(source)
        text = read_text(where)
    else:
        where, text = "<text>", source
    data = load_yaml(text, where)
    if data is None:
        return []
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        hint = "" if where != "<text>" else " (if this is a path, no such file exists)"
        raise ValueError(f"{where} must hold a list of fault specs, got {brief(data)}{hint}")
    specs = []
    for i, item in enumerate(data):
        try:
            specs.append(FaultSpec.from_dict(item))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"fault spec #{i} in {where}: {exc}") from exc
    return specs
