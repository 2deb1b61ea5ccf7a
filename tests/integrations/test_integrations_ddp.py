"""The HF and Lightning adapters under real 2-process DDP on CPU (gloo): a forward-GEMM exponent
flip on rank 1 is caught that step by every rank alike, named with its rank and layer, localized
by replaying rank 1's batch on itself and on rank 0, and kept out of the update on both ranks
(a ``recompute`` is a ``veto`` under DDP); both ranks finish with identical replicas. A clean run
has no event. Settings that shard the model are refused by name.

This file is also the script the tests launch, ``torchrun --nproc_per_node 2 <this file> hf|lightning
OUT``: the HF Trainer under torchrun, and ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
under torchrun (which Lightning joins; its own launcher would start the second process only after
the first one imported everything). Each rank writes ``OUT/<run>/result.rank{r}.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS, FAULT_STEP, FAULTY_RANK = 4, 2, 1
HF_TARGET = "model.layers.1.mlp.up_proj"
PL_TARGET = "net.2"
RUNS = ("clean", "faulty", "permanent")
FSDP2_RUNS = ("clean", "faulty")  # Lightning's ModelParallelStrategy (fully_shard), in the Lightning launch
GUARD = {"profile": "full"}  # every GEMM checked every step: the flip is caught in its step
LAUNCH_TIMEOUT_S = 240  # a hung collective fails the test instead of blocking it


def flip(target: str, permanent: bool = False) -> dict:
    """Exponent bit 30 of one element of ``target``'s forward GEMM output, on rank 1 only: at
    ``FAULT_STEP``, or (``permanent``) at every step from it on."""
    return {
        "site": "gemm.forward",
        "target": target,
        "model": "bitflip",
        "bits": [30],
        "pattern": {"kind": "element", "index": "random"},
        "schedule": {"kind": "permanent", "start": FAULT_STEP}
        if permanent
        else {"kind": "transient", "step": FAULT_STEP},
        "rank": FAULTY_RANK,
        "seed": 1,
    }


def runs(target: str) -> list[tuple[str, list[dict]]]:
    """The runs of one launch: a clean one, a transient flip, a permanent flip."""
    return [("clean", []), ("faulty", [flip(target)]), ("permanent", [flip(target, permanent=True)])]


# -- the launched script ---------------------------------------------------------------------


def _result(out: Path, rank: int, sdc, injector, params, steps: int) -> None:
    import torch

    from sdcscope.common.world import local

    flat = torch.cat([local(p).detach().reshape(-1) for p in params])  # this rank's shards, when sharded
    record = {
        "rank": rank,
        "world": sdc.guard.world.kind,
        "kinds": sorted({type(p).__name__ for p in params}),
        "events": sdc.events,
        "discarded": sdc.guard.discarded_steps,
        "steps": steps,
        "finite": bool(torch.isfinite(flat).all()),
        "sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "injections": [] if injector is None else injector.records,
    }
    (out / f"result.rank{rank}.json").write_text(json.dumps(record, default=str))


def hf_main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from sdcscope.integrations.hf import guard_trainer
    from sdcscope.integrations.hf_inject import inject_trainer

    torch.set_num_threads(1)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    for name, specs in runs(HF_TARGET):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        args = TrainingArguments(
            output_dir=str(out / name),
            per_device_train_batch_size=2,
            max_steps=STEPS,
            learning_rate=1e-2,
            logging_steps=1,
            seed=0,
            report_to=[],
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=120,
            save_strategy="no",
            disable_tqdm=True,
            # FSDP2 asked for (once): on CPU accelerate trains DDP instead, and the adapter guards it so
            **(
                dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
                if name == "faulty"
                else {}
            ),
        )
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens())
        sdc = guard_trainer(trainer, GUARD, run_dir=out / name / "sdc")
        injector = inject_trainer(trainer, specs, run_dir=out / name / "sdc") if specs else None
        trainer.train()
        _result(
            out / name, args.process_index, sdc, injector, list(trainer.model.parameters()), trainer.state.global_step
        )


def lightning_main(out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from sdcscope.integrations.lightning import SDCGuardCallback
    from sdcscope.integrations.lightning_inject import SDCInjectorCallback

    torch.set_num_threads(1)

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss, sync_dist=True)  # a collective: muted in a rank replay
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Sharded(Classifier):
        def configure_model(self) -> None:  # FSDP2 over the strategy's data-parallel mesh, as Lightning shows it
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net[::2]:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    sharded = [(f"fsdp2_{name}", specs) for name, specs in runs(PL_TARGET) if name in FSDP2_RUNS]
    for name, specs in runs(PL_TARGET) + sharded:
        pl.seed_everything(0, verbose=False)
        fsdp2 = name.startswith("fsdp2_")
        module = Sharded() if fsdp2 else Classifier()
        sdc = SDCGuardCallback(GUARD, run_dir=out / name / "sdc")
        injector = SDCInjectorCallback(specs, run_dir=out / name / "sdc") if specs else None
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else "ddp",
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[sdc, *([injector] if injector else [])],
            default_root_dir=str(out / name),
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
        _result(out / name, trainer.global_rank, sdc, injector, list(module.parameters()), trainer.global_step)


# -- the tests -------------------------------------------------------------------------------


def _launch(argv: list[str], out: Path) -> dict[str, list[dict]]:
    """Run ``argv`` (a real 2-process launch) and read back each run's per-rank results."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=out)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    done = [d.name for d in out.iterdir() if (d / "result.rank0.json").exists()]
    return {name: [json.loads((out / name / f"result.rank{r}.json").read_text()) for r in range(2)] for name in done}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf_ddp")
    return out, _launch([*TORCHRUN, "hf", str(out)], out)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    pytest.importorskip("lightning.pytorch")
    out = tmp_path_factory.mktemp("lightning_ddp")
    return out, _launch([*TORCHRUN, "lightning", str(out)], out)


