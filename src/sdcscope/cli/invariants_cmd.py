"""``sdcscope invariants trace|infer|check``: learn invariants from clean runs, check others.

    sdcscope invariants trace --workload gpt --steps 200 --seed 1 --out runs/ref1
    sdcscope invariants trace --out runs/mine1 -- python my_train.py ARGS     # your own script
    sdcscope invariants infer runs/ref1 runs/ref2 --out inv.yaml
    sdcscope invariants trace --seed 0 --out runs/new --invariants inv.yaml   # online check
    sdcscope invariants check --invariants inv.yaml runs/new                   # offline check

``check`` exits with 1 when it finds violations, 2 on a usage error, 0 otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    CLIError,
    out_console,
    path_argument,
    path_option,
    print_summary,
    step_progress,
    user_errors,
)
from sdcscope.cli.options import (
    BATCH_SIZE_OPT,
    EVAL_EVERY_OPT,
    GRAD_ACCUM_OPT,
    LR_OPT,
    PRESET_OPT,
    SEED_OPT,
    STEPS_OPT,
    WORKLOAD_OPT,
    build_configs,
    check_steps,
)
from sdcscope.cli.script import script_command
from sdcscope.common.io import file_in_the_way

invariants_app = typer.Typer(
    help="Infer training invariants from clean runs and check runs against them.",
    no_args_is_help=True,
)
app.add_typer(invariants_app, name="invariants")

INVARIANTS_OPT = path_option(..., "--invariants", "-i", help="Invariants YAML file.")


@invariants_app.command()
def trace(
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    out: Path = path_option(..., "--out", "-o", help="New run directory (gets trace.jsonl)."),
    lr: Optional[float] = LR_OPT,
    batch_size: Optional[int] = BATCH_SIZE_OPT,
    grad_accum: int = GRAD_ACCUM_OPT,
    eval_every: int = EVAL_EVERY_OPT,
    invariants: Optional[Path] = path_option(
        None, "--invariants", "-i", help="Also check these invariants online (events.jsonl)."
    ),
    command: Optional[list[str]] = typer.Argument(
        None,
        metavar="[-- python SCRIPT.py ARGS]",
        help="Trace your own training script instead of a workload (the workload options are ignored).",
        show_default=False,
    ),
) -> None:
    """Train a reference workload with the trace recorder attached (and optionally a checker),
    or trace your own script: ``sdcscope invariants trace --out DIR -- python my_train.py ARGS``."""
    if command:
        _trace_script(command, out, invariants)
        return
    with user_errors():
        check_steps(steps)
        from sdcscope.engine import Run
        from sdcscope.invariants import InvariantChecker, TraceRecorder

        wcfg, tcfg = build_configs(
            workload, preset, seed, batch_size=batch_size, lr=lr, grad_accum=grad_accum, eval_every=eval_every
        )
        run = Run(out, wcfg, tcfg)
        model, optimizer = run.trainer.model, run.trainer.optimizer
        checker = None if invariants is None else InvariantChecker(model, optimizer, invariants, run_dir=out)
        recorder = TraceRecorder(model, optimizer, out=out)
    tools = [recorder.attach()] + ([checker.attach()] if checker else [])
    try:
        with step_progress(steps) as advance:
            summary = run.train(steps, callbacks=tools, on_step=advance)
    finally:
        for tool in tools:
            tool.detach()
    print_summary(run.out, summary)
    out_console.print(f"trace: {out / 'trace.jsonl'}")
    if checker is not None:
        n = len(checker.violations)
        out_console.print(
            f"[bold]{n}[/] invariant violation(s) reported to {out / 'events.jsonl'}"
            if n
            else "no invariant violations"
        )


def _trace_script(command: list[str], out: Path, invariants: Optional[Path]) -> None:
    """Run a user's training script in a subprocess with the tracer installed (see
    ``sdcscope.invariants.script``); its output passes through, its exit code is ours."""
    import subprocess

    from sdcscope.invariants import TRACE_FILE
    from sdcscope.invariants.script import NO_OPTIMIZER

    with user_errors():
        if invariants is not None:
            raise CLIError(
                "--invariants does not apply to a script: trace it, then "
                "`sdcscope invariants check --invariants FILE RUN_DIR`"
            )
        argv = script_command(command, "sdcscope.invariants.script", ["--out", str(out)], launchers=False)
        if (out / TRACE_FILE).exists():
            raise CLIError(f"{str(out / TRACE_FILE)!r} already exists; give a new run directory")
    code = subprocess.call(argv)
    if code == NO_OPTIMIZER and not (out / TRACE_FILE).exists():
        with user_errors():
            raise CLIError("the script built no optimizer over a module's parameters: nothing was traced")
    if (out / TRACE_FILE).exists():
        out_console.print(f"trace: {out / TRACE_FILE}")
    if code:
        raise typer.Exit(code=code)


def _check_out_file(path: Path, force: bool) -> None:
    """Refuse, before any inference, an --out that is a folder, that already exists (without
    --force), or whose folder cannot be created or written."""
    if path.is_dir():
        raise CLIError(f"--out {str(path)!r} is a folder; give a file")
    if path.exists() and not force:
        raise CLIError(f"--out {str(path)!r} already exists; give a new file, or --force to overwrite it")
    from sdcscope.engine.rundir import check_writable

    blocker = file_in_the_way(path)
    if blocker is not None:
        raise CLIError(f"--out {str(path)!r} cannot be created: {str(blocker)!r} is a file, not a folder")
    check_writable(path)


@invariants_app.command()
def infer(
    runs: list[Path] = path_argument(..., help="Clean run directories holding trace.jsonl."),
    out: Path = path_option(..., "--out", "-o", help="Invariants YAML file to write (a new file unless --force)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --out file."),
    margin: float = typer.Option(10.0, "--margin", help="Widening factor of learned numeric bounds."),
    min_support: int = typer.Option(3, "--min-support", help="Observations an invariant needs."),
    relation: Optional[list[str]] = typer.Option(None, "--relation", "-r", help="Only this relation (repeatable)."),
) -> None:
    """Infer the invariants that hold in every given clean run."""
    with user_errors():
        from sdcscope.invariants import InferConfig, infer_invariants, save_invariants

        config = InferConfig(margin=margin, min_support=min_support, relations=tuple(relation or ()))
        _check_out_file(out, force)
        invariants = infer_invariants(runs, config)
        if not invariants:
            raise CLIError("no invariant holds in all of these runs (are they runs of the same model?)")
        save_invariants(invariants, out, [str(r) for r in runs])
    from collections import Counter

    from rich.table import Table

    table = Table("relation", "invariants", title=f"{len(invariants)} invariants from {len(runs)} run(s)")
    for name, n in sorted(Counter(i.relation for i in invariants).items()):
        table.add_row(name, str(n))
    out_console.print(table)
    out_console.print(f"wrote {out}")


def _evidence(ev: dict) -> str:
    """The gist of a violation's evidence in one short line (the full record is in events.jsonl)."""
    from rich.markup import escape

    from sdcscope.invariants.summary import summarize

    return escape(summarize(ev))


