"""``sdcscope fleet``: the device history across jobs, its repeat offenders, and their exports.

sdcscope fleet record runs/r1                     # a finished run's ledger into the history
sdcscope fleet list                               # every device: convictions, strikes, screens
sdcscope fleet export --format slurm              # node1,node7 for sbatch --exclude=
sdcscope fleet export --format nvrx --out DIR     # DIR/segment_health_check.<job>.state
sdcscope fleet export --format k8s --node node7   # the status patch for kubectl patch node

The history is ``--history DIR``, else ``$SDCSCOPE_FLEET``, else ``~/.sdcscope/fleet``
(:mod:`sdcscope.localize.history`); the exports are :mod:`sdcscope.localize.exports`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import CLIError, err_console, out_console, path_argument, path_option, user_errors

fleet_app = typer.Typer(
    help="The device history across jobs: record runs, list devices, export repeat offenders.",
    no_args_is_help=True,
)
app.add_typer(fleet_app, name="fleet")

FORMATS = ("slurm", "nvrx", "k8s")
HISTORY_OPT = path_option(
    None, "--history", help="History directory (default $SDCSCOPE_FLEET, else ~/.sdcscope/fleet)."
)
RULE_OPT = path_option(None, "--rule", help="YAML/JSON repeat-offender rule (convictions, window_days, ...).")
CONVICTIONS_OPT = typer.Option(None, "--convictions", help="Convictions in distinct runs that make a repeat offender.")
WINDOW_OPT = typer.Option(None, "--window-days", help="Days a conviction is remembered for.")
INJECTED_OPT = typer.Option(
    False, "--count-injected", help="Count findings of runs and screens that injected faults (a drill)."
)
SKIP_BAD_OPT = typer.Option(False, "--skip-bad", help="Skip bad history records (each one named) instead of failing.")


def _rule(path: Optional[Path], convictions: Optional[int], window_days: Optional[float], injected: bool):
    import dataclasses

    from sdcscope.localize.history import RepeatRule

    rule = RepeatRule.load(path) if path is not None else RepeatRule()
    changes = {k: v for k, v in (("convictions", convictions), ("window_days", window_days)) if v is not None}
    if injected:
        changes["count_injected"] = True
    return dataclasses.replace(rule, **changes)  # validated again


def _statuses(history: Optional[Path], rule, skip_bad: bool):
    from sdcscope.localize.history import History, statuses

    book = History(history)
    found, problems = statuses(book, rule, strict=not skip_bad)
    for p in problems:
        err_console.print(f"skipped a bad record: {p}", markup=False, highlight=False, soft_wrap=True)
    return book, found


@fleet_app.command()
def record(
    run_dirs: list[Path] = path_argument(..., help="Finished run directories (their ledger.json)."),
    history: Optional[Path] = HISTORY_OPT,
    ledger: Optional[Path] = path_option(
        None, "--ledger", help="The runs' ledger when it is not RUN_DIR/ledger.json (a ledger shared across jobs)."
    ),
    run_id: Optional[str] = typer.Option(
        None, "--run-id", help="The run's id in the history (default: derived from it)."
    ),
) -> None:
    """Record finished runs' convictions, strikes and screens in the history (a run recorded
    twice adds nothing)."""
    with user_errors():
        from sdcscope.localize.history import History, record_run

        if run_id is not None and len(run_dirs) > 1:
            raise CLIError("--run-id names one run: give one RUN_DIR with it")
        book = History(history)
        for run_dir in run_dirs:
            written, found, run = record_run(book, run_dir, ledger=ledger, run=run_id)
            out_console.print(
                f"{run_dir}: run {run}: {written} new of {found} record(s) -> {book.root}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


@fleet_app.command("list")
def list_devices(
    history: Optional[Path] = HISTORY_OPT,
    offenders_only: bool = typer.Option(False, "--offenders", help="Only the repeat offenders."),
    rule_file: Optional[Path] = RULE_OPT,
    convictions: Optional[int] = CONVICTIONS_OPT,
    window_days: Optional[float] = WINDOW_OPT,
    count_injected: bool = INJECTED_OPT,
    skip_bad: bool = SKIP_BAD_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the devices as JSON."),
) -> None:
    """Every device of the history: counted convictions (and the runs), strikes, screens passed
    and failed, when last seen, and whether the rule makes it a repeat offender."""
    with user_errors():
        rule = _rule(rule_file, convictions, window_days, count_injected)
        book, found = _statuses(history, rule, skip_bad)
    shown = [s for s in found if s.offender or not offenders_only]
    if as_json:
        rows = [
            {
                "host": s.host,
                "device": s.device,
                "identity": s.identity,
                "offender": s.offender,
                "since": s.since,
                "reason": s.reason,
                "convictions": len(s.convictions),
                "runs": s.runs,
                "strikes": s.strikes,
                "screens": s.screens,
                "last_seen": s.last_seen,
                "injected_uncounted": s.injected,
            }
            for s in shown
        ]
        out_console.print_json(json.dumps(rows))
        return
    for s in shown:
        mark = "REPEAT OFFENDER" if s.offender else "-"
        out_console.print(
            f"{s.host:20} {s.device:8} convictions {len(s.convictions)} (runs {len(s.runs)}), strikes {s.strikes}, "
            f"screens pass {s.screens['pass']} fail {s.screens['fail']}, last seen {s.last_seen}"
            + (f", {s.injected} injected-fault finding(s) not counted" if s.injected else "")
            + f"  {mark}"
            + (f": {s.reason}" if s.offender else ""),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    offenders = sum(s.offender for s in found)
    out_console.print(f"{len(found)} device(s), {offenders} repeat offender(s) in {book.root}", highlight=False)


def _tasks(pairs: list[str]) -> dict[str, list[tuple[str, int]]]:
    """``--array-task NODE=TASK[:RESTARTS]`` values as NVRx's per-node array tasks."""
    found: dict[str, list[tuple[str, int]]] = {}
    for pair in pairs:
        node, _, task = pair.partition("=")
        task_id, _, restarts = task.partition(":")
        if not node or not task_id.isdigit() or (restarts and not restarts.isdigit()):
            raise CLIError(f"--array-task {pair!r} must be NODE=TASK_ID[:RESTART_COUNT] (e.g. node7=3:0)")
        found.setdefault(node, []).append((task_id, int(restarts or 0)))
    return found