def read_events(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name / "sdc" / "events.jsonl").read_text().splitlines()]


def check_runs(out: Path, runs: dict[str, list[dict]], target: str) -> None:
    clean, faulty = runs["clean"], runs["faulty"]
    for ranks in (runs[name] for name in RUNS):  # both ranks finish every step with identical, finite replicas
        assert [r["steps"] for r in ranks] == [STEPS, STEPS]
        assert ranks[0]["sha"] == ranks[1]["sha"] and all(r["finite"] for r in ranks)
    assert all(r["events"] == [] and r["discarded"] == 0 for r in clean)
    assert (out / "clean" / "sdc" / "events.jsonl").read_text() == ""
    # the fault fired once, on rank 1 only, in the forward GEMM of the target layer
    fired = [(i["step"], i["rank"], i["module"], i["site"]) for i in faulty[1]["injections"]]
    assert fired == [(FAULT_STEP, FAULTY_RANK, target, "gemm.forward")] and faulty[0]["injections"] == []
    merged = [json.loads(line) for line in (out / "faulty" / "sdc" / "injections.jsonl").read_text().splitlines()]
    assert [(i["step"], i["rank"]) for i in merged] == [(FAULT_STEP, FAULTY_RANK)]
    # every rank took the same decision about that step; rank 0 wrote the world's events once
    assert faulty[0]["events"] == faulty[1]["events"]
    events = read_events(out, "faulty")
    assert events == faulty[0]["events"] and events
    assert {e["step"] for e in events} == {FAULT_STEP}
    named = [e for e in events if e["detector"] == "abft"]
    assert [(e["rank"], e["module"], e["gemm"]) for e in named] == [(FAULTY_RANK, target, "forward")]
    # localized by replay: rank 0 does not reproduce rank 1's gradient, nor does rank 1 itself
    assert named[0]["verdict"] == "transient" and named[0]["evidence"]["replay"]["ranks"] == {
        str(FAULTY_RANK): "transient"
    }
    # repaired: the step is kept out of the update on both ranks (recompute becomes veto under DDP)
    assert all(e["rank"] == FAULTY_RANK for e in events if e["rank"] is not None)
    assert {e["action"] for e in events} <= {"veto", "report"} and "veto" in {e["action"] for e in events}
    assert [r["discarded"] for r in faulty] == [1, 1]
    assert faulty[0]["sha"] != clean[0]["sha"]  # (one step fewer was applied)


