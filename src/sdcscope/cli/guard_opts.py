"""The ``--guard`` / ``--guard-config`` options shared by train, inject and demo."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

GUARD_OPT = typer.Option(False, "--guard", help="Watch the run with the Guard (detect, localize, repair).")
GUARD_CONFIG_OPT = typer.Option(None, "--guard-config", help="YAML guard settings (implies --guard).")
INVARIANTS_OPT = typer.Option(None, "--invariants", help="Invariants file checked online by the guard (implies --guard).")


def guard_config(guard: bool, path: Optional[Path], invariants: Optional[Path] = None):
    """The GuardConfig asked for on the command line, or None (raises on a bad file)."""
    if not guard and path is None and invariants is None:
        return None
    from sdcscope.guard import GuardConfig

    config = GuardConfig.load(path) if path is not None else GuardConfig()
    if invariants is not None:
        if not invariants.is_file():
            raise FileNotFoundError(f"--invariants {str(invariants)!r} does not exist")
        config.invariants = str(invariants)
    return config
