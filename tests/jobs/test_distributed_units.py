"""Distributed building blocks in one process: a gloo world of one rank, configs, ledger, checksums."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from sdcscope.detect.crossrank import CrossRankConfig
from sdcscope.detect.events import Event
from sdcscope.detect.signatures import bitsum, bucket_norms, fletcher, grad_signatures
from sdcscope.engine import TrainConfig, Trainer, param_sha256
from sdcscope.engine.buckets import BucketView
from sdcscope.engine.dist import (
    DistConfig,
    DistributedError,
    decode_rows,
    encode_rows,
    free_port,
    gather_rows,
    init_distributed,
)
from sdcscope.engine.distributed import DistTrainer
from sdcscope.faults import FaultSpec
from sdcscope.guard import Guard, GuardConfig
from sdcscope.inject.comm import CommInjector, comm_phase
from sdcscope.jobs import launch, make_job
from sdcscope.localize.ranks import LedgerConfig, LocalizeConfig, RankLedger
from sdcscope.mitigate.quarantine import RankGuardConfig
from sdcscope.study import write_report
from sdcscope.workloads import WorkloadConfig, make_workload

WORKLOAD = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=200_000)
FLIP = {
    "model": "bitflip",
    "bits": [30],
    "pattern": {"kind": "element", "index": 3},
    "schedule": {"kind": "transient", "step": 1},
}


@pytest.fixture
def world_of_one(monkeypatch):
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        monkeypatch.setenv(key, value)
    init_distributed(DistConfig(backend="gloo", timeout_s=30))
    yield
    dist.destroy_process_group()


def test_one_rank_ddp_trains_bitwise_like_the_plain_trainer(world_of_one):
    workload = make_workload(WORKLOAD)
    plain, ddp = (
        Trainer(workload, TrainConfig(seed=3, grad_accum=2)),
        DistTrainer(workload, TrainConfig(seed=3, grad_accum=2)),
    )
    for _ in range(3):
        plain.train_step()
        ddp.train_step()
    assert param_sha256(plain.model) == param_sha256(ddp.model)
    rows = gather_rows(torch.tensor([1.5, float("nan")], dtype=torch.float64))
    assert rows.shape == (1, 2) and rows[0, 0] == 1.5 and rows[0, 1].isnan()


def test_local_gradients_replays_the_step_exactly(world_of_one):
    trainer = DistTrainer(make_workload(WORKLOAD), TrainConfig(seed=0, grad_accum=2))
    trainer.train_step()
    same = []

    class Replay:
        def before_optimizer_step(self, ctx):
            first = [p.grad.clone() for p in trainer.model.parameters()]
            trainer.local_gradients(trainer.rank, ctx.step, ctx.data_pos)
            same.extend(torch.equal(p.grad, g) for p, g in zip(trainer.model.parameters(), first))

    trainer.add_callback(Replay())
    trainer.train_step()
    assert same and all(same)


def test_bucket_hook_rejects_excluding_every_rank(world_of_one):
    trainer = DistTrainer(make_workload(WORKLOAD), TrainConfig(seed=0))
    with pytest.raises(ValueError, match="every rank"):
        trainer.hook.exclude([0])
    with pytest.raises(ValueError, match="allowed: 0..0"):
        trainer.hook.exclude([1])


def test_comm_phase_and_target_validation():
    spec = FaultSpec.from_dict({"site": "comm", "target": "blocks.0.mlp.fc.weight@after", **FLIP})
    plain, phase = comm_phase(spec)
    assert phase == "after" and plain.target == ("blocks.0.mlp.fc.weight",)
    assert comm_phase(FaultSpec.from_dict({"site": "comm", "target": "bucket.*", **FLIP}))[1] == "before"
    model = make_workload(WORKLOAD).build_model()
    with pytest.raises(ValueError, match="unknown phase 'during'"):
        CommInjector(model, [FaultSpec.from_dict({"site": "comm", "target": "head@during", **FLIP})])
    with pytest.raises(ValueError, match="close names: blocks.0.mlp.fc.weight"):
        CommInjector(model, [FaultSpec.from_dict({"site": "comm", "target": "blocks.0.mlp.fc.weigth", **FLIP})])
    with pytest.raises(ValueError, match="rank 2 does not exist"):
        CommInjector(
            model, [FaultSpec.from_dict({"site": "comm", "target": "bucket.0", "rank": 2, **FLIP})], world_size=2
        )


def test_comm_injector_corrupts_its_rank_slice_in_the_bucket():
    model = make_workload(WORKLOAD).build_model()
    names = [n for n, _ in model.named_parameters()]
    buffer = torch.full((sum(p.numel() for p in model.parameters()),), 1e-3)
    grads = list(buffer.split([p.numel() for p in model.parameters()]))
    view = BucketView(0, buffer, names, [g.view(p.shape) for g, p in zip(grads, model.parameters())], True)
    spec = FaultSpec.from_dict({"site": "comm", "target": "blocks.1.attn.v_proj.weight", "rank": 1, **FLIP})
    records = []
    for rank in (0, 1):
        inj = CommInjector(model, [spec], rank=rank, world_size=2, log=records.append)
        inj.set_position(1)
        inj.after_reduce(view)  # wrong phase: nothing
        inj.before_reduce(view)
    k = names.index("blocks.1.attn.v_proj.weight")
    assert [r["rank"] for r in records] == [1] and records[0]["phase"] == "before"
    assert grads[k][3] > 1e30 and (buffer > 1).sum() == 1


def test_checksums_see_every_single_bit_flip_and_ignore_order():
    x = torch.randn(1000)
    for bit in (0, 7, 22, 23, 30, 31):
        y = x.clone()
        y.view(torch.int32)[123] ^= 1 << bit
        assert bitsum(y) != bitsum(x) and not torch.equal(fletcher(y), fletcher(x))
    assert bitsum(x.flip(0)) == bitsum(x) and fletcher(x.flip(0))[1] != fletcher(x)[1]
    sig = grad_signatures([x, None])
    assert torch.allclose(sig[0, 0], torch.linalg.vector_norm(x.double()), rtol=1e-6) and sig[:, 1].isnan().all()


@pytest.mark.parametrize("sizes", [[4096, 64, 256, 64, 16384], [100, 3, 7]])  # fused rows of 64; per tensor
def test_bucket_norms_are_what_a_replay_of_the_same_gradients_computes(sizes):
    parts = [torch.randn(n) * 10.0 ** (k % 5 - 3) for k, n in enumerate(sizes)]
    parts[1].view(torch.int32)[2] ^= 1 << 30  # an exponent-bit flip: ~2^127, its square overflows float32
    flat = torch.cat(parts)
    norms = bucket_norms(flat, sizes)
    assert norms.dtype == torch.float64 and torch.isfinite(norms).all()
    assert torch.allclose(norms, torch.stack([torch.linalg.vector_norm(t.double()) for t in parts]), rtol=1e-5)
    # the localizer's replay: separate gradients, grouped as the bucket was -> the same bits
    grads = [t.clone() for t in parts]
    assert torch.equal(grad_signatures(grads, [list(range(len(sizes)))])[0], norms)
    assert torch.equal(
        bucket_norms(torch.tensor([float("inf"), 1.0, float("nan"), 2.0]), [2, 2]).isnan(), torch.tensor([False, True])
    )


def test_ledger_counts_suspicions_per_step_and_persists(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = RankLedger(["host:cpu:0", "host:cpu:1"], path, LedgerConfig(max_suspicions=2, window=100))
    assert not ledger.record(Event(5, "rank_replay", "correct_result", rank=1))  # not a suspicion
    assert not ledger.record(Event(5, "crossrank", "grad_outlier", rank=1))
    assert not ledger.record(Event(5, "rank_replay", "transient", rank=1))  # same step: counts once
    assert not ledger.faulty(1)
    assert ledger.record(Event(9, "rank_replay", "transient", rank=1)) and ledger.faulty(1)
    again = RankLedger(["host:cpu:1", "host:cpu:0"], path, entries=RankLedger.read(path))
    assert again.faulty(0) and not again.faulty(1)  # the device, not the rank, is remembered
    assert json.loads(path.read_text())["devices"]["host:cpu:1"]["faulty"] is True
    path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt ledger"):
        RankLedger.read(path)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: DistConfig(backend="mpi"), "unknown backend 'mpi'"),
        (lambda: DistConfig(backend="gloo", timeout_s=0), "timeout_s=0"),
        (lambda: CrossRankConfig(min_ratio=0.5), "min_ratio=0.5"),
        (lambda: CrossRankConfig(every=0), "every=0"),
        (lambda: LocalizeConfig(rtol=2), "rtol=2"),
        (lambda: LedgerConfig(max_suspicions=0), "max_suspicions=0"),
        (lambda: RankGuardConfig(hash_every=-1), "hash_every=-1"),
        (lambda: RankGuardConfig(crossrank={"z_threshold": -1}), "z_threshold=-1"),
        (
            lambda: RankGuardConfig(crossrank={"evry": 2}),
            "unknown rank guard crossrank key 'evry' \\(did you mean 'every'",
        ),
        (lambda: CrossRankConfig(piggyback="yes"), "piggyback='yes'"),
        (lambda: GuardConfig.from_dict({"ranks": {"hash_evry": 2}}), "unknown guard config key 'hash_evry'|hash_every"),
    ],
)
def test_configs_name_the_bad_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_launch_validates_before_starting_anything(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="nproc=0"):
        make_job(out, 0)
    comm = FaultSpec.from_dict(
        {
            "site": "comm",
            "target": "bucket.0",
            "model": "bitflip",
            "bits": [30],
            "schedule": {"kind": "transient", "step": 1},
            "rank": 3,
        }
    )
    with pytest.raises(ValueError, match="rank 3 does not exist; allowed: 0..1"):
        make_job(out, 2, specs=[comm])
    typo = FaultSpec.from_dict(
        {
            "site": "param_grad",
            "target": "blocks.0.mlp.fcc",
            "model": "bitflip",
            "bits": [30],
            "schedule": {"kind": "transient", "step": 1},
            "rank": 1,
        }
    )
    with pytest.raises(ValueError, match="blocks.0.mlp.fc"):
        launch(make_job(out, 2, specs=[typo], workload=WorkloadConfig(max_corpus_bytes=200_000)))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="already holds"):
        make_job(tmp_path / "busy", 2)
    assert not out.exists()


def test_outside_a_launch_the_error_says_how_to_start(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(DistributedError, match="sdcscope train --nproc N"):
        init_distributed(DistConfig(backend="gloo"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_rows_ride_a_bucket_of_any_float_dtype_bit_exactly(dtype):
    special = [1.5, -0.0, float("nan"), float("inf"), -float("inf"), 5e-324, -1e308, 2.0**32 - 1, -(2.0**31)]
    row = torch.cat(
        [
            torch.tensor(special, dtype=torch.float64),
            torch.randn(50, dtype=torch.float64) * 1e12,
            torch.randint(-(2**62), 2**62, (50,)).view(torch.float64),
        ]
    )
    chunks = encode_rows(row, dtype)
    assert chunks.dtype == dtype and chunks.min() >= 0
    sent = torch.zeros((3, chunks.numel()), dtype=dtype)
    sent[1] = chunks  # what an all-reduce SUM of the other ranks' zeros leaves
    rows = decode_rows(sent + torch.zeros_like(sent), row.numel())
    assert torch.equal(rows[1].view(torch.int64), row.view(torch.int64))
    assert not rows[0].view(torch.int64).any()


def test_guard_rejects_settings_a_data_parallel_run_cannot_honour(tmp_path):
    cfg = tmp_path / "guard.yaml"
    for text, match in (
        ("ranks: null\n", "ranks: null cannot watch a ddp run"),
        ("qk_clip: 50\n", "qk_clip is not supported in a ddp run"),
        ("ranks: {hash_evry: 3}\n", "did you mean 'hash_every'"),
    ):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=match):
            launch(make_job(tmp_path / "run", 2, guard=GuardConfig.load(cfg)))
    with pytest.raises(ValueError, match="drop crossrank=False"):
        make_job(tmp_path / "run", 2, guard=GuardConfig(), crossrank=False)
    assert not (tmp_path / "run").exists()


def test_guard_on_a_ddp_module_in_a_world_of_one_trains_like_the_plain_trainer(world_of_one, tmp_path):
    workload = make_workload(WORKLOAD)
    plain, ddp = Trainer(workload, TrainConfig(seed=2)), DistTrainer(workload, TrainConfig(seed=2))
    with pytest.raises(ValueError, match="pass ddp.module as model"):
        Guard(plain.model, ddp.optimizer, ddp=ddp.ddp)
    guard = Guard(ddp.ddp, ddp.optimizer, GuardConfig(), run_dir=tmp_path)  # the wrapper as the model
    assert guard.model is ddp.model and guard.rank == 0 and guard.ranks is not None
    ddp.add_callback(guard.callback())
    rows = []
    for _ in range(3):
        plain.train_step()
        rows.append(ddp.train_step())
    guard.close()
    assert param_sha256(plain.model) == param_sha256(ddp.model)
    assert [r["quarantined"] for r in rows] == [[]] * 3 and guard.events == []
    assert (tmp_path / "events.jsonl").read_text() == "" and (tmp_path / "ledger.json").is_file()


def test_report_of_a_run_directory_shows_every_rank_lane(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps(
            {
                "workload": {"workload": "gpt", "preset": "tiny"},
                "train": {"seed": 0},
                "world_size": 3,
                "backend": "gloo",
            }
        )
    )
    metrics = [
        {
            "step": s,
            "loss": 5.0 - 0.1 * s,
            "rank_loss": [5.0, 5.1, 4.9],
            "skipped": s == 2,
            "quarantined": [2] if s >= 2 else [],
        }
        for s in range(5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    events = [
        {
            "step": 2,
            "detector": "crossrank",
            "verdict": "grad_outlier",
            "module": "head",
            "rank": 2,
            "evidence": {},
            "action": "veto",
        },
        {
            "step": 2,
            "detector": "quarantine",
            "verdict": "quarantined",
            "module": None,
            "rank": 2,
            "evidence": {},
            "action": "quarantine",
        },
        {
            "step": 1,
            "detector": "spike",
            "verdict": "reproducible",
            "module": None,
            "rank": None,
            "evidence": {"finding": "spike"},
            "action": "report",
        },
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "events.rank1.jsonl").write_text(
        json.dumps(
            {
                "step": 3,
                "detector": "guard",
                "verdict": "internal_error",
                "module": None,
                "rank": 1,
                "evidence": {},
                "action": "report",
            }
        )
        + "\n"
    )
    html, md = write_report(run)
    text = md.read_text()
    assert "outcome | unfinished (no summary.json)" in text and "quarantined ranks | 2 (from step 2)" in text
    lanes = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| rank ") or line.startswith("| world |")
    }
    assert set(lanes) == {"rank 0", "rank 1", "rank 2", "world"}
    assert "guard:internal_error ×1" in lanes["rank 1"]
    assert "crossrank:grad_outlier ×1" in lanes["rank 2"] and lanes["rank 2"].rstrip(" |").endswith("2")
    assert "spike:reproducible ×1" in lanes["world"] and "| 1 | spike | reproducible | – | spike | report |" in text
    assert html.read_text().count("data:image/png;base64,") == 2
    with pytest.raises(FileNotFoundError, match="no results.sqlite .* and no config.json"):
        write_report(tmp_path)


def test_a_shared_finding_takes_its_verdict_and_rank_from_the_replays():
    from types import SimpleNamespace

    from sdcscope.guard.ranks import GuardRanks

    ranks = object.__new__(GuardRanks)  # the verdict mapping needs no world

    def judged(rank, candidates, verdicts):
        ranks.rank_guard = SimpleNamespace(
            verdicts={r: Event(4, "rank_replay", v, rank=r) for r, v in verdicts.items()}
        )
        e = Event(
            4,
            "abft",
            "checksum_mismatch",
            module="fc",
            rank=rank,
            evidence={"candidates": candidates} if candidates else {},
        )
        ranks._replay_verdict(e)
        return e.verdict, e.rank, e.evidence["finding"], e.evidence["replay"]

    assert judged(1, None, {1: "transient"}) == (
        "transient",
        1,
        "checksum_mismatch",
        {"verdict": "transient", "ranks": {1: "transient"}},
    )
    verdict, rank, _, replay = judged(None, [0, 1, 2], {0: "correct_result", 1: "persistent", 2: "correct_result"})
    assert (verdict, rank) == ("reproducible", 1) and "persistent fault" in replay["evidence"]
    verdict, rank, _, replay = judged(None, [0, 1], {0: "correct_result", 1: "correct_result"})
    assert (verdict, rank) == ("reproducible", None) and "not the hardware" in replay["evidence"]
    assert judged(2, None, {})[:2] == ("unverified", 2)
    assert judged(None, [0, 1], {0: "correct_result"})[:2] == ("unverified", None)  # rank 1 never replayed


def test_a_finding_on_the_reduced_gradient_is_about_the_world_whoever_reported_it():
    """A rank that voided its step (its own weights failed their checksum) runs no other detector;
    the NaN its peers find in the all-reduced gradient is no evidence against them."""
    from sdcscope.detect.crossrank import merge_findings

    def finding(rank, detector, verdict, what=None, module=None):
        return {**Event(7, detector, verdict, module=module, rank=rank, evidence=what or {}).to_dict(), "rank": rank}

    grad_nan = {"what": "grad", "count": 3, "of": 20, "params": ["tok_emb.weight"]}
    gathered = [
        [finding(0, "nonfinite", "nonfinite", grad_nan, "tok_emb")],
        [finding(1, "state_checksum", "param_mismatch", {"param": "blocks.0.mlp.fc.weight"})],
        [finding(2, "nonfinite", "nonfinite", {"what": "loss", "value": float("nan")})],
    ]
    events = merge_findings(gathered, [0, 1, 2])
    assert [(e.detector, e.evidence.get("what"), e.rank) for e in events] == [
        ("nonfinite", "grad", None),
        ("state_checksum", None, 1),
        ("nonfinite", "loss", 2),
    ]  # a loss is its rank's
    assert (events[0].evidence["candidates"], events[0].evidence["ranks"]) == ([0, 1, 2], [0])
    # the same finding on every healthy rank is about the world; a quarantined rank is left out
    abft = [[finding(r, "abft", "checksum_mismatch", {}, "fc")] for r in range(3)]
    assert [(e.rank, e.evidence["candidates"]) for e in merge_findings(abft, [0, 2])] == [(None, [0, 2])]
    assert [e.rank for e in merge_findings(abft[:1] + [[], []], [0, 1, 2])] == [0]
