"""The ``--guard`` / ``--guard-config`` options shared by train, inject and demo."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.common import check_file, path_option

GUARD_OPT = typer.Option(False, "--guard", help="Watch the run with the Guard (detect, localize, repair).")
GUARD_CONFIG_OPT = path_option(None, "--guard-config", help="YAML guard settings (implies --guard).")
INVARIANTS_OPT = path_option(None, "--invariants", help="Invariants file checked online by the guard (implies --guard).")


def guard_config(guard: bool, path: Optional[Path], invariants: Optional[Path] = None, recorded=None):
    """The GuardConfig asked for on the command line, else ``recorded`` (a resumed run's, which
    ``--guard`` alone keeps and ``--invariants`` extends), or None (raises on a bad file). Its file
    paths are made absolute (relative ones are to the working directory), so the run resumes from
    anywhere."""
    if not guard and path is None and invariants is None:
        return recorded
    from sdcscope.guard import GuardConfig

    config = GuardConfig.load(check_file("--guard-config", path)) if path is not None else recorded or GuardConfig()
    if invariants is not None:
        config.invariants = str(check_file("--invariants", invariants))
    if config.invariants is not None:
        config.invariants = str(Path(config.invariants).resolve())
    if config.metrics is not None and config.metrics.path is not None:
        config.metrics.path = str(Path(config.metrics.path).resolve())
    return config