@fleet_app.command()
def export(
    fmt: str = typer.Option(..., "--format", "-f", help="slurm, nvrx or k8s."),
    out: Optional[Path] = path_option(
        None, "--out", "-o", help="File to write (nvrx: a folder takes NVRx's file name); default: stdout."
    ),
    history: Optional[Path] = HISTORY_OPT,
    short: bool = typer.Option(False, "--short", help="Node names without their domain (node7.cluster -> node7)."),
    job_id: Optional[str] = typer.Option(
        None, "--job-id", help="nvrx: the Slurm job id (default $SLURM_ARRAY_JOB_ID or $SLURM_JOB_ID)."
    ),
    ttl: float = typer.Option(1800.0, "--ttl", help="nvrx: seconds the exclusion stays valid."),
    array_task: Optional[list[str]] = typer.Option(
        None, "--array-task", help="nvrx: NODE=TASK_ID[:RESTART_COUNT], an array task running on NODE (repeat it)."
    ),
    condition: str = typer.Option("SDCSuspect", "--condition-type", help="k8s: the node condition's type."),
    node: Optional[str] = typer.Option(None, "--node", help="k8s: print only this node's patch (for kubectl -p)."),
    rule_file: Optional[Path] = RULE_OPT,
    convictions: Optional[int] = CONVICTIONS_OPT,
    window_days: Optional[float] = WINDOW_OPT,
    count_injected: bool = INJECTED_OPT,
    skip_bad: bool = SKIP_BAD_OPT,
) -> None:
    """Export the repeat offenders for a fleet tool: a Slurm --exclude host list, NVRx's
    scheduler-exclusion JSONL artefact, or Kubernetes node-condition status patches."""
    with user_errors():
        from sdcscope.common.io import write_text_atomic
        from sdcscope.common.validate import check_choice, check_float
        from sdcscope.localize import exports

        check_choice("--format", fmt, FORMATS)
        rule = _rule(rule_file, convictions, window_days, count_injected)
        tasks = _tasks(array_task or [])
        if fmt == "nvrx":
            job_id = job_id or os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
            if not job_id:
                raise CLIError("--format nvrx needs --job-id (or $SLURM_ARRAY_JOB_ID / $SLURM_JOB_ID)")
            exports.nvrx_file_name(job_id)  # refuses a bad id before any work
            check_float("--ttl", ttl, low=0, low_open=True)
        if fmt == "k8s":
            exports.check_condition_type(condition)
        _, found = _statuses(history, rule, skip_bad)
        if fmt == "slurm":
            text = exports.slurm_exclude(found, short=short) + "\n"
        elif fmt == "nvrx":
            text = exports.nvrx_decision(found, job_id=job_id, ttl_seconds=ttl, tasks=tasks, short=short)
            if out is not None and out.is_dir():
                out = out / exports.nvrx_file_name(job_id)
        else:
            patches = exports.k8s_patches(found, condition=condition, short=short)
            if node is not None:
                node = node.lower()  # as the kubelet names nodes
                if node not in patches:
                    known = ", ".join(patches) or "none"
                    raise CLIError(f"--node {node!r} has no record in the history; nodes: {known}")
                text = json.dumps(patches[node], separators=(",", ":")) + "\n"
            else:
                text = "".join(
                    json.dumps({"node": n, "patch": p}, separators=(",", ":")) + "\n" for n, p in patches.items()
                )
        if out is None:
            typer.echo(text, nl=False)
        else:
            write_text_atomic(out, text)
            err_console.print(f"wrote {out}", markup=False, highlight=False)
