"""``sdcscope train`` and ``sdcscope demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import CLIError, fail, out_console, step_progress, user_errors
from sdcscope.cli.guard_opts import GUARD_CONFIG_OPT, GUARD_OPT, INVARIANTS_OPT, guard_config

WORKLOAD_OPT = typer.Option("gpt", "--workload", "-w", help="Workload: gpt or cnn.")
PRESET_OPT = typer.Option("tiny", "--preset", "-p", help="Model size: tiny, small or base.")
STEPS_OPT = typer.Option(200, "--steps", "-n", help="Optimizer steps in total.")
SEED_OPT = typer.Option(0, "--seed", "-s", help="Seed of initialization and data order.")


def build_configs(workload: str, preset: str, seed: int, *, corpus: Optional[Path] = None,
                  batch_size: Optional[int] = None, lr: Optional[float] = None,
                  grad_accum: int = 1, eval_every: int = 0):
    """Validated (WorkloadConfig, TrainConfig) from CLI options (raises ValueError)."""
    from sdcscope.engine import TrainConfig
    from sdcscope.workloads import WorkloadConfig

    if corpus is not None and not corpus.exists():
        raise FileNotFoundError(f"corpus path {str(corpus)!r} does not exist (give a text file or a folder)")
    wcfg = WorkloadConfig(workload=workload, preset=preset, batch_size=batch_size, lr=lr,
                          corpus=None if corpus is None else str(corpus))
    return wcfg, TrainConfig(seed=seed, grad_accum=grad_accum, eval_every=eval_every)


def check_steps(steps: int) -> None:
    if steps < 0:
        raise CLIError(f"--steps {steps} must be >= 0 (the total number of optimizer steps)")


def print_summary(out: Path, summary: dict) -> None:
    out_console.print(
        f"[bold]{summary['outcome']}[/] after {summary['steps']} steps: "
        f"train loss {summary['final_train_loss']}, val loss {summary['final_val_loss']:.4f}"
        + (f", val acc {summary['final_val_acc']:.3f}" if "final_val_acc" in summary else "")
    )
    out_console.print(f"run directory: {out}  (config.json, metrics.jsonl, summary.json, checkpoint/)")


@app.command()
def train(
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="New run directory."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory up to --steps."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="Text file or folder (gpt; default: Python's stdlib source)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences / images per micro-batch."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    eval_every: int = typer.Option(0, "--eval-every", help="Evaluate every N steps (0: at the end)."),
    guard: bool = GUARD_OPT,
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    invariants: Optional[Path] = INVARIANTS_OPT,
    nproc: int = typer.Option(1, "--nproc", help="Data-parallel ranks; N != 1 launches torchrun (gloo/nccl DDP); "
                                                 "with --guard every rank is watched and decides alike."),
    faults: Optional[Path] = typer.Option(None, "--faults", help="Fault specs bound to ranks (distributed run)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Distributed run: seconds a rendezvous or collective may "
                                                           "wait before a missing or hung rank fails the run."),
) -> None:
    """Train a reference workload deterministically into a run directory."""
    if nproc != 1 or faults is not None:
        with user_errors():
            check_steps(steps)
            if resume is not None:
                raise CLIError("--resume does not apply to a distributed run")
            if out is None:
                raise CLIError("--out DIR is required")
            if invariants is not None:
                raise CLIError("--invariants is not supported in a distributed run yet; drop it or use --nproc 1")
            from sdcscope.engine.ddp import launch

            argv = ["--out", str(out), "--workload", workload, "--preset", preset, "--steps", str(steps),
                    "--seed", str(seed), "--grad-accum", str(grad_accum), "--eval-every", str(eval_every),
                    "--timeout", str(timeout)]
            for flag, value in (("--corpus", corpus), ("--batch-size", batch_size), ("--lr", lr),
                                ("--faults", faults), ("--guard-config", guard_config_path)):
                if value is not None:
                    argv += [flag, str(value)]
            if guard:
                argv.append("--guard")
            rc = launch(nproc, argv)  # validates first: ValueError → exit 2, nothing created
        if rc != 0:
            raise fail(f"distributed training failed (exit code {rc}); see the rank errors above and "
                       f"{out}/failure.rank*.json")
        if guard or guard_config_path is not None:
            events = out / "events.jsonl"
            count = sum(1 for line in events.read_text().splitlines() if line.strip()) if events.is_file() else 0
            out_console.print(f"guard: {count} event(s) in {events}; per-rank timelines: sdcscope report {out}")
        return
    with user_errors():
        check_steps(steps)
        gcfg = guard_config(guard, guard_config_path, invariants)
        from sdcscope.engine import Run

        if resume is not None:
            if out is not None:
                raise CLIError("give either --out (a new run) or --resume (an existing run), not both")
            run = Run.resume(resume)
        else:
            if out is None:
                raise CLIError("--out DIR is required (or --resume DIR)")
            wcfg, tcfg = build_configs(workload, preset, seed, corpus=corpus, batch_size=batch_size,
                                       lr=lr, grad_accum=grad_accum, eval_every=eval_every)
            run = Run(out, wcfg, tcfg, extra_config={"guard": None if gcfg is None else gcfg.to_dict()})
        if steps < run.trainer.step:
            raise CLIError(f"--steps {steps} is below the {run.trainer.step} steps the run already has")
        callbacks = []
        if gcfg is not None:
            from sdcscope.guard import Guard

            g = Guard(run.trainer.model, run.trainer.optimizer, gcfg, run_dir=run.out)  # may raise
            callbacks.append(g.callback())
    with step_progress(steps, run.trainer.step) as advance:
        summary = run.train(steps, callbacks=callbacks, on_step=advance)
    print_summary(run.out, summary)
    if gcfg is not None:
        out_console.print(f"guard: {len(g.events)} event(s) in {run.out / 'events.jsonl'}")
        g.close()
