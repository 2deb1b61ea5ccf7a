"""``sdcscope train``: a new run, a resumed one (``--resume``), or a distributed one (``--nproc N``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    CLIError, check_file, err_console, fail, first_difference, fmt_loss, load_fault_file, out_console, path_option,
    step_progress, user_errors,
)
from sdcscope.cli.guard_opts import GUARD_CONFIG_OPT, GUARD_OPT, INVARIANTS_OPT, guard_config

WORKLOAD_OPT = typer.Option("gpt", "--workload", "-w", help="Workload: gpt or cnn.")
PRESET_OPT = typer.Option("tiny", "--preset", "-p", help="Model size: tiny, small or base.")
STEPS_OPT = typer.Option(200, "--steps", "-n", help="Optimizer steps in total.")
SEED_OPT = typer.Option(0, "--seed", "-s", help="Seed of initialization and data order.")

KEPT_ON_RESUME = {  # option: (flag, section and key in config.json); a resumed run keeps these
    "workload": ("--workload", "workload", "workload"),
    "preset": ("--preset", "workload", "preset"),
    "corpus": ("--corpus", "workload", "corpus"),
    "batch_size": ("--batch-size", "workload", "batch_size"),
    "lr": ("--lr", "workload", "lr"),
    "seed": ("--seed", "train", "seed"),
    "grad_accum": ("--grad-accum", "train", "grad_accum"),
}


def build_configs(workload: str, preset: str, seed: int, *, corpus: Optional[Path] = None,
                  batch_size: Optional[int] = None, lr: Optional[float] = None,
                  grad_accum: int = 1, eval_every: int = 0):
    """Validated (WorkloadConfig, TrainConfig) from CLI options (raises ValueError)."""
    from sdcscope.engine import TrainConfig
    from sdcscope.workloads import WorkloadConfig

    if corpus is not None and not corpus.exists():
        raise FileNotFoundError(f"corpus path {str(corpus)!r} does not exist (give a text file or a folder)")
    wcfg = WorkloadConfig(workload=workload, preset=preset, batch_size=batch_size, lr=lr,
                          corpus=None if corpus is None else str(corpus.resolve()))  # resumable from anywhere
    return wcfg, TrainConfig(seed=seed, grad_accum=grad_accum, eval_every=eval_every)


def check_steps(steps: int) -> None:
    if steps < 0:
        raise CLIError(f"--steps {steps} must be >= 0 (the total number of optimizer steps)")


def print_summary(out: Path, summary: dict) -> None:
    loss = summary["final_train_loss"]
    out_console.print(
        f"[bold]{summary['outcome']}[/] after {summary['steps']} steps: "
        + ("no step trained" if loss is None else f"train loss {fmt_loss(loss)}")
        + f", val loss {fmt_loss(summary['final_val_loss'])}"
        + (f", val acc {summary['final_val_acc']:.3f}" if "final_val_acc" in summary else "")
    )
    out_console.print(f"run directory: {out}  (config.json, metrics.jsonl, summary.json, checkpoint/)")


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given (click's ParameterSource, compared by name: typer may vendor click)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def check_kept_options(ctx: typer.Context, resume: Path, config: dict) -> None:
    """Refuse options given with --resume that differ from what the run's config.json records."""
    conflicts = []
    for name, (flag, section, key) in KEPT_ON_RESUME.items():
        if not _given(ctx, name):
            continue
        value, recorded = ctx.params[name], config[section].get(key)
        same = (os.path.realpath(value) == os.path.realpath(recorded) if name == "corpus" and recorded is not None
                else value == recorded)
        if not same:
            conflicts.append(f"{flag} {value} (the run has {recorded})")
    if conflicts:
        raise CLIError(f"--resume {str(resume)!r} continues the run its config.json describes; "
                       f"{', '.join(conflicts)} would change it: drop them, or start a new run with --out")


