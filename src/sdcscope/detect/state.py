"""Memory corruption of weights and optimizer state between steps, caught bit-exactly.

After every optimizer update the detector records an integer checksum of each parameter and
each optimizer-state tensor: the stored bits viewed as integers and summed in int64
(wrap-around). A single flipped bit changes such a sum by ±2^k, never by 0, so any flip is
seen. Before the next forward pass :meth:`StateChecksum.verify` recomputes the sums (one fused
pass, one host sync) and names every tensor that changed although nothing legitimate wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sdcscope.common.validate import check_bool, check_positive
from sdcscope.detect.events import Event

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(kw_only=True)
class StateChecksumConfig:
    every: int = 1
    """Verify before the forward pass of steps with ``step % every == 0`` (and record after the
    update of the step before)."""
    optimizer_state: bool = True

    def __post_init__(self) -> None:
        check_positive("state checksum every", self.every)
        check_bool("state checksum optimizer_state", self.optimizer_state)


def _int_sum(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(_INT_VIEW[t.element_size()]).sum(dtype=torch.int64)


class StateChecksum:
    """``record()`` after the optimizer step; ``verify(step)`` before the next forward → events."""

    name = "state_checksum"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: StateChecksumConfig | None = None,
        *,
        rank: int | None = None,
    ) -> None:
        self.config = config or StateChecksumConfig()
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self._names: list[str] = []
        self._sums: torch.Tensor | None = None

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors, seen = [], [], set()
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            names.append(name)
            tensors.append(p)
            if self.optimizer is not None and self.config.optimizer_state:
                for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        names.append(f"{name}:{key}")
                        tensors.append(value)
        return names, tensors

    def _sums_now(self) -> tuple[list[str], torch.Tensor]:
        names, tensors = self._tensors()
        return names, torch.stack([_int_sum(t) for t in tensors]) if tensors else torch.zeros(0)

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def record(self) -> None:
        """Remember the state as the optimizer left it (call after every update or restore)."""
        self._names, self._sums = self._sums_now()

    def forget(self) -> None:
        self._sums = None

    def verify(self, step: int) -> list[Event]:
        if self._sums is None:
            return []
        names, sums = self._sums_now()
        if names != self._names:  # state grew (first Adam step) or shrank: nothing to compare
            return []
        changed = (sums != self._sums).nonzero().flatten().tolist()  # the one host sync
        return [
            Event(
                step,
                self.name,
                "corrupt",
                module=names[i].split(":")[0],
                rank=self.rank,
                evidence={"tensor": names[i], "checksum_before": int(self._sums[i]), "checksum_now": int(sums[i])},
            )
            for i in changed
        ]
