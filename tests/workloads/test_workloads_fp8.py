"""The GPT's FP8 precision: the blocks' Linears become Fp8Linear holding the parameters the fp32
model would have (same init), the rest stays fp32, and a bad precision is refused before any work,
on the command line too."""

import pytest
import torch
from torch import nn

from helpers import cli_fails
from sdcscope.common.fp8 import Fp8Linear
from sdcscope.workloads import WorkloadConfig, make_workload
from sdcscope.workloads.gpt import GPT, GPTConfig


def test_fp8_gpt_converts_the_blocks_linears_only_with_the_fp32_init():
    cfg = dict(n_layer=1, n_head=2, d_model=32, block_size=8)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**cfg))
    torch.manual_seed(0)
    m = GPT(GPTConfig(**cfg, precision="fp8"))
    fp8 = sorted(n for n, x in m.named_modules() if isinstance(x, Fp8Linear))
    assert fp8 == sorted(n for n, x in ref.named_modules() if type(x) is nn.Linear and n.startswith("blocks."))
    assert type(m.head) is nn.Linear
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m.state_dict().values()))


def test_bad_precision_refused(tmp_path):
    with pytest.raises(ValueError, match="precision.*'fp16'.*fp32, fp8"):
        WorkloadConfig(precision="fp16")
    with pytest.raises(ValueError, match="gpt workload only"):
        WorkloadConfig(workload="cnn", precision="fp8")
    with pytest.raises(ValueError, match="FP8 Linears.*--parallel ddp"):
        make_workload(WorkloadConfig(precision="fp8", eval_batches=1, max_corpus_bytes=20_000)).check_parallel("tp", 2)
    cli_fails(["train", "--precision", "int4", "--out", str(tmp_path / "r")], "int4", "fp32, fp8")
    assert not (tmp_path / "r").exists()
