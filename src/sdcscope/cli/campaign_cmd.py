"""``sdcscope campaign init|run|status``: fault-injection campaigns, resumable.

sdcscope campaign init runs/bits --spec examples/campaigns/gpt_bits.yaml
sdcscope campaign run runs/bits --workers 2      # again after a kill: resumes
sdcscope campaign run runs/bits --slurm --workers 32 --slurm-config slurm.yaml   # a Slurm job array
sdcscope report runs/bits
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    CLIError,
    check_file,
    err_console,
    fail,
    out_console,
    path_argument,
    path_option,
    user_errors,
)
from sdcscope.cli.output import JSON_OPT, json_output, note
from sdcscope.common.exitcodes import ExitCode

campaign_app = typer.Typer(help="Fault-injection campaigns: plan, run and resume, status.", no_args_is_help=True)
app.add_typer(campaign_app, name="campaign")

DIR_ARG = path_argument(..., help="Campaign directory (campaign.yaml, results.sqlite, golden/, report.html).")


@contextlib.contextmanager
def campaign_progress() -> Iterator:
    """A rich progress bar per phase with ETA; quiet when stderr is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update


def _print_counts(summary: dict) -> None:
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(summary["outcomes"].items())) or "none yet"
    ran = f" ({summary['ran']} run now)" if "ran" in summary else ""
    out_console.print(f"{summary['done']}/{summary['trials']} trials done{ran}: {outcomes}")


@campaign_app.command()
def init(
    directory: Path = DIR_ARG,
    spec: Path = path_option(..., "--spec", help="Campaign spec (YAML) to copy in as campaign.yaml."),
) -> None:
    """Validate a campaign spec and create its directory (nothing is written on an error)."""
    with user_errors():
        from sdcscope.study import init_campaign

        cspec, plan = init_campaign(directory, spec)
    out_console.print(
        f"campaign {cspec.name!r}: {len(plan)} trials planned in {directory} "
        f"(spec hash {cspec.hash[:12]}); run it with: sdcscope campaign run {directory}"
    )


@campaign_app.command()
def run(
    directory: Path = DIR_ARG,
    workers: Optional[int] = typer.Option(
        None,
        "--workers",
        "-j",
        help="Worker processes (default: one per CPU core; 0: in this process); with --slurm, array tasks "
        "(default 16).",
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="Run the trials on a Ray cluster (e.g. auto or ray://host:10001)."
    ),
    slurm: bool = typer.Option(
        False, "--slurm", help="Run the workers as a Slurm job array through submitit (pip install 'sdcscope[slurm]')."
    ),
    slurm_config: Optional[Path] = path_option(
        None,
        "--slurm-config",
        help="YAML of the Slurm settings (cluster, folder, parameters: submitit's executor parameters, poll_s, "
        "runner_timeout_s); implies --slurm.",
    ),
) -> None:
    """Run or resume a campaign: golden run, healthy baselines, then every trial not yet in results.sqlite."""
    with user_errors(), campaign_progress() as progress:
        from sdcscope.study import run_campaign
        from sdcscope.study.runner import CampaignBusyError
        from sdcscope.study.slurm import TasksEndedError

        try:
            backend = check_file("--slurm-config", slurm_config) if slurm_config is not None else {} if slurm else None
            summary = run_campaign(
                directory, workers=workers, ray_address=ray_address, slurm=backend, progress=progress
            )
        except CampaignBusyError as exc:  # a second runner on the directory: a user error, exit code 2
            raise CLIError(str(exc)) from None
        except TasksEndedError as exc:  # Slurm tasks lost (killed, failed): run again to resume
            raise fail(str(exc), ExitCode.INFRASTRUCTURE) from None
    _print_counts(summary)
    out_console.print(f"results: {directory / 'results.sqlite'}; report: sdcscope report {directory}")


@campaign_app.command()
def status(ctx: typer.Context, directory: Path = DIR_ARG, as_json: bool = JSON_OPT) -> None:
    """How many trials are done, and their outcomes."""
    json_output(ctx, as_json)
    with user_errors():
        from collections import Counter

        from sdcscope.study import DB_FILE, SPEC_FILE, ResultsDB, load_campaign

        if not (directory / DB_FILE).is_file():
            raise FileNotFoundError(f"{str(directory)!r} holds no {DB_FILE}: not a campaign directory")
        spec = load_campaign(directory / SPEC_FILE)
        with ResultsDB(directory / DB_FILE, spec) as db:
            rows = db.trials()
            planned = db.plan_size
            if planned is None or db.extended:  # campaign.yaml was edited: count the new plan
                from sdcscope.study.runner import count_plan

                planned = count_plan(spec, db)
    counts = {"trials": planned, "done": len(rows), "outcomes": dict(Counter(r["outcome"] for r in rows))}
    _print_counts(counts)
    note(**counts, directory=str(directory))
