"""The command line that runs a user's own script under one of sdcscope's bootstraps.

``sdcscope invariants trace -- python my_train.py ARGS`` and ``sdcscope guard|inject --
python my_train.py ARGS`` (or ``-- torchrun OPTS my_train.py ARGS``) run the script unchanged in a
subprocess, as ``python -m BOOTSTRAP OPTIONS -- my_train.py ARGS`` (:mod:`sdcscope.common.script`
runs it as ``__main__``). Under torchrun the bootstrap is what each worker runs:
``torchrun OPTS -m BOOTSTRAP OPTIONS -- my_train.py ARGS``, found with torchrun's own parser.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from sdcscope.cli.common import CLIError

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?\Z")
_TORCHRUN = ("torchrun", "torch.distributed.run")


def _torchrun(python: str, launcher_args: list[str], bootstrap: str, options: list[str]) -> list[str]:
    """``torchrun OPTS script ARGS`` with every worker running ``bootstrap`` on the script."""
    from torch.distributed.run import get_args_parser

    try:
        ns = get_args_parser().parse_args(launcher_args)
    except SystemExit:
        raise CLIError(f"torchrun does not accept {' '.join(launcher_args)!r}") from None
    if ns.no_python:
        raise CLIError("torchrun --no-python runs no Python script: nothing to attach to")
    split = len(launcher_args) - len(ns.training_script_args) - 1
    opts, script = launcher_args[:split], [ns.training_script, *ns.training_script_args]
    if ns.module:  # the user's -m stays among the options: our bootstrap is a module too
        script = ["-m", *script]
    else:
        opts = [*opts, "-m"]
    return [python, "-m", "torch.distributed.run", *opts, bootstrap, *options, "--", *script]


def script_command(command: list[str], bootstrap: str, options: list[str], *, launchers: bool = True) -> list[str]:
    """The command line that runs ``command`` -- ``[python] script.py ARGS``, ``python -m module
    ARGS`` or (``launchers``) ``torchrun OPTS script.py ARGS`` / ``python -m torch.distributed.run
    …`` -- with ``python -m bootstrap OPTIONS --`` in front of the script. A bare ``python`` (or
    ``torchrun``) is the interpreter running sdcscope; a path to another one is used as given (it
    needs sdcscope installed)."""
    first, rest = command[0], command[1:]
    python = sys.executable
    if _PYTHON.match(Path(first).name):
        python = sys.executable if Path(first).name == first else first
    elif Path(first).name == "torchrun":
        rest = ["-m", "torch.distributed.run", *rest]
    else:
        rest = command
    if rest[:2] == ["-m", "torch.distributed.run"] or rest[:2] == ["-m", "torchrun"]:
        if not launchers:
            raise CLIError("this command traces one process: run the script with python, not torchrun")
        return _torchrun(python, rest[2:], bootstrap, options)
    if not rest:
        raise CLIError("give the script to run: -- python my_train.py ARGS")
    return [python, "-m", bootstrap, *options, "--", *rest]


ATTACH = "sdcscope.integrations.script"
"""The bootstrap of ``sdcscope guard|inject -- …`` (:mod:`sdcscope.integrations.script`)."""


def run_attached(command: list[str], out: Path, *, guard_file: Path | None, guard: bool, spec: Path | None) -> None:
    """``sdcscope guard|inject … -- COMMAND``: run the user's script (or torchrun job) unchanged in
    a subprocess with the guard (``guard``, settings ``guard_file``) and/or the faults of ``spec``
    attached; its output passes through, its exit code is ours. Bad options are refused first."""
    import subprocess

    from sdcscope.cli.common import check_file, load_fault_file, out_console, user_errors
    from sdcscope.engine.rundir import check_new_run_dir, merge_injection_logs

    with user_errors():
        check_new_run_dir(out)
        options = ["--out", str(out)]
        if guard_file is not None:
            from sdcscope.guard import GuardConfig

            GuardConfig.load(check_file("--guard-config", guard_file))
            options += ["--guard-config", str(guard_file)]
        elif guard:
            options += ["--guard"]
        if spec is not None:
            load_fault_file("--spec", spec)
            options += ["--spec", str(spec)]
        argv = script_command(command, ATTACH, options)
    code = subprocess.call(argv)
    ranks = sorted(out.glob("injections.rank*.jsonl"))
    if ranks:  # a data-parallel job: every rank's log is complete now that the launcher ended
        merge_injection_logs(out, len(ranks))
    configs = sorted([*out.glob("config.json"), *out.glob("rank*/config.json")])
    if not configs and code == 0:
        with user_errors():
            raise CLIError("the script built no optimizer over a module's parameters: nothing was attached")
    for config in configs:
        _print_run(config.parent, out_console)
    if code:
        import typer

        raise typer.Exit(code=code)


def _print_run(run_dir: Path, console) -> None:
    """The run's findings and fired faults, in a few lines."""
    from sdcscope.common.io import read_jsonl

    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else []
    fired = read_jsonl(run_dir / "injections.jsonl") if (run_dir / "injections.jsonl").is_file() else []
    console.print(f"{run_dir}: {len(fired)} fault(s) fired, [bold]{len(events)}[/] guard event(s)")
    for e in events[:5]:
        rank = "" if e.get("rank") is None else f" rank {e['rank']}"
        console.print(
            f"  step {e['step']}{rank}: {e['detector']} {e['verdict']} {e.get('module') or ''} "
            f"{e.get('gemm') or ''} → {e['action']}"
        )
