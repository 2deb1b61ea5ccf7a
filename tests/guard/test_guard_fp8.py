"""The Guard on a GPT whose Linears run FP8 GEMMs: a fault in an FP8 GEMM's result, operand or
scale is caught by ABFT in its step, named by layer and GEMM, and repaired: the final parameters
equal the golden run's bitwise."""

import pytest

from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload
from sdcscope.workloads.gpt import GPTConfig

STEP, STEPS = 1, 3


@pytest.fixture(scope="module")
def fp8_gpt():
    wl = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, precision="fp8"))
    wl.model_config = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=16, precision="fp8")
    return wl


def run(workload, spec=None):
    trainer = Trainer(workload, TrainConfig(seed=3))
    if spec is not None:
        inj = Injector(trainer.model, [FaultSpec.from_dict(spec)], trainer.optimizer).attach()
        trainer.add_callback(inj.callback())
    guard = Guard(trainer.model, trainer.optimizer, GuardConfig(profile="full"))
    trainer.add_callback(guard.callback())
    while trainer.step < STEPS:
        trainer.train_step()
    return trainer, guard


@pytest.fixture(scope="module")
def golden(fp8_gpt):
    trainer, guard = run(fp8_gpt)
    assert guard.events == []  # a clean FP8 run raises nothing
    return param_sha256(trainer.model)


@pytest.mark.parametrize(
    "site,operand,bit,target",
    [
        ("gemm.forward", None, 30, "blocks.0.mlp.fc"),  # an exponent flip of the fp32 result
        ("gemm.grad_input", "scale_b", 29, "blocks.0.attn.q_proj"),  # W's scale as dX's GEMM reads it
    ],
)
def test_fp8_gemm_fault_caught_named_and_repaired_bitwise(fp8_gpt, golden, site, operand, bit, target):
    spec = {"site": site, "target": target, "model": "bitflip", "bits": [bit], "seed": 5}
    spec["schedule"] = {"kind": "transient", "step": STEP}
    if operand is not None:
        spec["operand"] = operand
    trainer, guard = run(fp8_gpt, spec)
    abft = [e for e in guard.events if e["detector"] == "abft"]
    assert abft and all(e["step"] == STEP for e in guard.events)
    assert abft[0]["module"] == target and abft[0]["gemm"] == site.split(".")[1]
    assert abft[0]["verdict"] == "transient" and abft[0]["action"] == "recompute"
    assert param_sha256(trainer.model) == golden
