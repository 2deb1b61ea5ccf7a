"""Helpers shared by the tests of several rooms: tiny models, batches and bit flips, training-state
comparisons, guarded plain training loops, fault specs, the command line, and readers of run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.common.graph import weight_grad_edge
from sdcscope.common.io import read_jsonl
from sdcscope.faults import FaultSpec

# --- tiny models for the observe/detect tests (no dependency on sdcscope.workloads) ---


class MatMul(nn.Module):
    """The MatMul contract: ``is_matmul = True`` and ``forward(a, b) = a @ b``."""

    is_matmul = True

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 24, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)
        self.score = MatMul()
        self.context = MatMul()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln(x)
        q, k, v = self.split(self.q_proj(h)), self.split(self.k_proj(h)), self.split(self.v_proj(h))
        s = self.score(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        y = self.context(p, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(y)
        return x + self.proj(torch.relu(self.fc(x)))


class TinyTransformer(nn.Module):
    """Byte-level 2-block transformer with an explicit score/context MatMul per block."""

    def __init__(
        self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, seq: int = 8, tied: bool = False
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_batch(step: int, vocab: int = 32, batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def flip_bit(t: torch.Tensor, index: tuple, bit: int) -> None:
    """Flip one bit of one float32 element in place."""
    assert t.dtype == torch.float32
    flat = t.detach().view(torch.int32)
    flat[index] = flat[index] ^ torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def on_grad_weight(module: nn.Module, fn) -> None:
    """Apply ``fn(dW) -> dW`` to the dW of every call of ``module``'s GEMM (where hardware
    corrupts it: the call's own autograd node, before the weight's other uses are summed in)."""

    def forward_hook(mod, args, out):
        edge = weight_grad_edge(out, mod.weight)
        if edge is not None:
            node, i = edge
            node.register_hook(lambda gi, go: tuple(fn(g) if k == i else g for k, g in enumerate(gi)))

    module.register_forward_hook(forward_hook)


class DropoutMLP(nn.Module):
    """The model of the invariants tests: dropout makes the training mode matter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


# --- training state ---


def same(a, b):
    """Bitwise-equal tensor lists."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(a, b):
    """Same parameters and optimizer state: each a (parameters, [per-parameter state dicts]) pair."""
    return (
        same(a[0], b[0])
        and len(a[1]) == len(b[1])
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1], b[1]))
    )


# --- guarded plain loops (the guard tests) ---


def batch_of(step: int, scale: float = 1.0):
    """16 random rows of 12 features, 4 classes; ``scale`` multiplies the features."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=g) * scale, torch.randint(0, 4, (16,), generator=g)


