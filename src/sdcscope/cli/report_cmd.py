"""``sdcscope report DIR``: report.html (self-contained, figures inlined) and report.md of a campaign,
of a run directory (per-rank timelines of a distributed run), or of each run an ``inject`` or
``demo`` directory holds."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from sdcscope.cli.app import app
from sdcscope.cli.common import out_console, path_argument, path_option, user_errors

MARKERS = ("results.sqlite", "campaign.yaml", "config.json")
"""A campaign's or a run's own files: such a directory is reported as itself."""


def report_dirs(directory: Path) -> list[Path]:
    """The directories to report: ``directory`` itself, or the runs a folder of runs (``inject``,
    ``demo``) holds."""
    if not directory.exists():
        raise FileNotFoundError(
            f"{str(directory)!r} does not exist; give a campaign directory "
            "(sdcscope campaign init) or a run directory (sdcscope train/inject --out)"
        )
    if not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is a file; give a campaign directory or a run directory")
    if any((directory / name).exists() for name in MARKERS[:2]):
        return [directory]
    if (directory / "config.json").exists():
        if _foreign(directory / "config.json"):
            raise ValueError(
                f"{str(directory / 'config.json')!r} is not an sdcscope run's (it has no 'workload'): "
                f"{str(directory)!r} is no run directory; give a campaign directory or a run directory "
                "(sdcscope train/inject --out)"
            )
        return [directory]
    runs = sorted(p.parent for p in directory.glob("*/config.json") if not _foreign(p))
    if not runs:
        raise ValueError(
            f"{str(directory)!r} is neither a campaign directory ({', '.join(MARKERS[:2])}) nor a "
            "run directory (config.json), nor a folder of runs (DIR/*/config.json)"
        )
    return runs


def _foreign(config: Path) -> bool:
    """Whether ``config`` is another tool's ``config.json`` (a JSON object without an sdcscope run's
    ``workload``): such a folder is no run, and no report is written into it. A file that does not
    read as JSON is left to the report, which names the problem."""
    import json

    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "workload" not in data


@app.command()
def report(
    directory: Path = path_argument(
        ...,
        help="Campaign directory (results.sqlite), run directory "
        "(config.json, from sdcscope train), or a folder of runs "
        "(from sdcscope inject / demo: each run is reported).",
    ),
    out: Optional[Path] = path_option(
        None,
        "--out",
        "-o",
        help="Write the report(s) here instead of into DIR (e.g. DIR is read-only); a folder of runs "
        "gets one subfolder per run.",
    ),
) -> None:
    """Write DIR/report.html and DIR/report.md: a campaign's results, or a run's per-rank timelines."""
    with user_errors():
        from sdcscope.common.storage import new_outputs
        from sdcscope.study import build_report, write_report

        targets = report_dirs(directory)
        reports = [(target, build_report(target)) for target in targets]  # all, before any is written
        wheres = {t: None if out is None else out if t == directory else out / t.name for t in targets}
        folders = [w for w in wheres.values() if w is not None]
        with new_outputs(*([out] if out is not None else []), *folders):  # a failed write leaves no folder
            for target, data in reports:
                if wheres[target] is not None:
                    wheres[target].mkdir(parents=True, exist_ok=True)
                html, md = write_report(target, data, out=wheres[target])
                out_console.print(f"wrote {html} and {md}")
            if (directory / "golden" / "metrics.jsonl").is_file():  # an inject/demo folder: its page too
                from sdcscope.study.compare_page import write_page

                out_console.print(f"wrote {write_page(directory, to=out)}")
