"""What the CLI writes where: logging (``-v``/``-q``) on stderr, the console on stdout, ``--json``.

* The library logs through the ``sdcscope`` logger tree (a guard's detection is one WARNING
  line); the CLI shows it on stderr (rich's handler on a terminal, plain lines otherwise):
  WARNING and up by default, INFO with ``-v``, DEBUG with ``-vv``, errors only with ``-q``
  (which also silences the console summary).
* ``--json`` (``train``, ``inject``, ``campaign status``): the console summary is off and, when
  the command ends, one JSON object -- what the command :func:`note`-d -- is printed on stdout,
  nothing else; errors and logs stay on stderr.
* Off a terminal (a pipe, a file) the console never wraps a line: sentences and paths stay whole.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import typer

from sdcscope.cli.common import err_console, out_console

JSON_OPT = typer.Option(False, "--json", help="Print one JSON summary on stdout (and nothing else there).")

_handler: logging.Handler | None = None
_json: dict[str, Any] | None = None


class _PlainStderr(logging.Handler):
    """One plain line per record on the current ``sys.stderr``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def configure(verbose: int, quiet: bool) -> None:
    """Set up the ``sdcscope`` logger and the consoles for one invocation."""
    global _handler
    from rich.logging import RichHandler

    level = (
        logging.ERROR if quiet else logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    )
    logger = logging.getLogger("sdcscope")
    if _handler is not None:
        logger.removeHandler(_handler)
    if err_console.is_terminal:
        _handler = RichHandler(
            console=err_console, show_time=False, show_path=verbose >= 2, markup=False, rich_tracebacks=False
        )
    else:  # a pipe or a file: whole lines, no columns padded to a width
        _handler = _PlainStderr()
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _handler.setLevel(level)
    logger.addHandler(_handler)
    logger.setLevel(level)
    for console in (out_console, err_console):
        console.soft_wrap = not console.is_terminal  # piped: whole lines, whatever COLUMNS says
    out_console.quiet = quiet


def json_output(ctx: typer.Context, enabled: bool) -> None:
    """``--json``: silence the console; when the command ends, print what was :func:`note`-d as
    one JSON object on stdout (nothing when the command failed before noting anything)."""
    global _json
    if not enabled:
        return
    _json = {}
    out_console.quiet = True

    def emit() -> None:
        global _json
        data, _json = _json, None
        if data:
            from sdcscope.common.io import jsonable

            typer.echo(json.dumps(jsonable(data), allow_nan=False))

    ctx.call_on_close(emit)


def note(**fields: Any) -> None:
    """Add ``fields`` to the ``--json`` summary of this command (nothing without ``--json``)."""
    if _json is not None:
        _json.update(fields)
