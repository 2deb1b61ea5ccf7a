"""A ring of verified in-memory snapshots for rollback without touching disk."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from sdcscope._validate import check_positive
from sdcscope.engine.state import TrainState, apply, capture


@dataclass(kw_only=True)
class SnapshotConfig:
    every: int = 50
    """Take a snapshot every M optimizer steps (only of a state no detector complained about)."""
    keep: int = 2
    """Ring size K: the K most recent verified snapshots are kept in memory."""

    def __post_init__(self) -> None:
        check_positive("snapshot every", self.every)
        check_positive("snapshot keep", self.keep)


class SnapshotRing:
    """Keeps the last K verified training states; ``latest()`` is the rollback target."""

    def __init__(self, config: SnapshotConfig | None = None) -> None:
        self.config = config or SnapshotConfig()
        self._ring: deque[TrainState] = deque(maxlen=self.config.keep)

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def take(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data_pos: int,
             lr_scale: float = 1.0, extra: dict | None = None) -> TrainState:
        state = capture(model, optimizer, step, data_pos, lr_scale, extra)
        self._ring.append(state)
        return state

    def latest(self) -> TrainState | None:
        return self._ring[-1] if self._ring else None

    def restore_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainState | None:
        state = self.latest()
        if state is not None:
            apply(state, model, optimizer)
        return state

    def __len__(self) -> int:
        return len(self._ring)
