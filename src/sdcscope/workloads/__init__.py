"""Reference workloads on real data: a byte-level GPT, its mixture-of-experts twin and a LeNet-style
CNN on digits."""

from sdcscope.workloads.base import (
    CNNWorkload,
    GPTWorkload,
    MoEWorkload,
    ParallelizePlan,
    Workload,
    WorkloadConfig,
    make_workload,
)
from sdcscope.workloads.cnn import CNNConfig, LeNet
from sdcscope.workloads.data import ByteCorpus, mix_seed, step_generator
from sdcscope.workloads.gpt import GPT, GPTConfig, MatMul, lm_loss
from sdcscope.workloads.moe import MoEConfig, MoEGPT, MoELayer, TokenDispatch

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
    "MoEWorkload",
    "MoEConfig",
    "MoEGPT",
    "MoELayer",
    "TokenDispatch",
    "CNNWorkload",
    "make_workload",
    "mix_seed",
    "step_generator",
]
