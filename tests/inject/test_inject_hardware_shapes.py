"""Hardware-shaped faults on every site that takes a pattern: a warp-aligned periodic element set
(or every k-th element) with a multi-bit burst per element, on a periodic schedule, lands where
the pattern says and recurs in place -- the same elements and bits at every firing."""

import copy
import types

import pytest
import torch
import torch._dynamo
from torch import nn

from sdcscope.faults import FaultSpec
from sdcscope.inject import CommInjector, Injector, corrupt_checkpoint_file, validate_specs

EXPONENT = list(range(23, 31))  # fp32
PATTERNS = {
    "warp": {"kind": "warp", "lanes": [2, 29], "stride": 2},  # lanes 2 and 29 of every other warp
    "strided": {"kind": "strided", "stride": 9},  # every 9th element from a drawn start
}
# site, target, numel of the tensor it lands on (the model below, a batch of 8)
SITES = [
    ("weight", "0", 128),
    ("activation", "1", 128),
    ("gemm.forward", "0", 128),
    ("gemm.grad_input", "2", 128),
    ("gemm.grad_weight", "2", 128),
    ("param_grad", "0.weight", 128),
    ("optimizer_state", "0.weight", 128),
]


def make_spec(site: str, target: str, kind: str, **kw) -> FaultSpec:
    return FaultSpec.from_dict(
        {
            "site": site,
            "target": target,
            "model": "bitflip",
            "bits": EXPONENT,
            "burst_bits": 3,
            "pattern": PATTERNS[kind],
            "schedule": {"kind": "periodic", "every": 2, "start": 1},
            "seed": 5,
            **kw,
        }
    )


def check_firings(records: list[dict], kind: str, numel: int) -> None:
    """Firings at steps 1 and 3, each the pattern's element set with a 3-bit exponent burst per
    element, identical at both."""
    assert [r["step"] for r in records] == [1, 3]
    shapes = []
    for r in records:
        index = r["index"]
        assert r["count"] == len(index) > 0
        if kind == "warp":
            warps = sorted({i // 32 for i in index})
            assert warps == list(range(warps[0], -(-numel // 32), 2)) and warps[0] < 2
            assert index == [w * 32 + lane for w in warps for lane in (2, 29)]
        else:
            assert index == list(range(index[0], numel, 9)) and index[0] < 9
        xor = [
            int(a) ^ int(b)
            for a, b in zip(
                torch.tensor(r["before"], dtype=torch.float32).view(torch.int32),
                torch.tensor(r["after"], dtype=torch.float32).view(torch.int32),
            )
        ]
        for m in xor:
            low = (m & -m).bit_length() - 1
            assert m == 0b111 << low and 23 <= low <= 28
        shapes.append((index, xor))
    assert shapes[0] == shapes[1]  # the same elements and the same bursts recur


@pytest.mark.parametrize("kind", sorted(PATTERNS))
@pytest.mark.parametrize("site,target,numel", SITES)
def test_a_hardware_shaped_fault_lands_and_recurs_on_every_model_site(site, target, numel, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kw = {"state_key": "exp_avg"} if site == "optimizer_state" else {}
    spec = make_spec(site, target, kind, **kw)
    validate_specs(model, [spec], opt, steps=4, grad_accum=1)
    x = torch.randn(8, 8)
    with Injector(model, [spec], opt) as inj:
        for step in range(4):
            inj.set_position(step, 0)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    check_firings([r for r in inj.records if r["when"] == "train"], kind, numel)


@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_a_hardware_shaped_fault_lands_and_recurs_in_comm_buckets_and_checkpoints(kind, tmp_path):
    model = nn.Sequential(nn.Linear(8, 16))
    comm = CommInjector(model, [make_spec("comm", "0.weight", kind)])
    for step in range(4):
        comm.set_position(step)
        grad = torch.ones(16, 8)
        comm.before_reduce(types.SimpleNamespace(index=0, buffer=grad.view(-1), names=["0.weight"], grads=[grad]))
    check_firings(comm.records, kind, 128)
    records = []
    for step in range(4):
        torch.save({"model": {"0.weight": torch.ones(16, 8)}, "step": step}, tmp_path / "state.pt")
        records += corrupt_checkpoint_file(tmp_path / "state.pt", [make_spec("checkpoint", "0.weight", kind)])
    check_firings(records, kind, 128)


def test_a_periodic_fault_that_never_fires_in_the_run_is_refused():
    model = nn.Sequential(nn.Linear(8, 16))
    late = make_spec("weight", "0", "warp", schedule={"kind": "periodic", "every": 3, "start": 5})
    with pytest.raises(ValueError, match="never fires"):
        validate_specs(model, [late], steps=5)
    state = make_spec("optimizer_state", "0.weight", "warp", schedule={"kind": "periodic", "every": 2, "stop": 1})
    with pytest.raises(ValueError, match="never fires.*optimizer state exists only after the first update"):
        validate_specs(model, [state], torch.optim.Adam(model.parameters()), steps=5)
    mb = make_spec("gemm.forward", "0", "warp", schedule={"kind": "periodic", "every": 2, "micro_batch": 2})
    with pytest.raises(ValueError, match="micro_batch 2 never fires.*allowed: 0..1"):
        validate_specs(model, [mb], steps=5, grad_accum=2)
    idle = make_spec("weight", "0", "warp", pattern={"kind": "warp", "lanes": [30]})
    validate_specs(nn.Sequential(nn.Linear(8, 4)), [idle], steps=5)  # 32 weights: lane 30 exists
    with pytest.raises(ValueError, match=r"warp lanes \[30\].*idle"):
        validate_specs(nn.Sequential(nn.Linear(4, 4)), [idle], steps=5)  # 16 weights: lane 30 runs nothing


def test_compiled_training_meets_the_same_hardware_shaped_faults_bit_for_bit():
    """Graph mode (``Injector(graph=True)`` under ``torch.compile``) carries a warp-periodic
    element set and per-element bursts into the graph exactly as the hook injector applies them."""
    specs = [
        make_spec("gemm.forward", "0", "warp"),
        make_spec("gemm.grad_input", "2", "strided"),
        make_spec("gemm.grad_weight", "2", "warp"),
    ]
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(8, 8)
    grads = {}
    for graph in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        inj = Injector(model, specs, graph=graph).attach()
        fwd = torch.compile(model, backend="aot_eager") if graph else model
        grads[graph] = []
        for step in range(4):
            inj.set_position(step)
            model.zero_grad(set_to_none=True)
            fwd(x).square().mean().backward()
            grads[graph].append([p.grad.view(torch.int32).clone() for p in model.parameters()])
            inj.micro_batch_done()
        inj.close()
        assert [(r["step"], r["site"]) for r in inj.records] == [(s, x.site) for s in (1, 3) for x in specs]
    torch._dynamo.reset()
    for eager, compiled in zip(grads[False], grads[True]):
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert not all(torch.equal(a, b) for a, b in zip(grads[False][0], grads[False][1]))  # step 1's faults act