def learnable_batch(step: int, d: int = 12, classes: int = 4):
    """16 random rows of ``d`` features labelled by the argmax of their first ``classes``: a task that is learned."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, d, generator=g)
    return x, x[:, :classes].argmax(1)


def loop_batch(seed: int):
    """8 random rows of 16 features, 4 classes: the batches of ``make_loop``'s model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def spike_batch(step: int, bad: bool = False):
    """32 random rows of 8 features, 4 classes; ``bad``: the features times 1e4, a loss spike in ``ReluMLP``."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return (x * 1e4 if bad else x), y


def ce(model, batch):
    """Cross-entropy of ``model`` on an ``(inputs, labels)`` batch."""
    return F.cross_entropy(model(batch[0]), batch[1])


def mlp():
    """A seeded 12-32-4 ReLU MLP (``batch_of``'s shapes); its last Linear is ``"2"``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))


def deep_mlp():
    """An unseeded 12-32-32-4 ReLU MLP; ``"2"`` is its middle Linear."""
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class ReluMLP(nn.Module):  # no normalization: a garbage batch spikes the loss
    """An 8-16-4 ReLU MLP (``spike_batch``'s shapes) with modules ``fc1`` and ``fc2``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def params(model):
    """Copies of ``model``'s parameters."""
    return [p.detach().clone() for p in model.parameters()]


def flip_once(module: nn.Module, when, index: tuple = (3, 2)) -> None:
    """A transient fault: one output element of ``module`` corrupted once, when ``when()`` holds."""
    fired = []

    def hook(mod, args, out):
        if when() and not fired:
            fired.append(True)
            out = out.clone()
            out[index] += 1000.0
            return out

    module.register_forward_hook(hook)


def random_flip(
    site: str, target: str = "2", step: int = 0, bit: int = 30, *, schedule: dict | None = None
) -> FaultSpec:
    """Bit ``bit`` of a random element of ``target`` at ``site`` flipped once at ``step``, or on ``schedule``."""
    return FaultSpec(
        site=site,
        target=target,
        model="bitflip",
        bits=(bit,),
        pattern={"kind": "element", "index": "random"},
        schedule={"kind": "transient", "step": step} if schedule is None else schedule,
        seed=1,
    )


def output_flip(target: str, step: int, micro_batch: int = 0, kind: str = "transient") -> FaultSpec:
    """Bit 30 of a random element of ``target``'s GEMM output: once at ``step`` in micro-batch ``micro_batch``,
    or (``kind="permanent"``) from step 0 on."""
    schedule = (
        {"kind": "transient", "step": step, "micro_batch": micro_batch}
        if kind == "transient"
        else {"kind": "permanent", "start": 0}
    )
    return random_flip("gemm.forward", target, schedule=schedule)


def guarded_step(guard, model, step, batch, *, loss_fn=ce, pass_loss=True, **kw) -> bool:
    """One step of a plain loop under ``guard``; what ``guard.optimizer_step`` returns."""
    guard.optimizer.zero_grad()
    with guard.step(step, batch):
        loss = loss_fn(model, batch)
        loss.backward()
    return guard.optimizer_step(loss if pass_loss else None, **kw)


def guarded_train(model, opt, guard, inj, steps, loss_fn=ce, scale=None):
    """``steps`` steps on ``learnable_batch`` under ``guard`` (``scale``: a GradScaler's); the guard's events
    as (step, detector, verdict, module, gemm, action)."""
    for step in range(steps):
        if inj is not None:
            inj.set_position(step)
        batch = learnable_batch(step)
        opt.zero_grad()
        with guard.step(step, batch):
            loss = loss_fn(model, batch)
            (loss if scale is None else scale(loss)).backward()
        guard.optimizer_step(loss)
    return [(e["step"], e["detector"], e["verdict"], e.get("module"), e.get("gemm"), e["action"]) for e in guard.events]


FAULT_STEP = 3  # the step of ``make_loop``'s fault


def make_loop(fault: bool, micro_batch: int = 0, site: str = "gemm.forward"):
    """(model, SGD optimizer, attached injector) of a seeded 16-32-4 MLP; ``fault``: a bit flip at ``site``
    of its last Linear at ``FAULT_STEP``, in micro-batch ``micro_batch``."""
    from sdcscope.inject import Injector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = {"kind": "transient", "step": FAULT_STEP, "micro_batch": micro_batch}
    specs = [random_flip(site, schedule=schedule)] if fault else []
    return model, opt, Injector(model, specs, opt).attach()


def weight_fault_run(guard, model, opt, inj, *, stepped=lambda: None, stop_at_rollback=False) -> None:
    """Five steps of a loop with a weight flip at step 3; ``stepped()`` after each applied update."""
    for step in range(5):
        batch = loop_batch(step)
        opt.zero_grad()
        inj.set_position(step)
        with guard.step(step, batch):
            loss = ce(model, batch)
            loss.backward()
        if guard.optimizer_step(loss):
            stepped()
        elif stop_at_rollback and guard.rolled_back_to is not None:
            break
    guard.close()


# --- fault specs ---


def flip_spec(**kw):
    """Bit 30 of element 5 flipped once at step 0, unless ``kw`` says otherwise."""
    base = {
        "model": "bitflip",
        "bits": [30],
        "pattern": {"kind": "element", "index": 5},
        "schedule": {"kind": "transient", "step": 0},
    }
    base.update(kw)
    return FaultSpec.from_dict(base)


def rank_flip(site: str, target: str, rank: int, schedule: dict, bit: int = 30, **extra) -> dict:
    """A bit flip of element 5 on ``rank``, as a spec dict."""
    return {
        "site": site,
        "target": target,
        "rank": rank,
        "model": "bitflip",
        "bits": [bit],
        "pattern": {"kind": "element", "index": 5},
        "schedule": schedule,
        **extra,
    }


def at(step: int) -> dict:
    """A transient schedule at ``step``."""
    return {"kind": "transient", "step": step}


# --- command line ---

CAMPAIGN_SPEC = """
name: cli
workload: {name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}
inject_steps: [2]
horizon: 2
faults: {sites: [gemm.forward], targets: [blocks.0.mlp.fc], bits: [30, 31]}
baseline: {seeds: [5, 6]}
"""


def cli_invoke(*args) -> tuple[int, str]:
    """(exit code, output with its white space folded) of ``sdcscope *args``."""
    from typer.testing import CliRunner

    from sdcscope.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def cli_fails(args, *needles):
    """The folded output of ``sdcscope *args``, refused with exit code 2 and an ``error:`` naming ``needles``."""
    from typer.testing import CliRunner

    from sdcscope.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    for needle in needles:
        assert needle in text, text
    return text


def one_line_error(result):
    """The single ``error:`` line a refused command prints, exit code 2."""
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


# --- run directories ---


def strict_loads(line: str):
    """``json.loads`` as a strict parser (jq, JavaScript) reads: NaN/Infinity tokens are errors."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def load_run(root, name):
    """(summary, events, metrics) of the run directory ``root / name``."""
    out = root / name
    return (
        json.loads((out / "summary.json").read_text()),
        read_jsonl(out / "events.jsonl"),
        read_jsonl(out / "metrics.jsonl"),
    )


def event_summary(events):
    """(step, detector, verdict, action, module) of each guard event."""
    return event_keys(events, "step", "detector", "verdict", "action", "module")


def event_keys(events, *keys):
    """The ``keys`` of each event, as tuples."""
    return [tuple(e[k] for k in keys) for e in events]


# --- sharded checkpoints on two gloo ranks (tests/sharded and tests/reliability share one set) ---


def sharded_dist():
    """The gloo world of the sharded-checkpoint runs."""
    from sdcscope.engine.dist import DistConfig

    return DistConfig(backend="gloo", timeout_s=60)


def sharded_policy():
    """The sharded-checkpoint runs' checkpoint policy: every 2 steps, the last 3 kept."""
    from sdcscope.engine.rundir import CheckpointPolicy

    return CheckpointPolicy(every=2, keep=3)


def two_rank_job(out, kind, steps: int = 3, specs=(), guard=None, *, workload=None, grad_accum: int = 1, **extra):
    """A validated two-rank ``--parallel kind`` job (``kind``: a name or a Topology) on gloo, seed 0,
    of ``workload`` (default: the tiny GPT, batch 2, a 100 kB corpus); ``specs``: fault dicts;
    ``extra``: further ``make_job`` arguments (``checkpoints``, ``crossrank``)."""
    from sdcscope.engine import TrainConfig
    from sdcscope.engine.topology import Topology
    from sdcscope.jobs.torchrun import make_job
    from sdcscope.workloads import WorkloadConfig

    return make_job(
        out,
        2,
        steps=steps,
        workload=workload or WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000),
        train=TrainConfig(seed=0, grad_accum=grad_accum),
        dist_config=sharded_dist(),
        specs=[FaultSpec.from_dict(s) for s in specs],
        guard=guard,
        parallel=kind if isinstance(kind, Topology) else Topology(kind=kind),
        **extra,
    )