@invariants_app.command()
def check(
    run_dir: Path = path_argument(..., help="Run directory holding trace.jsonl."),
    invariants: Path = INVARIANTS_OPT,
    events: bool = typer.Option(
        True, "--events/--no-events", help="Write violations to RUN_DIR/events.jsonl (first per invariant and tensor)."
    ),
) -> None:
    """Check a recorded trace offline; exit code 1 when any invariant is violated."""
    with user_errors():
        from sdcscope.engine import JsonlWriter, read_jsonl
        from sdcscope.invariants import EVENTS_FILE, check_trace, load_invariants, load_trace

        trace_data = load_trace(run_dir)
        invs = load_invariants(invariants)
        found = check_trace(trace_data, invs)
    from rich.table import Table

    groups: dict[tuple[str, str], list[dict]] = {}
    for e in found:
        groups.setdefault((e["verdict"], e["module"]), []).append(e)
    if events:
        path = Path(run_dir) / EVENTS_FILE
        kept = [e for e in read_jsonl(path) if e.get("detector") != "invariant"]
        path.write_text("")
        writer = JsonlWriter(path)
        for e in kept + [g[0] for g in groups.values()]:
            writer.write(e)
        writer.close()
    n_records = len(trace_data.records)
    if not found:
        out_console.print(f"no violations of {len(invs)} invariants in {n_records} records of {run_dir}")
        return
    table = Table(title=f"invariant violations in {run_dir}", expand=True)
    table.add_column("invariant", no_wrap=True)
    table.add_column("tensor / module", overflow="fold")
    table.add_column("first step", justify="right")
    table.add_column("steps", justify="right")
    table.add_column("evidence (first)", overflow="fold")
    for (verdict, module), group in sorted(groups.items(), key=lambda kv: kv[1][0]["step"]):
        table.add_row(verdict, str(module), str(group[0]["step"]), str(len(group)), _evidence(group[0]["evidence"]))
    out_console.print(table)
    out_console.print(
        f"{len(groups)} violation(s) of {len({v for v, _ in groups})} of {len(invs)} invariants in {n_records} records"
    )
    raise typer.Exit(code=1)
