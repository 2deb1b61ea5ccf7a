"""The 8×8 digits ship with sdcscope: bitwise scikit-learn's ``load_digits()``, no scikit-learn needed."""

import sys

import numpy as np
import pytest
import torch

from sdcscope.workloads.data import DIGITS_FILE, load_digits_arrays, load_digits_tensors


def test_shipped_digits_are_bitwise_sklearns():
    datasets = pytest.importorskip("sklearn.datasets")
    ref = datasets.load_digits()
    images, target = load_digits_arrays()
    assert images.dtype == ref.images.dtype and target.dtype == ref.target.dtype
    assert images.tobytes() == ref.images.tobytes() and target.tobytes() == ref.target.tobytes()
    assert images.reshape(len(images), -1).tobytes() == ref.data.tobytes()
    # the workload's tensors, built as before from sklearn's arrays: the same bits
    x = torch.tensor(ref.images, dtype=torch.float32).unsqueeze(1) / 16.0
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = int(len(x) * 0.2)
    ours = load_digits_tensors()
    want = (
        x[perm[n_val:]],
        torch.tensor(ref.target)[perm[n_val:]],
        x[perm[:n_val]],
        torch.tensor(ref.target)[perm[:n_val]],
    )
    for a, b in zip(ours, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_digits_load_without_sklearn_and_carry_their_licence(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # importing it would fail
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    images, target = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and target.shape == (1797,)
    assert set(np.unique(images)) <= set(range(17)) and set(np.unique(target)) == set(range(10))
    licence = (DIGITS_FILE.parent / "DIGITS-LICENSE.txt").read_text()
    assert "CC BY 4.0" in licence and "BSD 3-Clause" in licence
