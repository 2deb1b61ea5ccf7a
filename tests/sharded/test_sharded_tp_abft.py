"""ABFT on tensor-parallel linears (gloo on loopback, 2 ranks): each rank checks the GEMMs it runs
on its local shards -- forward, dX, dW of ColwiseParallel and RowwiseParallel layers, with and
without sequence-parallel layouts -- and names a failing element in shard and global coordinates;
a guarded ``--parallel tp`` run detects, names and repairs a GEMM fault in a split linear."""

from __future__ import annotations

import json

import torch
from torch import nn

from helpers import at, rank_flip, two_rank_job
from sdcscope.engine.dist import DistConfig, init_distributed, spawn
from sdcscope.faults import FaultSpec
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


def _job(out, steps: int, specs=()):
    from sdcscope.guard import GuardConfig

    guard = GuardConfig(profile="full")  # every GEMM every step: the faulted one is checked
    return two_rank_job(out, "tp", steps, specs, guard, crossrank=True).to_dict()


def _bit30(t: torch.Tensor) -> torch.Tensor:
    """``t`` with bit 30 of its element 5 flipped (a copy)."""
    t = t.detach().clone()
    v = t.view(-1)[5:6]
    v.copy_((v.view(torch.int32) ^ (1 << 30)).view(torch.float32))
    return t


def _flip(module: nn.Module, rank: int, gemm: str) -> None:
    """A flip of this rank's local GEMM result before any reduction: ``module``'s raw output (a
    rowwise layer's partial sums), or dX at its GEMM node (a colwise layer's partial dX) -- what
    the injector does, without cloning a partial DTensor (a collective on one rank)."""
    from torch.distributed.tensor import DTensor

    from sdcscope.common.graph import linear_nodes

    def local_flip(t):
        return DTensor.from_local(_bit30(t.to_local()), t.device_mesh, t.placements, shape=t.shape, stride=t.stride())

    def hook(mod, args, out):
        if torch.distributed.get_rank() != rank:
            return None
        if gemm == "forward":  # in place: the output feeds autograd on
            with torch.no_grad():
                local = out.to_local()
                local.copy_(_bit30(local))
            return None
        node, xi, _, _ = linear_nodes(out, mod.weight)
        node.register_hook(lambda gi, go: tuple(local_flip(g) if k == xi else g for k, g in enumerate(gi)))
        return None

    module.register_forward_hook(hook, prepend=True)


def _direct(rank: int, world: int) -> dict:
    """Checks of a 2-layer TP MLP, one step per case, by ABFT alone: {case: [events on this rank]}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from sdcscope.detect.abft import ABFTConfig, ABFTDetector
    from sdcscope.inject import Injector

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cases = {
        "clean": (False, None),
        "clean_sp": (True, None),
        "fc.grad_input": (False, "hook"),
        "fc.grad_weight": (True, ("gemm.grad_weight", "fc")),
        "proj.grad_weight": (False, ("gemm.grad_weight", "proj")),
        "proj.forward": (True, "hook"),
    }
    got = {}
    for case, (sp, fault) in cases.items():
        torch.manual_seed(0)
        model = MLP()
        plan = {
            "fc": ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel(),
            "proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        parallelize_module(model, mesh, plan)
        specs = []
        if case == "proj.forward":
            _flip(model.proj, 1, "forward")
        elif case == "fc.grad_input":
            _flip(model.fc, 1, "grad_input")
        elif fault is not None:
            specs = [FaultSpec.from_dict(rank_flip(fault[0], fault[1], 1, at(0)))]
        injector = Injector(model, specs, rank=rank, world_size=world).attach()
        injector.set_position(0, 0)
        abft = ABFTDetector(model, ABFTConfig(), rank=rank).attach()
        hooks = [getattr(f, "__module__", "") for f in model.proj._forward_hooks.values()]
        torch.manual_seed(1)
        x = torch.randn(2, 6, 8)
        if sp:  # the sequence-parallel input: this rank's half of the sequence
            x = x[:, 3 * rank : 3 * rank + 3]
        model(x.requires_grad_()).square().sum().backward()
        got[case] = [e.to_dict() for e in abft.check(0)]
        got[case + ":hooks"] = hooks
        injector.detach()
        abft.detach()
    return got


def _refused(world: int) -> str | None:
    """A guard whose ABFT targets a tensor-parallel module it cannot map (a split convolution)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    from sdcscope.guard import Guard, GuardConfig

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Flatten(), nn.Linear(8, 2))

    def split(name, module, mesh):
        if isinstance(module, nn.Conv1d):
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))

    distribute_module(model, mesh, split)
    try:
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), GuardConfig(metrics=None)).close()
    except ValueError as exc:
        return str(exc)
    return None