def sharded_job(out, kind: str, steps: int, specs=(), guard=None, grad_accum: int = 1) -> dict:
    """A job of the sharded-checkpoint runs (one evaluation batch, a checkpoint every 2 steps), as
    a dict (to cross the spawn)."""
    from sdcscope.workloads import WorkloadConfig

    workload = WorkloadConfig(workload="gpt", preset="tiny", batch_size=2, max_corpus_bytes=100_000, eval_batches=1)
    job = two_rank_job(
        out, kind, steps, specs, guard, workload=workload, grad_accum=grad_accum, checkpoints=sharded_policy()
    )
    return job.to_dict()


def sharded_resume(out, steps: int):
    """``resume_job`` of a sharded run to ``steps``: (job, the checkpoint chosen, those skipped)."""
    from sdcscope.jobs.torchrun import resume_job

    return resume_job(out, steps, dist_config=sharded_dist(), checkpoints=sharded_policy())


def jobs_world(rank: int, world: int, jobs: list[dict]) -> None:
    """Every job (``Job.to_dict()``) on the same ranks of a gloo world, one after the other (the
    process start is paid once); the target of ``spawn``."""
    from sdcscope.engine.dist import init_distributed
    from sdcscope.jobs.torchrun import Job, run_job

    init_distributed(sharded_dist())
    for job in jobs:
        run_job(Job.from_dict(job))


