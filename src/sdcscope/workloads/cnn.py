"""A LeNet-style CNN for the 8×8 digits (scikit-learn's, shipped with sdcscope): the workload of the
accelerator-fault study.

Layer names: ``conv1``, ``conv2`` (nn.Conv2d, weights ``[out, in, kh, kw]`` so an NVDLA-style
MAC cell (input channel a, output channel b) maps to ``weight[b, a]``), ``fc1``, ``fc2``, ``fc3``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.validate import check_choice, check_positive


@dataclass(kw_only=True)
class CNNConfig:
    channels1: int = 8
    channels2: int = 16
    hidden: int = 64

    def __post_init__(self) -> None:
        for name in ("channels1", "channels2", "hidden"):
            check_positive(name, getattr(self, name))

    def to_dict(self) -> dict:
        return asdict(self)


CNN_PRESETS: dict[str, CNNConfig] = {
    "tiny": CNNConfig(channels1=8, channels2=16, hidden=64),
    "small": CNNConfig(channels1=16, channels2=32, hidden=128),
    "base": CNNConfig(channels1=32, channels2=64, hidden=256),
}


def cnn_preset(name: str) -> CNNConfig:
    check_choice("preset", name, CNN_PRESETS)
    return CNNConfig(**CNN_PRESETS[name].to_dict())


class LeNet(nn.Module):
    def __init__(self, cfg: CNNConfig, n_classes: int = 10) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv2d(1, cfg.channels1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(cfg.channels1, cfg.channels2, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(cfg.channels2 * 2 * 2, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc3 = nn.Linear(cfg.hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 8×8 → 4×4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 4×4 → 2×2
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)
