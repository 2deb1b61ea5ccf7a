"""``sdcscope train``: a new run, a resumed one (``--resume``), or a distributed one (``--nproc N``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    CLIError,
    check_file,
    err_console,
    fail,
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
    PRECISION_OPT,
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
from sdcscope.cli.resume import (
    distributed_resume_job,
    is_distributed,
    nothing_to_train,
    print_resume_point,
    resume_policy,
    resume_run,
    resume_steps,
)
from sdcscope.common.exitcodes import ExitCode


@app.command()
def train(
    ctx: typer.Context,
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    out: Optional[Path] = path_option(None, "--out", "-o", help="New run directory."),
    resume: Optional[Path] = path_option(
        None,
        "--resume",
        help="Continue the run in this directory as its config.json records it (steps target, faults, guard, "
        "checkpoint policy); a larger --steps extends it.",
    ),
    corpus: Optional[Path] = CORPUS_OPT,
    batch_size: Optional[int] = BATCH_SIZE_OPT,
    lr: Optional[float] = LR_OPT,
    grad_accum: int = GRAD_ACCUM_OPT,
    compile: bool = COMPILE_OPT,
    precision: str = PRECISION_OPT,
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
        "workload's plan (gpt): fsdp (FSDP2), tp (tensor parallel), fsdp+tp (2-D, TP degree 2), hsdp (2-D: "
        "replicas of 2-rank FSDP2 groups), pp (one pipeline stage per rank) or fsdp+pp (2-D: pipeline stages, "
        "each sharded over 2 ranks); (moe): ep (experts sharded over the ranks, tokens moved by all-to-all) or "
        "fsdp+ep (2-D, EP degree 2, FSDP2 for the rest). A topology the model does not fit is refused before "
        "any rank starts.",
    ),
    schedule: str = typer.Option(
        "1f1b",
        "--schedule",
        help="With --parallel pp or fsdp+pp: the pipeline schedule, gpipe or 1f1b, over the step's "
        "--grad-accum micro-batches.",
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
        100,
        "--checkpoint-every",
        help="Save a checkpoint every N steps (0: only at the end), to resume after a kill; a resume keeps the "
        "run's recorded policy unless given.",
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

        pcfg = Topology(kind=parallel, schedule=schedule)
        if nproc == 1 and pcfg.sharded and not (resume is not None and is_distributed(resume)):
            raise CLIError(f"--parallel {parallel} splits the model over ranks: give --nproc N (N >= 2)")
    distributed_resume = resume is not None and is_distributed(resume)
    if nproc != 1 or distributed_resume:
        with user_errors():
            from sdcscope.engine.dist import DistConfig
            from sdcscope.engine.run import Interrupted
            from sdcscope.jobs import launch

            if prometheus_port is not None and not distributed_resume:  # a resume serves as recorded
                _check_rank_ports(prometheus_port, nproc, pcfg.world_kind)
            if distributed_resume:
                job = distributed_resume_job(ctx, resume, out, steps, DistConfig(timeout_s=timeout))
                if job is None:  # the run is complete: nothing to launch
                    return
                out, specs, guarded, steps = resume, job.specs, job.guard is not None, job.steps
            else:
                if resume is not None:
                    raise CLIError(
                        f"--resume {str(resume)!r} with --nproc {nproc}: the run was trained in one process "
                        "(its config.json records no world_size) and resumes in one: drop --nproc, or start "
                        "a new run with --out"
                    )
                if out is None:
                    raise CLIError("--out DIR is required")
                if invariants is not None:
                    raise CLIError("--invariants is not supported in a distributed run yet; drop it or use --nproc 1")
                if compile:
                    raise CLIError("--compile trains in one process for now; drop it or use --nproc 1")
                for flag, path in (("--faults", faults), ("--guard-config", guard_config_path)):
                    if path is not None:
                        check_file(flag, path)
                from sdcscope.faults import load_specs
                from sdcscope.jobs import make_job

                gcfg = with_prometheus(guard_config(guard, guard_config_path, resolve=False), prometheus_port)
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
                    precision=precision,
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
                guarded = gcfg is not None
            try:
                rc = launch(job)  # validates first: ValueError → exit 2, nothing created
            except Interrupted as stop:  # every rank stopped (or was killed); summary.json written
                err_console.print(
                    f"interrupted at step {stop.summary['steps']} of {steps}: checkpoint and summary saved; "
                    f"continue with: sdcscope train --resume {out}",
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
            run, specs, gcfg = resume_run(ctx, resume, faults, guard, guard_config_path, invariants, eval_every)
            gcfg = with_prometheus(gcfg, prometheus_port)
            run.checkpoints, policy_note = resume_policy(ctx, run.checkpoints)
            steps, steps_note = resume_steps(ctx, resume, run.config, steps, run.trainer.step)
            print_resume_point(run, steps, steps_note, policy_note)
            if run.reached(steps):
                nothing_to_train(ctx, resume, steps, run.summary)
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
                precision=precision,
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
            f"continue with: sdcscope train --resume {run.out}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=128 + stop.signum) from None
    print_summary(run.out, summary)
    if tools.injector is not None:
        out_console.print(f"faults: {tools.fired} fired in this session ({run.out / 'injections.jsonl'})")
        note(faults_fired=tools.fired)
    if tools.guard is not None:
        from sdcscope.guard.coverage import measured_catch

        out_console.print(f"guard: {len(tools.guard.events)} event(s) in {run.out / 'events.jsonl'}")
        if tools.guard.abft is not None:
            out_console.print(f"guard: {tools.guard.abft.coverage()}")
        # compiled, every profile's ABFT checks every Linear every step: what full measured
        measured = measured_catch("full" if run.trainer.config.compile else tools.guard.config.profile)
        if measured is not None:
            out_console.print(f"guard: {measured}", highlight=False, soft_wrap=True)
        note(guard_events=len(tools.guard.events))
    _exit_for(summary)


def _check_rank_ports(port: int, nproc: int, kind: str) -> None:
    """``--prometheus-port`` in a distributed run: rank r serves on ``port + r``, which must exist;
    a sharded run computes no per-step metrics to serve (refused, saying why)."""
    from sdcscope.common.world import unsupported

    if (why := unsupported("guard.metrics", kind)) is not None:
        raise CLIError(f"--prometheus-port serves the guard's per-step metrics, which a {kind} run has not: {why}")
    if port and port + nproc - 1 > 65535:
        raise CLIError(
            f"--prometheus-port {port}: rank r serves on {port} + r, and {port + nproc - 1} (rank {nproc - 1}) is "
            "above 65535; give a lower port, or 0 (each rank any free port)"
        )


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
