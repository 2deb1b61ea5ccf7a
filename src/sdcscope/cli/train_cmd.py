"""``sdcscope train``: a new run, a resumed one (``--resume``), or a distributed one (``--nproc N``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    CLIError,
    check_file,
    err_console,
    fail,
    first_difference,
    fmt_loss,
    load_fault_file,
    out_console,
    path_option,
    print_summary,
    step_progress,
    storage_errors,
    user_errors,
)
from sdcscope.cli.options import (
    BATCH_SIZE_OPT,
    COMPILE_OPT,
    CORPUS_OPT,
    EVAL_EVERY_OPT,
    GRAD_ACCUM_OPT,
    GUARD_CONFIG_OPT,
    GUARD_OPT,
    INVARIANTS_OPT,
    LR_OPT,
    PRESET_OPT,
    PROMETHEUS_OPT,
    SEED_OPT,
    STEPS_OPT,
    WORKLOAD_OPT,
    build_configs,
    check_steps,
    guard_config,
    with_prometheus,
)
from sdcscope.cli.output import JSON_OPT, json_output, note
from sdcscope.common.exitcodes import ExitCode

KEPT_ON_RESUME = {  # option: (flag, section and key in config.json); a resumed run keeps these
    "workload": ("--workload", "workload", "workload"),
    "preset": ("--preset", "workload", "preset"),
    "corpus": ("--corpus", "workload", "corpus"),
    "batch_size": ("--batch-size", "workload", "batch_size"),
    "lr": ("--lr", "workload", "lr"),
    "seed": ("--seed", "train", "seed"),
    "grad_accum": ("--grad-accum", "train", "grad_accum"),
    "compile": ("--compile", "train", "compile"),
}


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
        same = (
            os.path.realpath(value) == os.path.realpath(recorded)
            if name == "corpus" and recorded is not None
            else value == recorded
        )
        if not same:
            conflicts.append(f"{flag} {value} (the run has {recorded})")
    if conflicts:
        raise CLIError(
            f"--resume {str(resume)!r} continues the run its config.json describes; "
            f"{', '.join(conflicts)} would change it: drop them, or start a new run with --out"
        )


def resume_run(
    ctx: typer.Context,
    resume: Path,
    faults: Optional[Path],
    guard: bool,
    guard_config_path: Optional[Path],
    invariants: Optional[Path],
    eval_every: int,
    checkpoints=None,
):
    """The run in ``resume`` with its recorded faults and guard: ``(run, specs, guard config)``.

    Options that would change what the run trains are refused; the guard (--guard-config,
    --invariants) and --eval-every may change and are recorded in config.json."""
    from sdcscope.engine import Run
    from sdcscope.faults import FaultSpec
    from sdcscope.guard import GuardConfig

    run = Run.resume(resume, checkpoints=checkpoints)
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
        raise CLIError(
            f"--faults {str(faults)!r} differs from the faults recorded in {str(resume / 'config.json')!r}: "
            f"{where} is {value} in the file, {was} in the run; a resumed run keeps its faults (it "
            "re-attaches them): drop --faults, or start a new run with --out"
        )
    gcfg = guard_config(guard, guard_config_path, invariants, recorded_guard)
    run.config["guard"] = None if gcfg is None else gcfg.to_dict()
    if _given(ctx, "eval_every"):
        run.trainer.config = dataclasses.replace(run.trainer.config, eval_every=eval_every)
        run.config["train"] = run.trainer.config.to_dict()
    return run, specs, gcfg


@app.command()
def train(
    ctx: typer.Context,
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    out: Optional[Path] = path_option(None, "--out", "-o", help="New run directory."),
    resume: Optional[Path] = path_option(
        None, "--resume", help="Continue the run in this directory up to --steps, with its recorded faults and guard."
    ),
    corpus: Optional[Path] = CORPUS_OPT,
    batch_size: Optional[int] = BATCH_SIZE_OPT,
    lr: Optional[float] = LR_OPT,
    grad_accum: int = GRAD_ACCUM_OPT,
    compile: bool = COMPILE_OPT,
    eval_every: int = EVAL_EVERY_OPT,
    guard: bool = GUARD_OPT,
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    invariants: Optional[Path] = INVARIANTS_OPT,
    nproc: int = typer.Option(
        1,
        "--nproc",
        help="Data-parallel ranks; N != 1 launches torchrun (gloo/nccl DDP); "
        "with --guard every rank is watched and decides alike.",
    ),
    parallel: str = typer.Option(
        "ddp",
        "--parallel",
        help="With --nproc N, how the model is laid over the ranks: ddp (a replica per rank), or split by the "
        "workload's plan (gpt): fsdp (FSDP2), tp (tensor parallel), fsdp+tp (2-D, TP degree 2) or hsdp (2-D: "
        "replicas of 2-rank FSDP2 groups). A topology the model does not fit is refused before any rank starts.",
    ),
    faults: Optional[Path] = path_option(
        None, "--faults", help="Fault specs (YAML/JSON) injected into the run; with --nproc N bound to ranks."
    ),
    timeout: float = typer.Option(
        300.0,
        "--timeout",
        help="Distributed run: seconds a rendezvous or collective may "
        "wait before a missing or hung rank fails the run.",
    ),
    checkpoint_every: int = typer.Option(
        100, "--checkpoint-every", help="Save a checkpoint every N steps (0: only at the end), to resume after a kill."
    ),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", help="Periodic checkpoints kept (the newest)."),
    prometheus_port: Optional[int] = PROMETHEUS_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Train a reference workload deterministically into a run directory.

    Exit codes: 0 success, 2 user error, 3 the run crashed (non-finite), 4 the guard stopped it,
    5 a rank died or hung, 6 a write failed (disk full, read-only), 130 interrupted."""
    json_output(ctx, as_json)
    with user_errors():
        check_steps(steps)
        if not timeout > 0:
            raise CLIError(f"--timeout {timeout:g} must be > 0 (seconds a distributed run may wait)")
        from sdcscope.engine.rundir import CheckpointPolicy

        policy = CheckpointPolicy(every=checkpoint_every, keep=keep_checkpoints)
        from sdcscope.engine.topology import Topology

        pcfg = Topology(kind=parallel)
        if nproc == 1 and pcfg.sharded and not (resume is not None and _sharded(resume)):
            raise CLIError(f"--parallel {parallel} splits the model over ranks: give --nproc N (N >= 2)")
    if nproc != 1 or (resume is not None and _sharded(resume)):
        with user_errors():
            from sdcscope.engine.dist import DistConfig
            from sdcscope.engine.run import Interrupted
            from sdcscope.jobs import launch

            if resume is not None and _sharded(resume):
                job = _sharded_resume(ctx, resume, out, steps, DistConfig(timeout_s=timeout), policy)
                out, specs, guarded = resume, job.specs, job.guard is not None
            else:
                if resume is not None:
                    raise CLIError(
                        f"--resume with --nproc {nproc}: resuming a DDP run is not supported (a sharded "
                        "one, --parallel fsdp|tp|fsdp+tp|hsdp, is); start a new run with --out"
                    )
                if not pcfg.sharded and (_given(ctx, "checkpoint_every") or _given(ctx, "keep_checkpoints")):
                    raise CLIError(
                        "--checkpoint-every/--keep-checkpoints apply to single-process and sharded (--parallel "
                        "fsdp|tp|fsdp+tp|hsdp) runs (a DDP run saves its checkpoint at the end and cannot be "
                        "resumed yet); drop them, or use --nproc 1 or a sharded --parallel"
                    )
                if out is None:
                    raise CLIError("--out DIR is required")
                if invariants is not None:
                    raise CLIError("--invariants is not supported in a distributed run yet; drop it or use --nproc 1")
                if prometheus_port is not None:
                    raise CLIError("--prometheus-port serves one process; a distributed run is not supported yet")
                if compile:
                    raise CLIError("--compile trains in one process for now; drop it or use --nproc 1")
                for flag, path in (("--faults", faults), ("--guard-config", guard_config_path)):
                    if path is not None:
                        check_file(flag, path)
                from sdcscope.faults import load_specs
                from sdcscope.jobs import make_job

                gcfg = guard_config(guard, guard_config_path, resolve=False)
                specs = [] if faults is None else load_specs(faults)
                wcfg, tcfg = build_configs(
                    workload,
                    preset,
                    seed,
                    corpus=corpus,
                    batch_size=batch_size,
                    lr=lr,
                    grad_accum=grad_accum,
                    eval_every=eval_every,
                    resolve=False,
                    compile=compile,
                )
                job = make_job(
                    out,
                    nproc,
                    steps=steps,
                    workload=wcfg,
                    train=tcfg,
                    dist_config=DistConfig(timeout_s=timeout),
                    specs=specs,
                    guard=gcfg,
                    parallel=pcfg,
                    checkpoints=policy,
                )
                guarded = guard or guard_config_path is not None
            try:
                rc = launch(job)  # validates first: ValueError → exit 2, nothing created
            except Interrupted as stop:  # every rank stopped (or was killed); summary.json written
                then = (
                    f"checkpoint and summary saved; continue with: sdcscope train --resume {out} --steps {steps}"
                    if job.parallel.sharded
                    else f"summary saved in {out / 'summary.json'} (a DDP run cannot be resumed)"
                )
                err_console.print(
                    f"interrupted at step {stop.summary['steps']} of {steps}: {then}",
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(code=128 + stop.signum) from None
        if rc != 0:
            from sdcscope.jobs.launcher import describe_failure

            code, message = describe_failure(out, rc)
            raise fail(message, code)
        if (out / "summary.json").is_file():
            note(**json.loads((out / "summary.json").read_text()), run_dir=str(out))
        _print_distributed(out, specs, guarded)
        return
    with user_errors():
        from sdcscope.engine import Run
        from sdcscope.engine.run import Interrupted

        if resume is not None:
            if out is not None:
                raise CLIError("give either --out (a new run) or --resume (an existing run), not both")
            run, specs, gcfg = resume_run(ctx, resume, faults, guard, guard_config_path, invariants, eval_every, policy)
            gcfg = with_prometheus(gcfg, prometheus_port)
            _print_resume_point(run)
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
            gcfg = with_prometheus(guard_config(guard, guard_config_path, invariants), prometheus_port)
            wcfg, tcfg = build_configs(
                workload,
                preset,
                seed,
                corpus=corpus,
                batch_size=batch_size,
                lr=lr,
                grad_accum=grad_accum,
                eval_every=eval_every,
                compile=compile,
            )
            run = Run(
                out,
                wcfg,
                tcfg,
                extra_config={
                    "faults": [s.to_dict() for s in specs],
                    "guard": None if gcfg is None else gcfg.to_dict(),
                },
                checkpoints=policy,
            )
        from sdcscope.jobs import FaultyRun

        tools = FaultyRun(run, specs, gcfg, steps=steps)  # may raise: a spec that does not fit the model
    events = None if tools.guard is None else (lambda: len(tools.guard.events))
    try:
        with storage_errors(), tools, step_progress(steps, run.trainer.step, events=events) as advance:
            summary = run.train(steps, callbacks=tools.callbacks, on_step=advance, certify=tools.certify)
    except Interrupted as stop:
        err_console.print(
            f"interrupted at step {stop.summary['steps']} of {steps}: checkpoint and summary saved; "
            f"continue with: sdcscope train --resume {run.out} --steps {steps}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=128 + stop.signum) from None
    print_summary(run.out, summary)
    if tools.injector is not None:
        out_console.print(f"faults: {tools.fired} fired in this session ({run.out / 'injections.jsonl'})")
        note(faults_fired=tools.fired)
    if tools.guard is not None:
        out_console.print(f"guard: {len(tools.guard.events)} event(s) in {run.out / 'events.jsonl'}")
        if tools.guard.abft is not None:
            out_console.print(f"guard: {tools.guard.abft.coverage()}")
        note(guard_events=len(tools.guard.events))
    _exit_for(summary)


def _sharded(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a sharded run (--parallel fsdp|tp|fsdp+tp|hsdp), resumed on its ranks."""
    from sdcscope.common.io import read_json

    try:
        recorded = read_json(run_dir / "config.json").get("parallel") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(recorded, dict) and recorded.get("kind") not in (None, "ddp")


RECORDED_ON_SHARDED_RESUME = {
    "faults": "--faults",
    "guard": "--guard",
    "guard_config_path": "--guard-config",
    "invariants": "--invariants",
    "eval_every": "--eval-every",
    "prometheus_port": "--prometheus-port",
}


def _sharded_resume(ctx: typer.Context, resume: Path, out, steps: int, dist_config, policy):
    """The job that continues the sharded run in ``resume``; says which checkpoint it takes and
    which newer ones it passes over (as a single-process resume does)."""
    from sdcscope.common.io import read_json
    from sdcscope.jobs.torchrun import resume_job

    if out is not None:
        raise CLIError("give either --out (a new run) or --resume (an existing run), not both")
    given = [flag for name, flag in RECORDED_ON_SHARDED_RESUME.items() if _given(ctx, name)]
    if given:
        raise CLIError(
            f"--resume {str(resume)!r} continues a sharded run with the faults and guard its config.json "
            f"records; drop {', '.join(given)}"
        )
    check_kept_options(ctx, resume, read_json(resume / "config.json"))
    job, chosen, skipped = resume_job(
        resume,
        steps,
        nproc=ctx.params["nproc"] if _given(ctx, "nproc") else None,
        parallel=ctx.params["parallel"] if _given(ctx, "parallel") else None,
        dist_config=dist_config,
        checkpoints=policy,
    )
    for path, why in skipped:
        err_console.print(f"skipped checkpoint {path}: {why}", markup=False, highlight=False, soft_wrap=True)
    err_console.print(
        f"resuming from {chosen} on {job.nproc} ranks (--parallel {job.parallel.kind})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return job


OUTCOME_CODES = {"crash": ExitCode.CRASHED, "stalled": ExitCode.GUARD_STOPPED}
"""A finished run's outcome → the exit code a scheduler sees (every other outcome: 0)."""


def _exit_for(summary: dict) -> None:
    """Exit with the outcome's code; a guard's stop says in one line why (what the ledger found)
    and which state the run ends on."""
    code = OUTCOME_CODES.get(summary.get("outcome"))
    if code == ExitCode.GUARD_STOPPED and summary.get("stop_reason"):
        at = summary.get("stopped_at_step")
        where = "" if at is None else f" at step {at}"
        raise fail(f"the guard stopped the run{where}: {summary['stop_reason']}; {ends_on(summary)}", code)
    if code is not None:
        raise typer.Exit(code=int(code))


def ends_on(summary: dict) -> str:
    """Which training state a stopped run ends on (what checkpoint/ holds): its step, whether a
    rollback took it there, whether the guard vouches for it, and its train loss."""
    steps, at = summary["steps"], summary.get("stopped_at_step")
    verified = {True: "verified ", False: "UNVERIFIED "}.get(summary.get("state_verified"), "")
    kind = "snapshot" if at is not None and steps <= at else "state"  # rolled back to it, or stopped there
    trained = "the initial model" if steps == 0 else f"train loss {fmt_loss(summary.get('final_train_loss'))}"
    return f"the run ends on the {verified}{kind} of step {steps} ({trained}; checkpoint/ holds it)"


def _print_resume_point(run) -> None:
    """Which checkpoint a resume continues from, and the newer ones it passed over and why."""
    for path, why in run.skipped_checkpoints:
        err_console.print(f"skipped checkpoint {path}: {why}", markup=False, highlight=False, soft_wrap=True)
    if run.skipped_checkpoints:
        err_console.print(
            f"resuming from {run.resumed_from} (step {run.trainer.step})", markup=False, highlight=False, soft_wrap=True
        )


def _count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _print_distributed(out: Path, specs: list, guarded: bool) -> None:
    """A distributed run's faults and events, as a single run prints them; its outcome's exit code."""
    from sdcscope.common.io import read_json

    if specs:
        out_console.print(f"faults: {_count(out / 'injections.jsonl')} fired ({out / 'injections.jsonl'})")
    if guarded:
        events = out / "events.jsonl"
        out_console.print(f"guard: {_count(events)} event(s) in {events}; per-rank timelines: sdcscope report {out}")
    summary = read_json(out / "summary.json") if (out / "summary.json").is_file() else {}
    _exit_for(summary)
