"""``sdcscope report DIR``: report.html (self-contained, figures inlined) and report.md of a campaign
or of a run directory (per-rank timelines of a distributed run)."""

from __future__ import annotations

from pathlib import Path

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import out_console, user_errors


@app.command()
def report(directory: Path = typer.Argument(..., help="Campaign directory (results.sqlite) or run directory "
                                                     "(config.json, from sdcscope train/inject).")) -> None:
    """Write DIR/report.html and DIR/report.md: a campaign's results, or a run's per-rank timelines."""
    with user_errors():
        from sdcscope.study import write_report

        html, md = write_report(directory)
    out_console.print(f"wrote {html} and {md}")