def jsonl_lines(path) -> list[dict]:
    """The records of a JSON-lines file (events.jsonl, injections.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def sharded_checkpoint_runs(tmp) -> dict:
    """Two worlds of two ranks under ``tmp``: the runs, then the resumes of those that stopped early.
    FSDP2: ``whole`` (4 steps, a checkpoint at step 2), ``pristine`` (its copy as written, for the
    tamper tests), ``killed`` (its copy that lost everything after step 2), ``tainted`` (a fault at
    step 2 that the guard only reports); tensor parallel: ``tp_whole`` (3 steps), ``tp_stopped``
    (2 steps, then resumed from its final checkpoint); a 1F1B pipeline of two stages: ``pp_whole``
    (3 steps) and ``pp_stopped`` (2 steps, resumed). Also ``reference`` (``whole``'s
    param_sha256) and ``chosen`` (the checkpoint each resume took)."""
    import shutil

    from sdcscope.engine.dist import spawn
    from sdcscope.guard import GuardConfig

    names = ("whole", "killed", "tainted", "tp_whole", "tp_stopped", "pp_whole", "pp_stopped")
    paths = {n: tmp / n for n in names}
    # the flip at step 2 is found by ABFT and, with no policy, only reported: the state is tainted from then on
    report_only = GuardConfig.from_dict({"profile": "full", "policy": {"defaults": False}})  # every GEMM checked
    fault = rank_flip("gemm.forward", "blocks.0.mlp.fc", 1, at(2), bit=30)
    first = [
        sharded_job(paths["whole"], "fsdp", 4),
        sharded_job(paths["tainted"], "fsdp", 3, [fault], report_only),
        sharded_job(paths["tp_whole"], "tp", 3),
        sharded_job(paths["tp_stopped"], "tp", 2),
        sharded_job(paths["pp_whole"], "pp", 3, grad_accum=2),
        sharded_job(paths["pp_stopped"], "pp", 2, grad_accum=2),
    ]
    spawn(jobs_world, 2, (first,), timeout_s=300)
    paths["reference"] = json.loads((paths["whole"] / "summary.json").read_text())["param_sha256"]
    shutil.copytree(paths["whole"], tmp / "pristine")  # the tamper test's copy, as written
    paths["pristine"] = tmp / "pristine"
    # a run killed after step 3, before its final checkpoint: the periodic step-2 one is the newest
    shutil.copytree(paths["whole"], paths["killed"])
    shutil.rmtree(paths["killed"] / "checkpoint")
    second, paths["chosen"] = [], {}
    for name in ("killed", "tp_stopped", "pp_stopped"):
        job, chosen, skipped = sharded_resume(paths[name], 4 if name == "killed" else 3)
        assert skipped == []
        paths["chosen"][name] = chosen
        second.append(job.to_dict())
    spawn(jobs_world, 2, (second,), timeout_s=300)
    return paths


# --- campaigns ---


def ran_campaign(root: Path, spec: str) -> Path:
    """The campaign of spec text ``spec``, initialised and run in ``root / "c"`` (its workers in this process)."""
    from sdcscope.study import init_campaign, run_campaign

    (root / "spec.yaml").write_text(spec)
    init_campaign(root / "c", root / "spec.yaml")
    run_campaign(root / "c", workers=0)
    return root / "c"


def campaign_tables(directory: Path) -> dict[str, list[dict]]:
    """Every table of campaign ``directory``'s results.sqlite in key order, without the timing
    column: what two backends running the same campaign must both write."""
    import sqlite3

    conn = sqlite3.connect(directory / "results.sqlite")
    conn.row_factory = sqlite3.Row
    try:
        return {
            t: [{k: r[k] for k in r.keys() if k != "wall_s"} for r in conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2")]
            for t in ("trials", "baseline", "twins", "golden", "reference", "thresholds")
        }
    finally:
        conn.close()


def campaign_db(directory: Path):
    """The results database of campaign ``directory`` (a context manager)."""
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import ResultsDB

    return ResultsDB(directory / "results.sqlite", load_campaign(directory / "campaign.yaml"))