def check_quarantine(out: Path, runs: dict[str, list[dict]], target: str) -> None:
    """A permanent flip on rank 1: its own replay reproduces it (persistent), the ledger calls the
    device faulty and rank 1 leaves the gradient average; both ranks train on to the end."""
    ranks = runs["permanent"]
    assert [i["step"] for i in ranks[1]["injections"]] == list(range(FAULT_STEP, STEPS))  # it keeps firing
    events = read_events(out, "permanent")
    assert {e["step"] for e in events} == {FAULT_STEP}  # a quarantined rank is out of every test
    abft = [(e["rank"], e["module"], e["verdict"], e["action"]) for e in events if e["detector"] == "abft"]
    assert abft == [(FAULTY_RANK, target, "reproducible", "veto")]
    quarantined = [e for e in events if e["detector"] == "quarantine"]
    assert [(e["verdict"], e["rank"], e["evidence"]["healthy"]) for e in quarantined] == [("quarantined", 1, [0])]
    assert [r["discarded"] for r in ranks] == [1, 1] and [r["steps"] for r in ranks] == [STEPS, STEPS]


def test_hf_trainer_ddp_catches_a_rank1_gemm_flip_and_names_the_rank(hf_runs):
    check_runs(*hf_runs, HF_TARGET)
    out, runs = hf_runs
    # the faulty run asked for FSDP2: on CPU accelerate trains DDP (plain parameters), guarded as DDP
    assert [(r["world"], r["kinds"]) for r in runs["faulty"]] == [("ddp", ["Parameter"])] * 2
    assert (out / "faulty" / "sdc" / "metrics.rank1.jsonl").exists()  # each rank its own metrics


def test_hf_trainer_ddp_quarantines_a_rank_with_a_permanent_fault(hf_runs):
    check_quarantine(*hf_runs, HF_TARGET)


def test_lightning_ddp_catches_a_rank1_gemm_flip_and_names_the_rank(lightning_runs):
    check_runs(*lightning_runs, PL_TARGET)


def test_lightning_ddp_quarantines_a_rank_with_a_permanent_fault(lightning_runs):
    """At two ranks the flip's gradient is a cross-rank outlier naming both ranks, and each rank's
    replay of the other disagrees; rank 1's own ABFT finding decides (its replay of rank 0 does
    not count), so only rank 1 is quarantined."""
    check_quarantine(*lightning_runs, PL_TARGET)


def test_lightning_model_parallel_fsdp2_catches_a_rank1_flip_and_recomputes_it(lightning_runs):
    """``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model`` is a sharded world:
    rank 1's ABFT check of the gathered weight's GEMM catches the flip in its step, every rank
    replays the step together, the fault is gone (transient) and the re-execution is kept, so
    each rank's shards end bit for bit as the clean fit's."""
    out, runs = lightning_runs
    clean, faulty = runs["fsdp2_clean"], runs["fsdp2_faulty"]
    for ranks in (clean, faulty):
        assert [(r["world"], r["kinds"], r["steps"]) for r in ranks] == [("sharded", ["DTensor"], STEPS)] * 2
    assert all(r["events"] == [] for r in clean)
    fired = [(i["step"], i["rank"], i["module"]) for i in faulty[1]["injections"]]
    assert fired == [(FAULT_STEP, FAULTY_RANK, PL_TARGET)] and faulty[0]["injections"] == []
    assert faulty[0]["events"] == faulty[1]["events"]  # every rank holds the world's findings
    events = read_events(out, "fsdp2_faulty")
    assert events == faulty[0]["events"] and {e["step"] for e in events} == {FAULT_STEP}
    abft = [(e["rank"], e["module"], e["gemm"], e["verdict"]) for e in events if e["detector"] == "abft"]
    assert abft == [(FAULTY_RANK, PL_TARGET, "forward", "transient")]
    assert {e["action"] for e in events} == {"recompute"} and [r["discarded"] for r in faulty] == [0, 0]
    assert [r["sha"] for r in faulty] == [r["sha"] for r in clean]


