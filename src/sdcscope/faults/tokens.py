"""Token faults: a whole slot of a mixture-of-experts dispatch goes wrong (site ``dispatch``,
fault models :data:`~.vocab.TOKEN_MODELS`). The dispatched rows [slots, d] are what the token
permutation (an expert-parallel all-to-all) delivers to the experts; a slot is one row.

- ``drop``: the slot's token never arrived -- its row reads zeros (the buffer as allocated);
- ``duplicate``: the slot received the token of the next slot (cyclically) instead of its own:
  one token reaches this expert twice, the slot's own token not at all.
"""

from __future__ import annotations

import torch

from .ops import FaultResult

__all__ = ["apply_token_fault"]


def apply_token_fault(tensor: torch.Tensor, index: torch.Tensor, model: str) -> FaultResult:
    """Apply token fault ``model`` in place to the slot whose row's flat indices are ``index`` (a
    ``row`` pattern resolved on ``tensor``'s 2-D view [slots, d]); returns what changed."""
    if tensor.dim() < 2 or tensor.shape[0] < 1:
        raise ValueError(f"a token fault needs the dispatched rows [slots, d], got shape {list(tensor.shape)}")
    width = tensor.shape[-1]
    rows = tensor.reshape(-1, width)
    if rows.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise ValueError("a token fault acts on contiguous dispatched rows")
    slot = int(index[0]) // width
    if index.numel() != width or int(index[0]) % width or not torch.equal(index, index[0] + torch.arange(width)):
        raise ValueError(f"a token fault hits one whole slot (a row pattern), got flat indices {index.tolist()[:4]}...")
    with torch.no_grad():
        before = rows[slot].clone()
        if model == "drop":
            rows[slot] = 0
        elif model == "duplicate":
            rows[slot] = rows[(slot + 1) % rows.shape[0]]
        else:
            raise ValueError(f"unknown token fault model {model!r}; allowed: drop, duplicate")
        return FaultResult(index, before, rows[slot].clone())
