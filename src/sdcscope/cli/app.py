"""Top-level typer app; each command module registers itself here."""

from __future__ import annotations

import re

import typer
from typer.core import TyperGroup

from sdcscope import __version__

_VERBOSITY = re.compile(r"-v+|-q|--verbose|--quiet")
"""The root's logging options, which a user may type after the subcommand too."""


class _RootGroup(TyperGroup):
    """The ``sdcscope`` group: ``-v``/``-vv``/``-q`` (``--verbose``/``--quiet``) given after the
    subcommand (``sdcscope train -q ...``) are read as if given before it; a script's own arguments
    after ``--`` are left alone."""

    def parse_args(self, ctx, args):
        end = args.index("--") if "--" in args else len(args)
        hoisted = [a for a in args[:end] if _VERBOSITY.fullmatch(a)]
        if hoisted:
            args = hoisted + [a for a in args[:end] if not _VERBOSITY.fullmatch(a)] + args[end:]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_RootGroup,
    name="sdcscope",
    help="Inject, observe, detect, localize and repair silent data corruption in PyTorch training.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sdcscope {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: int = typer.Option(
        0, "--verbose", "-v", count=True, help="More log lines on stderr: -v info, -vv debug (default: warnings)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Errors only: no log lines, no console summary."),
) -> None:
    """sdcscope: silent data corruption in LLM training."""
    from sdcscope.cli.output import configure

    configure(verbose, quiet)


from sdcscope.cli import (  # noqa: E402,F401  (registers commands)
    campaign_cmd,
    checkpoint_cmd,
    demo_cmd,
    fleet_cmd,
    guard_cmd,
    inject_cmd,
    invariants_cmd,
    report_cmd,
    score_cmd,
    screen_cmd,
    train_cmd,
)


def main() -> None:
    app()