def resume_run(ctx: typer.Context, resume: Path, faults: Optional[Path], guard: bool,
               guard_config_path: Optional[Path], invariants: Optional[Path], eval_every: int):
    """The run in ``resume`` with its recorded faults and guard: ``(run, specs, guard config)``.

    Options that would change what the run trains are refused; the guard (--guard-config,
    --invariants) and --eval-every may change and are recorded in config.json."""
    from sdcscope.engine import Run
    from sdcscope.faults import FaultSpec
    from sdcscope.guard import GuardConfig

    run = Run.resume(resume)
    check_kept_options(ctx, resume, run.config)
    recorded_faults = run.config.get("faults") or []
    try:
        specs = [FaultSpec.from_dict(d) for d in recorded_faults]
        recorded_guard = GuardConfig.from_dict(run.config["guard"]) if run.config.get("guard") else None
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"{str(resume / 'config.json')!r}: {exc}") from None
    from sdcscope.engine.rundir import as_written

    given = None if faults is None else as_written([s.to_dict() for s in load_fault_file("--faults", faults)])
    if given is not None and given != recorded_faults:
        where, value, was = first_difference(given, recorded_faults, "faults")
        raise CLIError(f"--faults {str(faults)!r} differs from the faults recorded in {str(resume / 'config.json')!r}: "
                       f"{where} is {value} in the file, {was} in the run; a resumed run keeps its faults (it "
                       "re-attaches them): drop --faults, or start a new run with --out")
    gcfg = guard_config(guard, guard_config_path, invariants, recorded_guard)
    run.config["guard"] = None if gcfg is None else gcfg.to_dict()
    if _given(ctx, "eval_every"):
        run.trainer.config = dataclasses.replace(run.trainer.config, eval_every=eval_every)
        run.config["train"] = run.trainer.config.to_dict()
    return run, specs, gcfg


class Attached:
    """A single-process run's fault injector (injections.jsonl) and guard (events.jsonl): built,
    and so validated (a fault that never fires in ``steps`` is refused), before any output;
    armed while the ``with`` block trains."""

    def __init__(self, run, specs: list, gcfg, steps: int) -> None:
        from sdcscope.engine import JsonlWriter

        t = run.trainer
        self.callbacks: list[object] = []
        self.injector = self.guard = self.checkpoint = None
        self.logs = [JsonlWriter(run.out / "injections.jsonl"), JsonlWriter(run.out / "events.jsonl")]
        if specs:
            from sdcscope.inject import Injector, validate_specs
            from sdcscope.inject.targets import evaluated, probe_model

            batch = run.workload.batch(t.config.seed, 0, 0)
            validate_specs(t.model, specs, t.optimizer, steps=steps, grad_accum=t.config.grad_accum,
                           probe=probe_model(t.model, lambda model: run.workload.loss(model, batch),
                                             evaluate=run.workload.evaluate if evaluated(specs) else None))
            # a resumed run restored its weights and optimizer state with its permanent faults in them
            self.injector = Injector(t.model, specs, t.optimizer, log=self.logs[0].write, resumed_at=t.step)
            self.callbacks.append(self.injector.callback())
            if any(s.site == "checkpoint" for s in specs):
                from sdcscope.study.experiment import CheckpointFault

                self.checkpoint = CheckpointFault(specs, run.out, *self.logs)
                self.callbacks.append(self.checkpoint)
        if gcfg is not None:
            from sdcscope.guard import Guard

            self.guard = Guard(t.model, t.optimizer, gcfg, run_dir=run.out)
            self.callbacks.append(self.guard.callback(t))  # primed before any fault

    def __enter__(self) -> "Attached":
        if self.injector is not None:
            self.injector.attach()
        return self

    def __exit__(self, *exc) -> None:
        for tool in (self.injector, self.guard, *self.logs):
            if tool is not None:
                tool.close()


