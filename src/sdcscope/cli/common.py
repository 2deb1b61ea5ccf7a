"""Shared CLI pieces: error reporting (one line, exit code 2) and a rich progress bar."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

err_console = Console(stderr=True)
out_console = Console()


class CLIError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


def fail(message: str) -> typer.Exit:
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


def _path(value: str | Path) -> Path:
    """Parser of every path option and argument: Typer reads an empty value (``--out ""``, a
    variable that is not set) as ``.``, the current directory, where a run would then be written;
    it is refused while the command line is parsed, before any work, naming the option."""
    if isinstance(value, str) and not value.strip():
        raise typer.BadParameter(f"{value!r} is not a path (give '.' to mean the current directory)")
    return Path(value)


def path_option(default: Any, *flags: str, **kw: Any) -> Any:
    """``typer.Option`` for a :class:`~pathlib.Path` that refuses an empty value (:func:`_path`)."""
    return typer.Option(default, *flags, parser=_path, metavar="<path>", **kw)


def path_argument(default: Any, **kw: Any) -> Any:
    """``typer.Argument`` for a :class:`~pathlib.Path` that refuses an empty value (:func:`_path`)."""
    return typer.Argument(default, parser=_path, **kw)


def check_file(flag: str, path: Path) -> Path:
    """``path`` if it is a file; else a FileNotFoundError naming ``flag`` and what is there instead."""
    if path.is_dir():
        raise FileNotFoundError(f"{flag} {str(path)!r} is a folder; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    return path


_ABSENT = object()


def _short(value: Any, limit: int = 40) -> str:
    """``value`` as JSON on one line, cut to ``limit`` characters."""
    text = "(absent)" if value is _ABSENT else json.dumps(value, separators=(", ", ": "), default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def first_difference(given: Any, recorded: Any, path: str) -> tuple[str, str, str] | None:
    """The first place where two JSON-like values differ: ``(path into them, given value,
    recorded value)`` with the values short (``faults[0].bits[0]``, ``30``, ``29``); a key or list
    item one side lacks is ``(absent)``. None when they are equal."""
    if isinstance(given, dict) and isinstance(recorded, dict):
        for key in [*recorded, *(k for k in given if k not in recorded)]:
            got = first_difference(given.get(key, _ABSENT), recorded.get(key, _ABSENT), f"{path}.{key}")
            if got is not None:
                return got
        return None
    if isinstance(given, list) and isinstance(recorded, list):
        for i in range(max(len(given), len(recorded))):
            got = first_difference(
                given[i] if i < len(given) else _ABSENT, recorded[i] if i < len(recorded) else _ABSENT, f"{path}[{i}]"
            )
            if got is not None:
                return got
        return None
    if given == recorded:
        return None
    return path, _short(given), _short(recorded)


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
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=total, completed=done, loss="-")

        def advance(metrics: dict) -> None:
            progress.update(task, advance=1, loss=f"{metrics.get('loss', float('nan')):.4f}")

        yield advance


def fmt_loss(value) -> str:
    """A loss for the console: 4 decimals, or as recorded when not a number ("nan", a crash)."""
    return format(value, ".4f") if isinstance(value, float) else str(value)


def print_summary(out: Path, summary: dict) -> None:
    """A finished run's outcome, losses and run directory, on the console."""
    loss = summary["final_train_loss"]
    out_console.print(
        f"[bold]{summary['outcome']}[/] after {summary['steps']} steps: "
        + ("no step trained" if loss is None else f"train loss {fmt_loss(loss)}")
        + f", val loss {fmt_loss(summary['final_val_loss'])}"
        + (f", val acc {summary['final_val_acc']:.3f}" if "final_val_acc" in summary else "")
    )
    out_console.print(f"run directory: {out}  (config.json, metrics.jsonl, summary.json, checkpoint/)")
