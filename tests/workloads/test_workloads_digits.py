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


def test_label_noise_replaces_a_share_of_training_labels_afresh_each_step_and_only_there():
    from sdcscope.workloads import WorkloadConfig, make_workload

    clean = make_workload(WorkloadConfig(workload="cnn", batch_size=512))
    noisy = make_workload(WorkloadConfig(workload="cnn", batch_size=512, label_noise=0.3))
    changed = []
    for step in range(4):
        (xc, yc), (xn, yn) = clean.batch(1, step), noisy.batch(1, step)
        assert torch.equal(xc, xn)  # the same images: only labels change
        changed.append(yc != yn)
        assert torch.equal(yn, noisy.batch(1, step)[1])  # reproducible from (seed, step)
    share = torch.stack(changed).float().mean().item()
    assert 0.3 * 0.9 * 0.8 < share < 0.3 * 0.9 * 1.2  # 30 % redrawn, a tenth of them to the same class
    assert not torch.equal(changed[0], changed[1])  # afresh every step, not a fixed set of examples
    assert noisy.x_val is not None and torch.equal(noisy.y_val, clean.y_val)  # validation stays clean
    for bad, match in ((1.0, "label_noise"), (-0.1, "label_noise")):
        with pytest.raises(ValueError, match=match):
            WorkloadConfig(workload="cnn", label_noise=bad)
    with pytest.raises(ValueError, match="label_noise applies to the cnn workload only, not 'gpt'"):
        WorkloadConfig(workload="gpt", label_noise=0.1)
