"""A sharded or data-parallel run of the tiny GPT equals the single-process run of the same global
batch (gloo on loopback, through ``sdcscope train``): per step the loss and the gradient norm the
trainer clipped with, and the final parameters, within a float tolerance.

**The matching single-process run.** Rank r trains micro-batch m of a step on the workload's
micro-batch ``shard(dp_rank, grad_accum, m) = dp_rank * grad_accum + m``, and ranks of one
tensor-parallel group share ``dp_rank``; each rank's loss is divided by its ``grad_accum`` and the
data-parallel reduction averages over the ``dp`` ranks. With ``grad_accum`` 1, the ``dp`` ranks
together train micro-batches ``0 .. dp-1`` of every step, averaged: exactly the single-process
run with ``--grad-accum dp`` (micro-batches ``0 .. dp-1``, each loss divided by ``dp``).
``--parallel tp`` has ``dp = 1``; ``fsdp``, ``ddp`` and ``fsdp+tp`` (a 2×2 mesh) ``dp = 2``.

**Clipping is active.** The workload clips at ``grad_clip = 1.0`` and the tiny GPT's first steps
have gradient norms of 2.6-4.9, so every update is scaled by ``1 / norm``: a wrong global norm
(a replicated parameter counted on every rank, say) changes the logged norm, then the updates,
the parameters and the losses.

**Tolerance.** The runs compute the same sums in another order (a gradient reduced across ranks
or split across a tensor-parallel group, a norm summed in float64 from per-shard squares, the
world-mean loss summed in float64 from float32 rank losses), so they agree to float32 rounding,
not bit for bit. Largest gaps measured over the four worlds (4 steps, ``--batch-size 2``, seed 0,
2-core CPU): loss 4.8e-7 absolute (8.9e-8 relative), gradient norm 7.2e-7 absolute (2.1e-7
relative), parameters 4.0e-7 absolute (values up to 1.0; AdamW moves each by at most the
learning rate, 1.5e-4 to 6e-4 in these warm-up steps). Tolerances: losses and norms ``rtol 2e-6,
atol 1e-6`` (allowing 1.2e-5 at a loss of 5.3, 7.5e-6 at a norm of 3.2: 10× the largest gap or
more); parameters ``atol 3e-6``, no ``rtol`` (7.5× the largest gap). With a replicated parameter
counted on every rank (``--parallel tp`` and ``fsdp+tp``) the gaps are: norm 0.36-0.38 relative,
loss 5.1e-5 absolute, parameters 2.2e-5-2.9e-5 absolute, so each of the three checks fails on
its own. (Plain ``fsdp`` shards every parameter and DDP clips the all-reduced gradient, so
neither has a replicated shard to miscount: they pin the data split and the reductions.)
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cli_invoke

pytestmark = pytest.mark.distributed

STEPS = 4
COMMON = ("--steps", STEPS, "--batch-size", 2, "--seed", 0)
"""Every run: 4 steps of 2 sequences per micro-batch, seed 0, one checkpoint at the end."""
DIST = ("--timeout", 60)

METRIC_TOL = {"rtol": 2e-6, "atol": 1e-6}
PARAM_TOL = {"rtol": 0.0, "atol": 3e-6}

# world: (--nproc, --parallel, data-parallel degree = --grad-accum of the matching single-process run)
WORLDS = {
    "fsdp": (2, "fsdp", 2),
    "tp": (2, "tp", 1),
    "ddp": (2, "ddp", 2),
    "fsdp+tp": (4, "fsdp+tp", 2),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(name, *args)``: the run directory of ``sdcscope train *COMMON *args``, trained once
    per module (a world deselected trains nothing)."""
    root = tmp_path_factory.mktemp("equivalence")
    done = {}

    def get(name: str, *args):
        if name not in done:
            out = root / name.replace("+", "_")
            code, text = cli_invoke("train", *COMMON, *args, "--out", out)
            assert code == 0, f"sdcscope train {' '.join(map(str, args))} failed ({code}): {text}"
            done[name] = out
        return done[name]

    return get


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _parameters(out, tmp_path) -> dict[str, torch.Tensor]:
    """The final full parameters of a run, by name: ``checkpoint/state.pt`` of a single-process
    run; a distributed run's DCP checkpoint (DDP or sharded) gathered into one file first."""
    ckpt = out / "checkpoint"
    path = ckpt / "state.pt"
    if not path.is_file():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        path = tmp_path / f"{out.name}.pt"
        dcp_to_torch_save(ckpt, path)
    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def _close(actual, expected, what: str, tol: dict, nproc: int) -> None:
    torch.testing.assert_close(
        actual,
        expected,
        **tol,
        msg=lambda m: f"{what}: the {nproc}-rank run departs from the single-process run of the same global batch\n{m}",
    )


@pytest.mark.parametrize(
    "world",
    [
        "fsdp",
        "tp",
        "ddp",
        pytest.param("fsdp+tp", marks=pytest.mark.slow),  # 4 ranks on 2 cores: ~20 s
    ],
)
def test_sharded_and_ddp_runs_match_the_single_process_run_in_clipped_norm_loss_and_parameters(world, run, tmp_path):
    nproc, parallel, dp = WORLDS[world]
    single = run(f"single_accum{dp}", "--grad-accum", dp)
    sharded = run(world, "--nproc", nproc, "--parallel", parallel, *DIST)

    config, alone = (json.loads((out / "config.json").read_text()) for out in (sharded, single))
    assert config["world_size"] == nproc and config["train"]["grad_accum"] == 1
    assert (config.get("parallel") or {"kind": "ddp"})["kind"] == parallel
    assert alone["train"]["grad_accum"] == dp and alone["data"]["corpus_sha256"] == config["data"]["corpus_sha256"]
    ref, got = _metrics(single), _metrics(sharded)
    assert [m["step"] for m in got] == [m["step"] for m in ref] == list(range(STEPS))
    assert not any(m["skipped"] for m in ref + got)
    # clipping changes every update: each norm the trainers clipped with is well above the clip value
    clip = alone["workload"]["grad_clip"]
    norms = [m["grad_norm"] for m in ref + got]
    assert clip > 0 and all(n > 2 * clip for n in norms), f"clip {clip}, norms {norms}"

    for key in ("grad_norm", "loss"):
        _close(
            torch.tensor([m[key] for m in got], dtype=torch.float64),
            torch.tensor([m[key] for m in ref], dtype=torch.float64),
            f"--parallel {world} --nproc {nproc}: per-step {key} (index = step)",
            METRIC_TOL,
            nproc,
        )

    mine, theirs = _parameters(sharded, tmp_path), _parameters(single, tmp_path)
    assert sorted(mine) == sorted(theirs) and len(theirs) > 10
    for name, value in theirs.items():
        _close(mine[name].float(), value.float(), f"--parallel {world}: final parameter {name}", PARAM_TOL, nproc)
