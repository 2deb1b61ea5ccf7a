"""``sdcscope guard -- python train.py ARGS``: a user's training script, unchanged, under the guard.

    sdcscope guard --out runs/g -- python train.py ARGS
    sdcscope guard --guard-config examples/guard.yaml --out runs/g -- torchrun --nproc_per_node 2 train.py

What attaching can and cannot do (no replay: a finding vetoes the step) is in docs/guard.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import path_option
from sdcscope.cli.options import GUARD_CONFIG_OPT


@app.command(name="guard")
def guard_script(
    out: Path = path_option(..., "--out", "-o", help="New run directory (events.jsonl, metrics.jsonl, ...)."),
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    command: list[str] = typer.Argument(
        ...,
        metavar="-- python SCRIPT.py ARGS | -- torchrun OPTS SCRIPT.py ARGS",
        help="Your training script, run unchanged with the guard attached to its optimizer and model.",
        show_default=False,
    ),
) -> None:
    """Run your own training script, unchanged, with the guard attached (detect, then veto)."""
    from sdcscope.cli.script import run_attached

    run_attached(command, out, guard_file=guard_config_path, guard=True, spec=None)
