"""Faults on a tensor-parallel GEMM's ``Partial`` result (gloo on loopback, 2 ranks): a ``gemm.forward``
flip in a rowwise layer's raw output and a ``gemm.grad_input`` flip in a colwise layer's dX, on rank 1,
change exactly that element of rank 1's local partial sum -- no collective runs on the faulting rank
alone -- so the ranks' reductions stay in step and every rank's reduced value carries the fault; the
record names the element in shard coordinates, and the guard's ABFT (alone, and in a guarded
``--parallel tp`` run) finds the forward flip."""

from __future__ import annotations

import json

import torch
from torch import nn

from helpers import at, rank_flip
from sdcscope.engine import TrainConfig
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.engine.topology import Topology
from sdcscope.faults import FaultSpec
from sdcscope.workloads import WorkloadConfig

BIT = 30
CASES = {"forward": ("gemm.forward", "proj"), "grad_input": ("gemm.grad_input", "fc")}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)  # colwise: its dX is this rank's partial sum
        self.proj = nn.Linear(16, 8)  # rowwise: its raw output is this rank's partial sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).view(torch.int32).tolist()


def _capture(model: MLP, case: str, got: dict) -> None:
    """Hooks, behind the injector's, that keep this rank's local GEMM result as the next consumer
    sees it: the rowwise ``proj``'s partial output before the plan all-reduces it, or the
    colwise ``fc``'s partial dX where its GEMM node hands it on."""
    from sdcscope.common.graph import operand_grad_edge

    if case == "forward":

        def hook(module, args, out):
            got["local"] = _bits(out.to_local())

        model.proj.register_forward_hook(hook, prepend=True)
        return

    def grad_hook(module, args, out):
        edge = operand_grad_edge(module, out, args, 0)

        def keep(grad_inputs, grad_outputs):
            got["local"] = _bits(grad_inputs[edge.index].to_local())

        edge.node.register_hook(keep)

    model.fc.register_forward_hook(grad_hook, prepend=True)


def _case(rank: int, world: int, case: str) -> dict:
    """One clean step (0) and one faulted step (1) on the same weights and input: this rank's local
    result and the reduced one (the model's output, X's gradient) of each, the records, and the
    ABFT events of the faulted step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from sdcscope.detect.abft import ABFTConfig, ABFTDetector
    from sdcscope.inject import Injector

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    site, target = CASES[case]
    got: dict = {}
    _capture(model, case, got)  # registered first: the injector's hooks go ahead of it
    spec = FaultSpec.from_dict(rank_flip(site, target, 1, at(1), bit=BIT))
    injector = Injector(model, [spec], rank=rank, world_size=world).attach()
    abft = ABFTDetector(model, ABFTConfig(), rank=rank).attach() if case == "forward" else None
    steps = []
    for step in (0, 1):
        injector.set_position(step, 0)
        torch.manual_seed(1)
        x = torch.randn(2, 6, 8, requires_grad=True)
        y = model(x)
        y.square().sum().backward()
        steps.append({"local": got.pop("local"), "y": _bits(y), "dx": _bits(x.grad)})
    events = [e.to_dict() for e in abft.check(1)] if abft is not None else None
    injector.close()
    if abft is not None:
        abft.detach()
    return {"clean": steps[0], "faulty": steps[1], "records": injector.records, "events": events}


def _guarded_job(out) -> dict:
    """A guarded (profile full) ``--parallel tp`` run of a tiny GPT with a ``gemm.forward`` flip
    in the rowwise ``blocks.0.mlp.proj`` on rank 1 at step 1."""
    from sdcscope.guard import GuardConfig
    from sdcscope.jobs.torchrun import make_job

    spec = rank_flip("gemm.forward", "blocks.0.mlp.proj", 1, at(1), bit=BIT)
    return make_job(
        out,
        2,
        steps=2,
        workload=WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000),
        train=TrainConfig(seed=0),
        dist_config=DistConfig(backend="gloo", timeout_s=30),
        specs=[FaultSpec.from_dict(spec)],
        guard=GuardConfig(profile="full"),
        parallel=Topology(kind="tp"),
    ).to_dict()


def _world(rank: int, world: int, out, job: dict) -> None:
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DistConfig(backend="gloo", timeout_s=30))  # a rank out of step fails, never hangs
    result = {case: _case(rank, world, case) for case in CASES}
    torch.distributed.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    run_job(Job.from_dict(job))


def _diff(a: list[int], b: list[int]) -> dict[int, int]:
    """{flat index: xor of the two words} of every element whose bits differ."""
    return {k: x ^ y for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y}


def test_inject_partial_dtensor_flips_one_local_element_without_collective_on_faulting_rank(tmp_path):
    spawn(_world, 2, (tmp_path, _guarded_job(tmp_path / "guarded")), timeout_s=240)  # or it raises
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for case, (site, target) in CASES.items():
        # rank 1's local partial sum: exactly element 5, exactly bit 30; rank 0's untouched
        assert _diff(one[case]["clean"]["local"], one[case]["faulty"]["local"]) == {5: 1 << BIT}, case
        assert zero[case]["clean"]["local"] == zero[case]["faulty"]["local"], case
        # the partial sums were reduced together: every rank holds the same faulty result, which
        # differs from the clean one where the fault went in (element 5 of Y; of dX, element 5 of X)
        reduced = "y" if case == "forward" else "dx"
        assert zero[case]["faulty"][reduced] == one[case]["faulty"][reduced], case
        assert 5 in _diff(zero[case]["clean"][reduced], zero[case]["faulty"][reduced]), case
        assert zero[case]["records"] == []
        (rec,) = one[case]["records"]
        assert (rec["site"], rec["module"], rec["rank"], rec["index"]) == (site, target, 1, [5])
        assert rec["shard"]["placement"] == ["P(sum)"] and rec["shard"]["global_index"] == [5]
        assert rec["shard"]["local_shape"] == rec["shard"]["global_shape"]  # a partial sum: whole shape

    # the guard's ABFT checks the rowwise GEMM on rank 1's local shards and finds the flip there
    assert zero["forward"]["events"] == []
    (event,) = one["forward"]["events"]
    assert (event["module"], event["gemm"], event["rank"]) == ("proj", "forward", 1)
    assert event["evidence"]["placement"] == ["P(sum)"] and event["evidence"]["shard_index"][-1] == 5

    # and in a guarded --parallel tp run: rank 1's ABFT finds the flip in its local partial sum,
    # the step is replayed and the run completes
    run = tmp_path / "guarded"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    abft = [e for e in events if e["detector"] == "abft"]
    assert {(e["step"], e["rank"], e["module"], e["gemm"]) for e in abft} == {(1, 1, "blocks.0.mlp.proj", "forward")}
    assert abft[0]["evidence"]["placement"] == ["P(sum)"] and abft[0]["evidence"]["shard_index"][-1] == 5
    assert all(e["verdict"] == "transient" and e["action"] == "recompute" for e in events), events
    injected = [json.loads(line) for line in (run / "injections.rank1.jsonl").read_text().splitlines()]
    assert [(r["step"], r["module"], r["index"], r["shard"]["placement"]) for r in injected] == [
        (1, "blocks.0.mlp.proj", [5], ["P(sum)"])
    ]
    assert json.loads((run / "summary.json").read_text())["outcome"] == "completed"