def _world(rank: int, world: int, jobs: list[dict], out) -> None:
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    for job in jobs:
        run_job(Job.from_dict(job))
    direct = _direct(rank, world)
    refused = _refused(world)
    (out / f"direct.rank{rank}.json").write_text(json.dumps({"direct": direct, "refused": refused}))


def _events(path) -> list[dict]:
    f = path / "events.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []


def _summary(path) -> dict:
    return json.loads((path / "summary.json").read_text())


def test_tp_abft_checks_local_shard_gemms_names_shard_and_global_coordinates_and_repairs(tmp_path):
    # a forward-GEMM exponent flip in the colwise blocks.0.mlp.fc, and a dX flip in the rowwise
    # blocks.0.mlp.proj, each on rank 1 at step 3: rank 1's ABFT check of its local GEMM finds it,
    # every rank replays the step, the fault is gone, and the run ends as the clean run, bit for bit
    fwd = rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(3), bit=30)
    dx = rank_flip("gemm.grad_input", "blocks.0.mlp.proj", 1, at(3), bit=30)
    jobs = [_job(tmp_path / "clean", 4), _job(tmp_path / "fwd", 4, [fwd]), _job(tmp_path / "dx", 4, [dx])]
    spawn(_world, 2, (jobs, tmp_path), timeout_s=300)

    clean = _summary(tmp_path / "clean")
    assert clean["outcome"] == "completed" and clean["parallel"] == "tp"
    assert _events(tmp_path / "clean") == []
    config = json.loads((tmp_path / "clean" / "config.json").read_text())
    assert config["guard"]["abft"]["targets"] is None
    hidden = make_workload(WORKLOAD).build_model().blocks[0].mlp.fc.out_features
    for run, layer, gemm, placement in (
        ("fwd", "blocks.0.mlp.fc", "forward", "S(2)"),  # colwise Y: output features split
        ("dx", "blocks.0.mlp.proj", "grad_input", "S(2)"),  # rowwise dX: input features split
    ):
        events = _events(tmp_path / run)
        abft = [e for e in events if e["detector"] == "abft"]
        assert abft and all(e["step"] == 3 for e in events), events
        assert {(e["rank"], e["module"], e["gemm"]) for e in abft} == {(1, layer, gemm)}
        e = abft[0]
        ev = e["evidence"]
        assert ev["shard_index"] == e["index"] and ev["placement"] == [placement]
        assert ev["mesh_coordinate"] == [1] and ev["shard_offset"][-1] == hidden // 2
        assert ev["global_index"][-1] == ev["shard_index"][-1] + hidden // 2
        assert all(x["verdict"] == "transient" and x["action"] == "recompute" for x in events)
        assert _summary(tmp_path / run)["param_sha256"] == clean["param_sha256"]

    ranks = [json.loads((tmp_path / f"direct.rank{r}.json").read_text()) for r in (0, 1)]
    zero, one = ranks[0]["direct"], ranks[1]["direct"]
    assert all(v == [] for k, v in zero.items() if not k.endswith(":hooks"))  # rank 0 computes clean
    assert one["clean"] == one["clean_sp"] == []
    # ABFT's forward hook runs after the injector's and just before the plan's output hook
    assert one["proj.forward:hooks"][-2:] == ["sdcscope.detect.abft.hooks", "torch.distributed.tensor._api"]

    def only(case: str) -> dict:
        (e,) = one[case]
        return {"module": e["module"], "gemm": e["gemm"], "rank": e["rank"], **e["evidence"]}

    # a rowwise Y is this rank's partial sum: indexed globally, the contraction's slice named
    e = only("proj.forward")
    assert (e["module"], e["gemm"], e["rank"], e["placement"]) == ("proj", "forward", 1, ["P(sum)"])
    assert e["global_index"] == e["shard_index"] and e["shard_index"][-1] == 5
    assert e["operand_slice"] == {"dim": "in_features", "start": 8, "stop": 16}
    # a colwise dX likewise: partial over this rank's output features
    e = only("fc.grad_input")
    assert (e["gemm"], e["placement"], e["shard_index"][-1], e["global_index"][-1]) == ("grad_input", ["P(sum)"], 5, 5)
    assert e["operand_slice"] == {"dim": "out_features", "start": 8, "stop": 16}
    # dW: colwise rows (output features) split, rowwise columns (input features) split
    e = only("fc.grad_weight")
    assert (e["gemm"], e["placement"], e["shard_offset"]) == ("grad_weight", ["S(0)"], [8, 0])
    e = only("proj.grad_weight")
    assert (e["placement"], e["shard_index"], e["global_index"]) == (["S(1)"], [None, 5], [None, 13])

    refused = ranks[0]["refused"]
    assert "tensor-parallel layers (0)" in refused and "only a split nn.Linear" in refused
