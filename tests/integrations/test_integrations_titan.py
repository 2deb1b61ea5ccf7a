"""torchtitan's debug model (``llama3`` flavor ``debugmodel``, torchtitan's own config, FSDP2 as its
``parallelize_llama`` applies it) trained on 2 CPU ranks (gloo) under :func:`guard_titan`: a
forward-GEMM exponent flip on rank 1 is caught in its step by rank 1's ABFT check, named with its
rank and layer, replayed by every rank together through torchtitan's own ``forward_backward_step``
(transient) and recomputed, so every rank's shards end bit for bit as the clean run's.

What of torchtitan runs here, and why not all of it: torchtitan 0.3.0 takes ``"cuda"`` as its
device when no accelerator is present (``torchtitan.tools.utils.device_type``), so its
``Trainer.__init__`` fails on a CPU-only machine (``torch.cuda.set_device``; its metrics build a
CUDA memory monitor) and ``ParallelDims.build_mesh`` asks for a CUDA mesh. The script therefore
builds the ``Trainer`` object from torchtitan's own parts, as ``Trainer.__init__`` does --
``llama3_debugmodel()`` config, ``ParallelDims`` (its mesh built on CPU: the one module global
set), the model registry's model and ``parallelize_fn``, the config's optimizer, LR scheduler and
loss builders, its selective activation checkpointing -- and runs ``train_step``'s sequence
(zero_grad, ``forward_backward_step``, ``clip_grad_norm_``, ``optimizers.step``, the LR step)
while ``should_continue_training()``, leaving out the metrics, checkpoint and dataloader
components (the dataset ``c4_test`` and the tokenizer assets ship in torchtitan's repository, not
its wheel). Two more CPU-only changes: the attention is torchtitan's ``ScaledDotProductAttention``
(FlexAttention has no backward on CPU, varlen needs CUDA flash attention; with one document a row
the causal SDPA is the same attention), and FSDP2's reductions are a plain SUM (gloo has no
``PREMUL_SUM``; torchtitan's divide factor is 1). The data is real text: the bytes of a
standard-library source file. The guard sees exactly the calls ``train_step`` makes.

torchtitan's model package imports ``triton`` (a 286 MB wheel) and its trainer ``tensorboard`` and
``datasets``: they are not in the test extra, so the test is skipped where they are not installed
(CI); with them (``pip install torchtitan triton tensorboard datasets``) it runs.

This file is also the script the test launches: ``torchrun --nproc_per_node 2 <this file> OUT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS, FAULT_STEP, FAULTY_RANK = 3, 1, 1
TARGET = "layers.1._checkpoint_wrapped_module.feed_forward.w1"  # inside torchtitan's selective AC wrapper
FLIP = {  # exponent bit 30 of one element of the target's forward GEMM output, rank 1, step 1
    "site": "gemm.forward",
    "target": TARGET,
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 5},
    "schedule": {"kind": "transient", "step": FAULT_STEP},
    "rank": FAULTY_RANK,
}
RUNS = {"clean": [], "faulty": [FLIP]}
LAUNCH_TIMEOUT_S = 400


def build_trainer(dump: Path, steps: int):
    """A torchtitan ``Trainer`` of the debug model on this CPU rank, from torchtitan's own parts."""
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.trainer import Trainer

    parallel_dims_module.device_type = "cpu"  # torchtitan's "cuda" when it finds no accelerator
    config = llama3_debugmodel()
    config.dump_folder = str(dump)
    config.training.local_batch_size, config.training.seq_len, config.training.steps = 2, 32, steps
    config.training.mixed_precision_param = "float32"  # CPU: no bf16 GEMMs
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 over the 'fsdp' mesh dim
    config.optimizer.implementation = "for-loop"  # 'fused' is CUDA-only
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
    dims.build_mesh()
    spec = config.model_spec
    model_config = spec.model
    for layer in model_config.layers:  # FlexAttention has no backward on CPU (see above)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
    )
    for module in model.modules():  # gloo has no PREMUL_SUM: torchtitan's sum (divide factor 1) as a SUM
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.parallel_dims, trainer.model_config = config, dims, model_config
    trainer.model_parts, trainer.device = [model], torch.device("cpu")
    trainer.step = trainer.ntokens_seen = 0
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = 1, 1
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(trainer.loss_fn, ChunkedLossWrapper):  # as Trainer.__init__ sets it
        trainer.loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=steps)
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def train(trainer, injector=None) -> None:
    """``Trainer.train``'s loop over ``train_step``'s sequence (metrics and checkpoints left out)."""
    import json as stdlib_json

    import torch
    from torchtitan.distributed import utils as dist_utils

    config, dims = trainer.config, trainer.parallel_dims
    text = torch.frombuffer(bytearray(Path(stdlib_json.__file__).read_bytes()), dtype=torch.uint8).long()
    b, t, rank = config.training.local_batch_size, config.training.seq_len, dims.get_mesh("batch").get_local_rank()
    while trainer.should_continue_training():
        trainer.step += 1
        if injector is not None:
            injector.set_position(trainer.step - 1, 0)
        start = ((trainer.step - 1) * dims.dp_shard + rank) * b * (t + 1)
        tokens = text[start : start + b * (t + 1)].view(b, t + 1)
        trainer.optimizers.zero_grad()
        labels = tokens[:, 1:]
        global_valid_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), dims.get_mesh("batch"))
        trainer.forward_backward_step(
            input_dict={"input": tokens[:, :-1]},
            labels=labels,
            global_valid_tokens=global_valid_tokens,
        )
        params = [p for m in trainer.model_parts for p in m.parameters()]
        dist_utils.clip_grad_norm_(params, config.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        trainer.optimizers.step()
        trainer.lr_schedulers.step()


def titan_main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from sdcscope.common.world import local
    from sdcscope.faults import FaultSpec
    from sdcscope.inject import Injector
    from sdcscope.integrations.titan import guard_titan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name, specs in RUNS.items():
        trainer = build_trainer(out / name, STEPS)
        (model,) = trainer.model_parts
        sdc = guard_titan(trainer, {"profile": "full"}, run_dir=out / name / "sdc")  # every GEMM every step
        faults = [FaultSpec.from_dict(s) for s in specs]
        injector = Injector(model, faults, rank=dist.get_rank(), world_size=2).attach() if faults else None
        train(trainer, injector)
        trainer.close()  # the guard too
        shards = torch.cat([local(p).detach().reshape(-1) for p in model.parameters()])
        record = {
            "events": sdc.events,
            "world": sdc.guard.world.kind,
            "steps": trainer.step,
            "modules": [n for n, _ in model.named_modules()],
            "sha": hashlib.sha256(shards.numpy().tobytes()).hexdigest(),
            "injections": [] if injector is None else injector.records,
        }
        (out / name / f"result.rank{dist.get_rank()}.json").write_text(json.dumps(record, default=str))
    trainer = build_trainer(out / "refused", STEPS)
    refused = {}
    for setting, config in {"compile": {}, "collectives": {"collectives": {"all_gather": False}}}.items():
        trainer.config.compile.enable = setting == "compile"
        try:
            guard_titan(trainer, config, run_dir=out / "refused").close()
            refused[setting] = None
        except ValueError as exc:
            refused[setting] = str(exc)
    (out / "refused").mkdir(exist_ok=True)
    (out / "refused" / f"refused.rank{dist.get_rank()}.json").write_text(json.dumps(refused))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def titan_runs(tmp_path_factory):
    pytest.importorskip("torchtitan.models.llama3")
    pytest.importorskip("torchtitan.trainer")
    out = tmp_path_factory.mktemp("titan")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return out, {n: [json.loads((out / n / f"result.rank{r}.json").read_text()) for r in range(2)] for n in RUNS}


def test_torchtitan_debug_model_under_fsdp2_catches_a_rank1_flip_and_recomputes_it(titan_runs):
    out, runs = titan_runs
    clean, faulty = runs["clean"], runs["faulty"]
    assert TARGET in clean[0]["modules"]
    for ranks in (clean, faulty):
        assert [(r["world"], r["steps"]) for r in ranks] == [("sharded", STEPS)] * 2
    assert all(r["events"] == [] for r in clean)
    fired = [(i["step"], i["rank"], i["module"]) for i in faulty[1]["injections"]]
    assert fired == [(FAULT_STEP, FAULTY_RANK, TARGET)] and faulty[0]["injections"] == []
    assert faulty[0]["events"] == faulty[1]["events"]  # every rank holds the world's findings
    events = [json.loads(line) for line in (out / "faulty" / "sdc" / "events.jsonl").read_text().splitlines()]
    assert events == faulty[0]["events"] and {e["step"] for e in events} == {FAULT_STEP}
    abft = [(e["rank"], e["module"], e["gemm"], e["verdict"]) for e in events if e["detector"] == "abft"]
    assert abft == [(FAULTY_RANK, TARGET, "forward", "transient")]
    assert {e["action"] for e in events} == {"recompute"}
    assert [r["sha"] for r in faulty] == [r["sha"] for r in clean]


def test_torchtitan_settings_the_guard_cannot_run_are_refused_by_name(titan_runs):
    out, _ = titan_runs
    refused = json.loads((out / "refused" / "refused.rank0.json").read_text())
    assert "compile.enable with 'model' in compile.components" in refused["compile"]
    assert "guard collectives cannot run here: torchtitan's ChunkedLossWrapper" in refused["collectives"]


if __name__ == "__main__":
    titan_main(Path(sys.argv[1]))
