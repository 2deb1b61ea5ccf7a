"""Real training data with no download: byte corpora and the 8×8 digits (scikit-learn's, shipped here).

The default text corpus is the source of the running Python's standard library (``*.py`` files
under ``sysconfig.get_paths()["stdlib"]``, read as bytes in sorted path order).  A user can name
any text file or folder instead.  The corpus is split once into train/validation by position
(the last ``val_fraction`` of the bytes is validation), and the batch for step ``s`` is a pure
function of ``(seed, s, micro_batch)``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".cfg")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def _corpus_files(path: Path) -> Iterator[Path]:
    """Files of a corpus in a stable (sorted, depth-first) order, lazily, so reading stops early."""
    if path.is_file():
        yield path
        return
    if not path.is_dir():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist (give a text file or a folder)")
    suffixes = (".py",) if path == stdlib_root() else TEXT_SUFFIXES
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(suffixes):
                yield Path(root, name)


def read_corpus(path: str | Path | None = None, max_bytes: int = 4_000_000) -> bytes:
    """Concatenate the files of a corpus (default: the stdlib source) up to ``max_bytes``."""
    root = stdlib_root() if path is None else Path(path).expanduser().resolve()
    return _read_corpus(root, max_bytes)


@functools.lru_cache(maxsize=4)
def _read_corpus(root: Path, max_bytes: int) -> bytes:
    chunks, total = [], 0
    for f in _corpus_files(root):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        take = data[: max_bytes - total]
        chunks.append(take)
        total += len(take)
        if total >= max_bytes:
            break
    if total == 0:
        raise ValueError(f"corpus {str(root)!r} holds no readable text files")
    return b"\n".join(chunks)


def mix_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from a tuple (independent of PYTHONHASHSEED and of call order)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: int, micro_batch: int = 0, stream: str = "data") -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(stream, seed, step, micro_batch))


@dataclass
class ByteCorpus:
    """A byte corpus split into train and validation tensors of uint8."""

    train: torch.Tensor
    val: torch.Tensor
    sha256: str
    source: str

    @classmethod
    def load(
        cls, path: str | Path | None = None, *, max_bytes: int = 4_000_000, val_fraction: float = 0.1
    ) -> ByteCorpus:
        raw = read_corpus(path, max_bytes)
        data = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        n_val = max(1, int(len(data) * val_fraction))
        return cls(
            train=data[:-n_val],
            val=data[-n_val:],
            sha256=hashlib.sha256(raw).hexdigest(),
            source=str(stdlib_root() if path is None else Path(path).expanduser()),
        )

    def batch(self, seed: int, step: int, micro_batch: int, batch_size: int, block_size: int):
        """Random windows of the train split; a pure function of (seed, step, micro_batch)."""
        g = step_generator(seed, step, micro_batch)
        starts = torch.randint(0, len(self.train) - block_size - 1, (batch_size,), generator=g)
        return _windows(self.train, starts, block_size)

    def val_batches(self, n_batches: int, batch_size: int, block_size: int):
        """Fixed, evenly spaced validation windows (independent of the seed)."""
        total = n_batches * batch_size
        starts = torch.linspace(0, len(self.val) - block_size - 2, total).long()
        return [_windows(self.val, s, block_size) for s in starts.split(batch_size)]


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int):
    offsets = starts[:, None] + torch.arange(block_size + 1)[None, :]
    chunk = data[offsets].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


DIGITS_FILE = Path(__file__).parent / "assets" / "digits.npz"
"""The 8×8 digits shipped with the package (licence: ``assets/DIGITS-LICENSE.txt``)."""


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 8×8 digits as scikit-learn's ``load_digits()`` gives them: ``(images, target)``,
    float64 ``[1797, 8, 8]`` pixels 0..16 and int64 labels, read from the copy in this package
    (stored as uint8), so the CNN workload needs neither scikit-learn nor a download."""
    with np.load(DIGITS_FILE, allow_pickle=False) as z:
        return z["images"].astype(np.float64), z["target"].astype(np.int64)


def load_digits_tensors(val_fraction: float = 0.2):
    """The 8×8 digits (1,797 images, shipped with the package, no download).

    Returns ``(x_train, y_train, x_val, y_val)`` with images as float32 ``[N, 1, 8, 8]`` in [0, 1],
    split by a fixed permutation so every run sees the same split.
    """
    images, target = load_digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = int(len(x) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]
