"""ABFT's graph taps (``ABFTConfig(graph=True)``), run eagerly: training is bitwise what it is without
them, a clean step stays far below the threshold, and a fault in a Linear's Y, dX or dW gives the
event the hooks give (layer, GEMM, index) -- in fp32 (column checks) and under bf16 autocast
(tile checks against the fp32 accumulator, a flip below the top exponent bit)."""

import pytest
import torch

from sdcscope.detect.abft import ABFTConfig, ABFTDetector
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
from sdcscope.workloads.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=16)
LAYER = "blocks.0.mlp.fc"


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def train(steps, *, graph=None, specs=(), bf16=False, micro=1):
    """Parameters after ``steps`` AdamW steps and the ABFT events of each step (``graph`` None: no
    ABFT), each step accumulating ``micro`` micro-batches."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    det = None
    if graph is not None:
        det = ABFTDetector(model, ABFTConfig(graph=graph, kinds=("linear",))).attach()
    # the injector reaches the GEMM as ABFT does: by hooks, or inside the graph taps (graph mode)
    inj = Injector(model, list(specs), warn_unfired=False, graph=bool(graph)).attach() if specs else None
    idx, tgt = batch()
    events = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for mb, (i, t) in enumerate(zip(idx.chunk(micro), tgt.chunk(micro))):
            if inj is not None:
                inj.set_position(step, mb)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(model(i), t) / micro
            loss.backward()
        events.append([] if det is None else det.check(step))
        opt.step()
    if inj is not None:
        inj.detach()
    return [p.detach().clone() for p in model.parameters()], events, det


def flip(site, bit):
    return FaultSpec.from_dict(
        {
            "site": site,
            "target": LAYER,
            "model": "bitflip",
            "bits": [bit],
            "pattern": {"kind": "element", "index": 100},
            "schedule": {"kind": "transient", "step": 1},
        }
    )


def test_graph_taps_leave_training_bitwise_unchanged():
    plain, _, _ = train(3)
    tapped, events, det = train(3, graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, tapped))
    assert events == [[], [], []]
    assert det.checks_run == 3 * 3 * 7  # Y, dX and dW of every Linear (q, k, v, o, fc, proj, head), each step


@pytest.mark.parametrize("bf16", [False, True])
def test_clean_steps_stay_far_below_the_threshold(bf16):
    _, events, det = train(4, graph=True, bf16=bf16)
    assert events == [[]] * 4
    assert max(det.max_ratio.values()) < det.config.c / 4


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_input", "gemm.grad_weight"])
@pytest.mark.parametrize("bf16", [False, True])
def test_graph_events_match_the_hooks(site, bf16):
    spec = flip(site, 13 if bf16 else 30)  # bf16: an exponent bit below the top one
    _, by_hooks, _ = train(2, graph=False, specs=[spec], bf16=bf16)
    _, by_graph, _ = train(2, graph=True, specs=[spec], bf16=bf16)
    assert by_hooks[0] == [] and by_graph[0] == []
    named = [(e.module, e.gemm, tuple(e.index), e.evidence["dtype"]) for e in by_graph[1]]
    assert named == [(e.module, e.gemm, tuple(e.index), e.evidence["dtype"]) for e in by_hooks[1]]
    assert named and named[0][:2] == (LAYER, site.split(".")[1])


@pytest.mark.parametrize("mb", [0, 1])
def test_micro_batches_are_judged_apart_as_by_the_hooks(mb):
    """Two micro-batches a step: each backward's checks are judged on their own (summed, the
    other micro-batch's rounding bound would hide a bf16 element halved or doubled: the lowest
    exponent bit)."""
    spec = FaultSpec.from_dict(
        {**flip("gemm.forward", 7).to_dict(), "schedule": {"kind": "transient", "step": 1, "micro_batch": mb}}
    )
    _, by_hooks, _ = train(2, graph=False, specs=[spec], bf16=True, micro=2)
    _, by_graph, _ = train(2, graph=True, specs=[spec], bf16=True, micro=2)
    named = [(e.module, e.gemm, tuple(e.index)) for e in by_graph[1]]
    assert named and named == [(e.module, e.gemm, tuple(e.index)) for e in by_hooks[1]]