def _exchange(rank: int, world: int, out: Path) -> None:
    """Both ranks suspects (the localizer's order: suspect 0 on itself, then on its peer 1;
    suspect 1 likewise): what each rank's replays were given."""
    from types import SimpleNamespace

    import torch

    from sdcscope.engine.dist import DistConfig, init_distributed
    from sdcscope.integrations.ddp import RankReplay

    init_distributed(DistConfig(backend="gloo", timeout_s=60))
    plan = {0: [1], 1: [0]}  # who replays whom, as the localizer planned it on every rank
    rank_guard = SimpleNamespace(localizer=SimpleNamespace(group=None, plan=plan), rank=rank)
    guard = SimpleNamespace(
        ranks=SimpleNamespace(rank_guard=rank_guard),
        session=SimpleNamespace(clear_grads=lambda: None),
        world=SimpleNamespace(data_parallel=True),
    )
    seen = []
    replay = RankReplay(guard, lambda batches: seen.append([b.tolist() for b in batches]) or torch.zeros(()))
    replay.start()
    for micro in range(2):
        replay.add(torch.tensor([rank, micro]))
    for suspect in (0, 1):
        replay(suspect)
    (out / f"seen.rank{rank}.json").write_text(json.dumps(seen))


def test_a_peer_replays_the_suspect_ranks_own_micro_batches(tmp_path):
    """A library trainer's ranks hold only their own batches: the suspect sends its micro-batches
    to the peers that replay it (point to point, as the localizer's plan says), and keeps
    replaying its own."""
    from sdcscope.engine.dist import spawn

    spawn(_exchange, 2, (tmp_path,), timeout_s=120)
    own = {r: [[r, 0], [r, 1]] for r in range(2)}
    for rank in range(2):
        assert json.loads((tmp_path / f"seen.rank{rank}.json").read_text()) == [own[0], own[1]]


def test_hf_fsdp_is_refused_naming_what_is_supported(tmp_path):
    """Accelerate runs FSDP on GPUs only (on CPUs it trains DDP instead: the HF launch's faulty run
    measures it), so the refusal is pinned on the Trainer's own flag."""
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sdcscope.integrations.hf import guard_trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args)
    trainer.is_fsdp_enabled = True
    with pytest.raises(ValueError, match=r"FSDP .*GPUs only \(on CPU it trains DDP.*ModelParallelStrategy.*or DDP"):
        guard_trainer(trainer)


def test_lightning_fsdp1_strategy_is_refused_naming_the_reason(monkeypatch):
    """Lightning's FSDPStrategy needs GPUs (it refuses ``accelerator='cpu'`` itself): the refusal is
    pinned on the strategy the trainer holds."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import FSDPStrategy
    from torch import nn

    from sdcscope.integrations.lightning import SDCGuardCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    monkeypatch.setattr(type(trainer), "strategy", property(lambda self: FSDPStrategy()))
    with pytest.raises(ValueError, match=r"strategy FSDPStrategy: FSDP1 .*FlatParameters.*ModelParallelStrategy"):
        SDCGuardCallback().setup(trainer, Module(), "fit")


if __name__ == "__main__":
    {"hf": hf_main, "lightning": lightning_main}[sys.argv[1]](Path(sys.argv[2]))
