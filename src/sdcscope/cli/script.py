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
