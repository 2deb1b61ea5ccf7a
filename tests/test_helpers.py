"""Sanity checks of the shared test helpers (tests/helpers.py)."""

from __future__ import annotations

import torch

from helpers import TinyTransformer, flip_bit, lm_batch, lm_loss


def test_flip_bit_exponent():
    t = torch.tensor([0.75, -0.25])
    flip_bit(t, (0,), 30)
    assert t[0].item() == 0.75 * 2.0**128
    flip_bit(t, (1,), 31)
    assert t[1].item() == 0.25


def test_tiny_transformer_runs():
    m = TinyTransformer()
    loss = lm_loss(m, lm_batch(0))
    loss.backward()
    assert torch.isfinite(loss)
