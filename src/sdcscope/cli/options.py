"""The CLI options shared by several commands (train, inject, demo, invariants), defined once,
and their translation into validated configs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.common import CLIError, check_file, path_option

WORKLOAD_OPT = typer.Option("gpt", "--workload", "-w", help="Workload: gpt, moe (mixture of experts) or cnn.")
PRESET_OPT = typer.Option("tiny", "--preset", "-p", help="Model size: tiny, small or base (moe: tiny or small).")
STEPS_OPT = typer.Option(200, "--steps", "-n", help="Optimizer steps in total.")
SEED_OPT = typer.Option(0, "--seed", "-s", help="Seed of initialization and data order.")
CORPUS_OPT = path_option(None, "--corpus", help="Text file or folder (gpt, moe; default: Python's stdlib source).")
BATCH_SIZE_OPT = typer.Option(None, "--batch-size", help="Sequences / images per micro-batch.")
LR_OPT = typer.Option(None, "--lr", help="Peak learning rate.")
GRAD_ACCUM_OPT = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step.")
COMPILE_OPT = typer.Option(
    False,
    "--compile",
    help="Train through torch.compile (inductor); the guard's ABFT checks every Linear inside the graph.",
)
PRECISION_OPT = typer.Option(
    "fp32",
    "--precision",
    help="gpt: fp32, or fp8 (the blocks' Linears run Y, dX and dW as FP8 GEMMs with dynamic per-tensor "
    "scales; the guard's ABFT checks them).",
)
EVAL_EVERY_OPT = typer.Option(0, "--eval-every", help="Evaluate every N steps (0: at the end).")

GUARD_OPT = typer.Option(False, "--guard", help="Watch the run with the Guard (detect, localize, repair).")
GUARD_CONFIG_OPT = path_option(
    None,
    "--guard-config",
    help="YAML guard settings: the guard mapping (profile: full, abft: {...}) or the same under a "
    "top-level guard: key (implies --guard).",
)
INVARIANTS_OPT = path_option(
    None, "--invariants", help="Invariants file checked online by the guard (implies --guard)."
)
PROMETHEUS_OPT = typer.Option(
    None,
    "--prometheus-port",
    help="Serve the guard's metrics and event counters for Prometheus on 127.0.0.1:PORT/metrics "
    "(implies --guard; 0: any free port, logged with -v; with --nproc N rank r serves on PORT+r).",
)


def check_steps(steps: int) -> None:
    if steps < 0:
        raise CLIError(f"--steps {steps} must be >= 0 (the total number of optimizer steps)")


def build_configs(
    workload: str,
    preset: str,
    seed: int,
    *,
    corpus: Optional[Path] = None,
    batch_size: Optional[int] = None,
    lr: Optional[float] = None,
    grad_accum: int = 1,
    eval_every: int = 0,
    resolve: bool = True,
    compile: bool = False,
    precision: str = "fp32",
):
    """Validated (WorkloadConfig, TrainConfig) from CLI options (raises ValueError). ``resolve``:
    the corpus must exist and is recorded as an absolute path (a run resumable from anywhere);
    else it is recorded as given (a distributed run, which is never resumed)."""
    from sdcscope.engine import TrainConfig
    from sdcscope.workloads import WorkloadConfig

    if resolve and corpus is not None:
        if not corpus.exists():
            raise FileNotFoundError(f"corpus path {str(corpus)!r} does not exist (give a text file or a folder)")
        corpus = corpus.resolve()
    wcfg = WorkloadConfig(
        workload=workload,
        preset=preset,
        batch_size=batch_size,
        lr=lr,
        corpus=None if corpus is None else str(corpus),
        precision=precision,
    )
    return wcfg, TrainConfig(seed=seed, grad_accum=grad_accum, eval_every=eval_every, compile=compile)


def with_prometheus(config, port: Optional[int]):
    """``config`` (a GuardConfig, or None: the defaults) serving its metrics for Prometheus on
    ``port`` (``--prometheus-port``); ``port`` None: ``config`` unchanged."""
    if port is None:
        return config
    import dataclasses

    from sdcscope.guard import GuardConfig

    config = config or GuardConfig()
    if config.metrics is None:
        raise CLIError(
            "--prometheus-port serves the guard's metrics, but the guard config switches them off (metrics: null)"
        )
    config.metrics = dataclasses.replace(config.metrics, prometheus_port=port)  # validated here
    return config


def guard_config(
    guard: bool, path: Optional[Path], invariants: Optional[Path] = None, recorded=None, *, resolve: bool = True
):
    """The GuardConfig asked for on the command line, else ``recorded`` (a resumed run's, which
    ``--guard`` alone keeps and ``--invariants`` extends), or None (raises on a bad file). With
    ``resolve`` its file paths are made absolute (relative ones are to the working directory), so
    the run resumes from anywhere. ``$SDCSCOPE_FLEET`` is its ``fleet_history`` when it gives none."""
    if not guard and path is None and invariants is None:
        return recorded
    from sdcscope.guard import GuardConfig
    from sdcscope.localize.history import HISTORY_ENV

    config = GuardConfig.load(check_file("--guard-config", path)) if path is not None else recorded or GuardConfig()
    if invariants is not None:
        config.invariants = str(check_file("--invariants", invariants))
    if config.fleet_history is None and os.environ.get(HISTORY_ENV):  # a configured fleet history
        config.fleet_history = os.environ[HISTORY_ENV]
    if not resolve:
        return config
    if config.invariants is not None:
        config.invariants = str(Path(config.invariants).resolve())
    if config.fleet_history is not None:
        config.fleet_history = str(Path(config.fleet_history).expanduser().resolve())
    if config.metrics is not None and config.metrics.path is not None:
        config.metrics.path = str(Path(config.metrics.path).resolve())
    return config