@app.command()
def train(
    ctx: typer.Context,
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    out: Optional[Path] = path_option(None, "--out", "-o", help="New run directory."),
    resume: Optional[Path] = path_option(None, "--resume", help="Continue the run in this directory up to --steps, "
                                                                 "with its recorded faults and guard."),
    corpus: Optional[Path] = path_option(None, "--corpus", help="Text file or folder (gpt; default: Python's stdlib source)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences / images per micro-batch."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    eval_every: int = typer.Option(0, "--eval-every", help="Evaluate every N steps (0: at the end)."),
    guard: bool = GUARD_OPT,
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    invariants: Optional[Path] = INVARIANTS_OPT,
    nproc: int = typer.Option(1, "--nproc", help="Data-parallel ranks; N != 1 launches torchrun (gloo/nccl DDP); "
                                                 "with --guard every rank is watched and decides alike."),
    faults: Optional[Path] = path_option(None, "--faults", help="Fault specs (YAML/JSON) injected into the run; "
                                                                 "with --nproc N bound to ranks."),
    timeout: float = typer.Option(300.0, "--timeout", help="Distributed run: seconds a rendezvous or collective may "
                                                           "wait before a missing or hung rank fails the run."),
) -> None:
    """Train a reference workload deterministically into a run directory."""
    with user_errors():
        check_steps(steps)
        if not timeout > 0:
            raise CLIError(f"--timeout {timeout:g} must be > 0 (seconds a distributed run may wait)")
    if nproc != 1:
        with user_errors():
            if resume is not None:
                raise CLIError(f"--resume with --nproc {nproc}: resuming a distributed run is not supported "
                               "(the distributed entry point starts new runs only); start a new run with --out")
            if out is None:
                raise CLIError("--out DIR is required")
            if invariants is not None:
                raise CLIError("--invariants is not supported in a distributed run yet; drop it or use --nproc 1")
            for flag, path in (("--faults", faults), ("--guard-config", guard_config_path)):
                if path is not None:
                    check_file(flag, path)
            from sdcscope.engine.ddp import launch
            from sdcscope.engine.run import Interrupted

            argv = ["--out", str(out), "--workload", workload, "--preset", preset, "--steps", str(steps),
                    "--seed", str(seed), "--grad-accum", str(grad_accum), "--eval-every", str(eval_every),
                    "--timeout", str(timeout)]
            for flag, value in (("--corpus", corpus), ("--batch-size", batch_size), ("--lr", lr),
                                ("--faults", faults), ("--guard-config", guard_config_path)):
                if value is not None:
                    argv += [flag, str(value)]
            if guard:
                argv.append("--guard")
            try:
                rc = launch(nproc, argv)  # validates first: ValueError → exit 2, nothing created
            except Interrupted as stop:  # every rank stopped (or was killed); summary.json written
                err_console.print(f"interrupted at step {stop.summary['steps']} of {steps}: summary saved in "
                                  f"{out / 'summary.json'} (a distributed run cannot be resumed)",
                                  highlight=False, soft_wrap=True)
                raise typer.Exit(code=128 + stop.signum) from None
        if rc != 0:
            raise fail(f"distributed training failed (exit code {rc}); see the rank errors above and "
                       f"{out}/failure.rank*.json")
        if guard or guard_config_path is not None:
            events = out / "events.jsonl"
            count = sum(1 for line in events.read_text().splitlines() if line.strip()) if events.is_file() else 0
            out_console.print(f"guard: {count} event(s) in {events}; per-rank timelines: sdcscope report {out}")
        return
    with user_errors():
        from sdcscope.engine import Run
        from sdcscope.engine.run import Interrupted

        if resume is not None:
            if out is not None:
                raise CLIError("give either --out (a new run) or --resume (an existing run), not both")
            run, specs, gcfg = resume_run(ctx, resume, faults, guard, guard_config_path, invariants, eval_every)
            if steps < run.trainer.step:
                raise CLIError(f"--steps {steps} is below the {run.trainer.step} steps the run already has")
            if run.reached(steps):
                out_console.print(f"{resume} already has {steps} steps: nothing to train (summary.json kept)")
                print_summary(run.out, run.summary)
                return
        else:
            if out is None:
                raise CLIError("--out DIR is required (or --resume DIR)")
            specs = [] if faults is None else load_fault_file("--faults", faults)
            gcfg = guard_config(guard, guard_config_path, invariants)
            wcfg, tcfg = build_configs(workload, preset, seed, corpus=corpus, batch_size=batch_size,
                                       lr=lr, grad_accum=grad_accum, eval_every=eval_every)
            run = Run(out, wcfg, tcfg, extra_config={"faults": [s.to_dict() for s in specs],
                                                     "guard": None if gcfg is None else gcfg.to_dict()})
        tools = Attached(run, specs, gcfg, steps)  # may raise: a spec that does not fit the model
    try:
        with tools, step_progress(steps, run.trainer.step) as advance:
            summary = run.train(steps, callbacks=tools.callbacks, on_step=advance)
    except Interrupted as stop:
        err_console.print(f"interrupted at step {stop.summary['steps']} of {steps}: checkpoint and summary saved; "
                          f"continue with: sdcscope train --resume {run.out} --steps {steps}",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(code=128 + stop.signum) from None
    print_summary(run.out, summary)
    if tools.injector is not None:
        fired = sum(r.get("when") != "eval" for r in tools.injector.records) + \
            (tools.checkpoint.fired if tools.checkpoint is not None else 0)  # in training, not evaluation
        out_console.print(f"faults: {fired} fired in this session "
                          f"({run.out / 'injections.jsonl'})")
    if tools.guard is not None:
        out_console.print(f"guard: {len(tools.guard.events)} event(s) in {run.out / 'events.jsonl'}")
