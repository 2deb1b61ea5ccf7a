"""Comparisons of training state shared by the trainer-integration tests."""

import torch


def same(a, b):
    """Bitwise-equal tensor lists."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(a, b):
    """Same parameters and optimizer state: each a (parameters, [per-parameter state dicts]) pair."""
    return same(a[0], b[0]) and len(a[1]) == len(b[1]) and \
        all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1], b[1]))
