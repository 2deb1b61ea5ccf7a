"""Shared CLI pieces: error reporting (one line, a documented exit code:
:class:`~sdcscope.common.exitcodes.ExitCode`) and progress (a rich bar on a terminal, plain
periodic lines otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from sdcscope.common.exitcodes import ExitCode
from sdcscope.common.storage import StorageError, storage_cause

err_console = Console(stderr=True)
out_console = Console()


class CLIError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


ERROR_CHARS = 2000
"""The longest error line the CLI prints; the rest is cut (values in messages are already short:
:func:`sdcscope.common.validate.brief`)."""


def fail(message: str, code: int = ExitCode.USER_ERROR) -> typer.Exit:
    if len(message) > ERROR_CHARS:
        message = f"{message[:ERROR_CHARS]}... ({len(message) - ERROR_CHARS:,} more characters cut)"
    err_console.print("[bold red]error:[/] ", end="", highlight=False)
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)  # "[out, in]" is text
    return typer.Exit(code=int(code))


def storage_message(exc: BaseException, cause: OSError) -> str:
    """One line for a write the storage refused: the path and what was being written where known."""
    if isinstance(cause, StorageError):
        return str(cause)
    where = cause.filename if isinstance(cause.filename, str) else getattr(exc, "filename", None)
    text = f"cannot write {where!r}: " if where else "a write failed: "
    return text + f"{cause.strerror or cause} (disk full, read-only or no permission)"


@contextlib.contextmanager
def storage_errors() -> Iterator[None]:
    """Turn a write the storage refused -- from any layer: torch, sqlite, a worker process --
    into one line and :data:`ExitCode.STORAGE`; anything else passes unchanged."""
    try:
        yield
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception as exc:
        cause = storage_cause(exc)
        if cause is None:
            raise
        raise fail(storage_message(exc, cause), ExitCode.STORAGE) from None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn validation errors (ValueError, TypeError) and OS errors (a path that cannot be read or
    created: the message names it) into one line and exit code 2; a write the storage refused
    into one line and :data:`ExitCode.STORAGE` (:func:`storage_errors`)."""
    try:
        with storage_errors():
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


PROGRESS_SECONDS_ENV = "SDCSCOPE_PROGRESS_SECONDS"
"""Seconds between plain progress lines when stderr is not a terminal (default 30)."""


def position(metrics: dict, before: int) -> int:
    """The optimizer steps a run has after the step ``metrics`` describes (``before``: it had
    before): a rollback goes back to its snapshot's step (``rolled_back_to``), so a progress count
    that only went up would overshoot the target."""
    back = metrics.get("rolled_back_to")
    if isinstance(back, int):
        return back
    step = metrics.get("step")
    return step + 1 if isinstance(step, int) else before + 1


def _plain_progress(total: int, done: int, label: str, events: Callable[[], int] | None) -> Callable[[dict], None]:
    """``advance(metrics)`` printing one plain line every few seconds (and at the last step): for
    logs of CI, nohup and schedulers, where a bar would print nothing useful. The step shown is
    where the run is (after a rollback: the snapshot's step); the rate counts every step trained,
    the re-run ones too, and the ETA the steps still to go at that rate."""
    try:
        every = float(os.environ.get(PROGRESS_SECONDS_ENV, "30"))
    except ValueError:
        every = 30.0
    start = last = time.monotonic()
    state = {"at": done, "trained": 0}

    def advance(metrics: dict) -> None:
        nonlocal last
        n = state["at"] = min(position(metrics, state["at"]), total)
        state["trained"] += 1
        now = time.monotonic()
        if now - last < every and not (n >= total and state.get("printed")):
            return  # a run shorter than one interval prints nothing
        last, state["printed"] = now, True
        rate = state["trained"] / max(now - start, 1e-9)
        eta = (total - n) / rate
        loss = metrics.get("loss")
        parts = [f"{label}: step {n}/{total}", f"loss {fmt_loss(loss)}", f"{rate:.2f} steps/s", f"ETA {eta:.0f} s"]
        if events is not None:
            parts.append(f"events {events()}")
        print(", ".join(parts), file=sys.stderr, flush=True)

    return advance


@contextlib.contextmanager
def step_progress(
    total: int, done: int = 0, label: str = "training", events: Callable[[], int] | None = None
) -> Iterator:
    """Progress over optimizer steps; yields ``advance(metrics)``. A bar on a terminal; plain
    periodic lines (step, loss, steps/s, ETA, ``events()`` so far) when stderr is not one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not sys.stderr.isatty():
        yield _plain_progress(total, done, label, events)
        return
    if total - done < 50:
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
        at = done

        def advance(metrics: dict) -> None:
            nonlocal at
            at = min(position(metrics, at), total)
            progress.update(task, completed=at, loss=fmt_loss(metrics.get("loss", float("nan"))))

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
    from sdcscope.cli.output import note

    note(**summary, run_dir=str(out))
