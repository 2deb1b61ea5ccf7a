"""``sdcscope train --resume DIR``: continue a run as its config.json records it -- its steps target,
checkpoint policy, faults and guard -- in one process or on its ranks, saying which checkpoint it
takes and to which step it trains; options that would change what it trains are refused."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.common import CLIError, err_console, first_difference, load_fault_file, out_console, print_summary
from sdcscope.cli.options import guard_config

KEPT_ON_RESUME = {  # option: (flag, section and key in config.json); a resumed run keeps these
    "workload": ("--workload", "workload", "workload"),
    "preset": ("--preset", "workload", "preset"),
    "corpus": ("--corpus", "workload", "corpus"),
    "batch_size": ("--batch-size", "workload", "batch_size"),
    "lr": ("--lr", "workload", "lr"),
    "seed": ("--seed", "train", "seed"),
    "grad_accum": ("--grad-accum", "train", "grad_accum"),
    "compile": ("--compile", "train", "compile"),
    "precision": ("--precision", "workload", "precision"),
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
):
    """The run in ``resume`` with its recorded faults and guard: ``(run, specs, guard config)``.

    Options that would change what the run trains are refused; the guard (--guard-config,
    --invariants) and --eval-every may change and are recorded in config.json. The steps target
    and the checkpoint policy: :func:`resume_steps`, :func:`resume_policy`."""
    from sdcscope.engine import Run
    from sdcscope.faults import FaultSpec
    from sdcscope.guard import GuardConfig

    run = Run.resume(resume)  # with the checkpoint policy config.json records
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


def resume_steps(ctx: typer.Context, resume: Path, config: dict, steps: int, done: int) -> tuple[int, str]:
    """The steps a resumed run trains to in total, and how that was decided: the target config.json
    records, unless --steps is given (a larger one extends the run, a smaller one ends it sooner;
    either is recorded from here on). ``done``: the steps of the checkpoint it continues from."""
    recorded = config.get("steps")
    if not _given(ctx, "steps"):
        if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < done:
            raise CLIError(
                f"{str(resume / 'config.json')!r} records no steps target the run can train to (steps: "
                f"{recorded!r}, and the checkpoint has {done}); give --steps N (N >= {done})"
            )
        return recorded, "as config.json records"
    if steps < done:
        raise CLIError(f"--steps {steps} is below the {done} steps the run already has")
    if recorded is None or steps == recorded:
        return steps, "as --steps says"
    change = "extends" if steps > recorded else "shortens"
    return steps, f"--steps {steps} {change} the {recorded} steps config.json records"


def resume_policy(ctx: typer.Context, recorded):
    """The periodic checkpoint policy of a resumed run: the one config.json records (``recorded``),
    with --checkpoint-every / --keep-checkpoints where given (they change no training: a given
    one wins, and is recorded from here on); and a note naming what changed (None: nothing)."""
    given = {
        key: ctx.params[name]
        for key, name in (("every", "checkpoint_every"), ("keep", "keep_checkpoints"))
        if _given(ctx, name)
    }
    changed = {k: v for k, v in given.items() if v != getattr(recorded, k)}
    if not changed:
        return recorded, None
    flags = {"every": "--checkpoint-every", "keep": "--keep-checkpoints"}
    note = ", ".join(f"{flags[k]} {v} (the run had {getattr(recorded, k)})" for k, v in changed.items())
    return dataclasses.replace(recorded, **changed), f"checkpoints: {note}"


def nothing_to_train(ctx: typer.Context, resume: Path, steps: int, summary: dict) -> None:
    """A resume whose run already has its steps: say so, keep summary.json, train nothing."""
    if _given(ctx, "steps"):
        out_console.print(f"{resume} already has {steps} steps: nothing to train (summary.json kept)")
    else:
        out_console.print(
            f"{resume} is complete: {steps} steps, as its config.json records; nothing to train (summary.json "
            f"kept). To train it further: sdcscope train --resume {resume} --steps N (N > {steps})"
        )
    print_summary(resume, summary)


def is_distributed(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a distributed run (``--nproc N``: DDP or sharded), resumed on its ranks."""
    from sdcscope.common.io import read_json

    try:
        config = read_json(run_dir / "config.json")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(config, dict) and config.get("world_size", 1) != 1


RECORDED_ON_DISTRIBUTED_RESUME = {
    "faults": "--faults",
    "guard": "--guard",
    "guard_config_path": "--guard-config",
    "invariants": "--invariants",
    "eval_every": "--eval-every",
    "prometheus_port": "--prometheus-port",
}


def distributed_resume_job(ctx: typer.Context, resume: Path, out, steps: int, dist_config):
    """The job that continues the distributed run in ``resume`` (None: it is complete, nothing to
    launch); says which checkpoint it takes, which newer ones it passes over, and to which step it
    trains (as a single-process resume does)."""
    from sdcscope.common.io import read_json
    from sdcscope.engine.rundir import CheckpointPolicy
    from sdcscope.engine.state import MANIFEST_FILE
    from sdcscope.jobs.torchrun import resume_job

    if out is not None:
        raise CLIError("give either --out (a new run) or --resume (an existing run), not both")
    given = [flag for name, flag in RECORDED_ON_DISTRIBUTED_RESUME.items() if _given(ctx, name)]
    if given:
        raise CLIError(
            f"--resume {str(resume)!r} continues a distributed run with the faults and guard its config.json "
            f"records; drop {', '.join(given)}"
        )
    config = read_json(resume / "config.json")
    check_kept_options(ctx, resume, config)
    try:
        recorded = CheckpointPolicy.recorded(config) or CheckpointPolicy()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{str(resume / 'config.json')!r}: {exc}") from None
    policy, policy_note = resume_policy(ctx, recorded)
    job, chosen, skipped = resume_job(
        resume,
        steps if _given(ctx, "steps") else None,
        nproc=ctx.params["nproc"] if _given(ctx, "nproc") else None,
        parallel=ctx.params["parallel"] if _given(ctx, "parallel") else None,
        dist_config=dist_config,
        checkpoints=policy,
    )
    done = read_json(chosen / MANIFEST_FILE)["step"]
    target, steps_note = resume_steps(ctx, resume, config, job.steps, done)
    for path, why in skipped:
        err_console.print(f"skipped checkpoint {path}: {why}", markup=False, highlight=False, soft_wrap=True)
    summary = read_json(resume / "summary.json") if (resume / "summary.json").is_file() else {}
    if done == target and summary.get("steps") == target:
        nothing_to_train(ctx, resume, target, summary)
        return None
    err_console.print(
        f"resuming from {chosen} (step {done}) on {job.nproc} ranks (--parallel {job.parallel.kind}) to step "
        f"{target}, {steps_note}" + (f"; {policy_note}" if policy_note else ""),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return job


def print_resume_point(run, steps: int, steps_note: str, policy_note: str | None) -> None:
    """Which checkpoint a resume continues from (and the newer ones it passed over and why), and
    to which step it trains."""
    for path, why in run.skipped_checkpoints:
        err_console.print(f"skipped checkpoint {path}: {why}", markup=False, highlight=False, soft_wrap=True)
    err_console.print(
        f"resuming from {run.resumed_from} (step {run.trainer.step}) to step {steps}, {steps_note}"
        + (f"; {policy_note}" if policy_note else ""),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
