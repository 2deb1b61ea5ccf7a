"""Shared CLI pieces: error reporting (one line, exit code 2) and a rich progress bar."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console

err_console = Console(stderr=True)
out_console = Console()


class CLIError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


def fail(message: str) -> "typer.Exit":
    err_console.print("[bold red]error:[/] ", end="", highlight=False)
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)  # "[out, in]" is text
    return typer.Exit(code=2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn validation errors (ValueError, TypeError) and OS errors (a path that cannot be read or
    created: the message names it) into one line and exit code 2."""
    try:
        yield
    except (ValueError, TypeError, OSError, CLIError) as exc:
        raise fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def check_file(flag: str, path: Path) -> Path:
    """``path`` if it is a file; else a FileNotFoundError naming ``flag`` and what is there instead."""
    if path.is_dir():
        raise FileNotFoundError(f"{flag} {str(path)!r} is a folder; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    return path


def load_fault_file(flag: str, path: Path) -> list:
    """The fault specs in the YAML/JSON file ``path`` (at least one; raises on a bad file)."""
    from sdcscope.faults import load_specs

    specs = load_specs(check_file(flag, path))
    if not specs:
        raise ValueError(f"{flag} {str(path)!r} holds no fault specs")
    return specs


@contextlib.contextmanager
def step_progress(total: int, done: int = 0, label: str = "training") -> Iterator:
    """A progress bar over optimizer steps; yields ``advance(metrics)``. Quiet when not a TTY."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not sys.stderr.isatty() or total - done < 50:
        yield lambda metrics: None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(label, total=total, completed=done, loss="-")

        def advance(metrics: dict) -> None:
            progress.update(task, advance=1, loss=f"{metrics.get('loss', float('nan')):.4f}")

        yield advance


def fmt_loss(value) -> str:
    """A loss for the console: 4 decimals, or as recorded when not a number ("nan", a crash)."""
    return format(value, ".4f") if isinstance(value, float) else str(value)
