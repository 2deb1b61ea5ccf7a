"""``sdcscope report DIR``: report.html (self-contained, figures inlined) and report.md of a campaign."""

from __future__ import annotations

from pathlib import Path

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import out_console, user_errors


@app.command()
def report(directory: Path = typer.Argument(..., help="Campaign directory holding results.sqlite.")) -> None:
    """Write DIR/report.html and DIR/report.md from the campaign's results."""
    with user_errors():
        from sdcscope.study import write_report

        html, md = write_report(directory)
    out_console.print(f"wrote {html} and {md}")
