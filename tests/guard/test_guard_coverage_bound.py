"""The balanced profile's stated bound, earned: a persistent forward-GEMM fault in any GEMM layer
of the tiny GPT is caught by ABFT within the steps the detector states, and only by ABFT."""

from __future__ import annotations

import torch

from sdcscope.detect import ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject import Injector
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = make_workload(WorkloadConfig(workload="gpt", preset="tiny", batch_size=2))
START = 5  # the fault's first step: the layers' turns come at 17 different latencies from it, 0 to B - 1


def first_catch(layer: str, steps: int, tmp_path) -> tuple[dict, tuple[int, int]]:
    """Train the tiny GPT under the default guard (spike detectors off) with a fp32 bit-26 flip
    (one element × 2^8 or / 2^8: finite, so no non-finite check sees it) in ``layer``'s forward
    result from step :data:`START` on; -> the guard's first event and its ABFT's coverage bound."""
    torch.manual_seed(0)
    model = WORKLOAD.build_model()
    opt = WORKLOAD.build_optimizer(model)
    spec = FaultSpec(
        site="gemm.forward",
        target=layer,
        model="bitflip",
        bits=(26,),
        pattern={"kind": "element", "index": 7},
        schedule={"kind": "permanent", "start": START},
    )
    inj = Injector(model, [spec], opt).attach()
    config = GuardConfig(loss_spike=None, grad_spike=None, metrics=None)
    guard = Guard(model, opt, config, run_dir=tmp_path / layer, loss_fn=WORKLOAD.loss).attach()
    bound = guard.abft.coverage_bound()
    for step in range(steps):
        inj.set_position(step)
        batch = WORKLOAD.batch(0, step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = WORKLOAD.loss(model, batch)
            loss.backward()
        guard.optimizer_step(loss)
        if guard.events:
            break
    guard.close()
    inj.close()
    return (guard.events[0] if guard.events else {}), bound


def test_a_persistent_forward_fault_in_every_gemm_layer_is_caught_by_abft_within_the_stated_bound(tmp_path):
    layers = [x.name for x in ABFTDetector(WORKLOAD.build_model(), GuardConfig().abft).layers]
    assert len(layers) == 17  # 2 blocks × (q, k, v, o, score, context, fc, proj) + head
    latency = {}
    for layer in layers:
        event, (per_step, within) = first_catch(layer, START + 20, tmp_path)
        assert (per_step, within) == (1, 20)  # 17 layers in 20 slots: at most 1 a step, each once in 20 steps
        assert event, f"{layer}: no event within {within} steps of the fault"
        # ABFT's (the replay repeats the fault: 'reproducible'), not another detector's escalation
        assert (event["detector"], event["module"], event["gemm"]) == ("abft", layer, "forward"), event
        latency[layer] = event["step"] - START
    assert max(latency.values()) <= within - 1, latency
    # a slot of its own per layer: 17 different latencies, the longest near the bound
    assert len(set(latency.values())) == 17 and max(latency.values()) >= within - 3, latency
