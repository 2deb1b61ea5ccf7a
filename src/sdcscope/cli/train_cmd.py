"""``sdcscope train`` and ``sdcscope demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import CLIError, out_console, step_progress, user_errors

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
) -> None:
    """Train a reference workload deterministically into a run directory."""
    with user_errors():
        check_steps(steps)
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
            run = Run(out, wcfg, tcfg)
        if steps < run.trainer.step:
            raise CLIError(f"--steps {steps} is below the {run.trainer.step} steps the run already has")
    with step_progress(steps, run.trainer.step) as advance:
        summary = run.train(steps, on_step=advance)
    print_summary(run.out, summary)


DEMO_MARKER = "demo.json"


def prepare_demo_dir(out: Path) -> None:
    """The demo may replace its own earlier output, never anything else."""
    import shutil

    from sdcscope.engine import check_new_run_dir

    if (out / DEMO_MARKER).is_file():
        shutil.rmtree(out)
    check_new_run_dir(out)


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Where to write the demo's runs."),
    steps: int = typer.Option(300, "--steps", "-n", help="Training steps."),
) -> None:
    """The main job on the default workload: train the tiny GPT on Python's own source."""
    with user_errors():
        check_steps(steps)
        prepare_demo_dir(out)
        from sdcscope.engine import Run, write_json

        wcfg, tcfg = build_configs("gpt", "tiny", 0, eval_every=max(1, steps // 5))
        run = Run(out / "train", wcfg, tcfg)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / DEMO_MARKER, {"command": "sdcscope demo", "steps": steps})
    out_console.print(f"training the tiny byte-level GPT on {run.workload.describe()['corpus_source']} …")
    with step_progress(steps) as advance:
        summary = run.train(steps, on_step=advance)
    print_summary(run.out, summary)
