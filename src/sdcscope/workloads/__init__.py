"""Reference workloads on real data: a byte-level GPT and a LeNet-style CNN on digits."""

from sdcscope.workloads.base import (
    CNNWorkload,
    GPTWorkload,
    ParallelizePlan,
    Workload,
    WorkloadConfig,
    make_workload,
)
from sdcscope.workloads.cnn import CNNConfig, LeNet
from sdcscope.workloads.data import ByteCorpus, mix_seed, step_generator
from sdcscope.workloads.gpt import GPT, GPTConfig, MatMul, lm_loss

__all__ = [
    "GPT",
    "GPTConfig",
    "MatMul",
    "lm_loss",
    "LeNet",
    "CNNConfig",
    "ByteCorpus",
    "Workload",
    "WorkloadConfig",
    "ParallelizePlan",
    "GPTWorkload",
    "CNNWorkload",
    "make_workload",
    "mix_seed",
    "step_generator",
]
