"""``sdcscope screen``: run a short golden workload on each device and compare it bit for bit with
the reference of its software stack; verdicts go to the device ledger (:mod:`sdcscope.localize.screen`)
and, with ``--history`` or ``$SDCSCOPE_FLEET``, to the fleet history (:mod:`sdcscope.localize.history`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import fail, load_fault_file, out_console, path_option, user_errors
from sdcscope.common.exitcodes import ExitCode

REFERENCE_ENV = "SDCSCOPE_SCREEN_REFERENCE"
"""Default reference file (else ``~/.cache/sdcscope/screen_reference.json``)."""


def default_reference() -> Path:
    return Path(os.environ.get(REFERENCE_ENV) or "~/.cache/sdcscope/screen_reference.json").expanduser()


@app.command()
def screen(
    device: Optional[list[str]] = typer.Option(
        None, "--device", "-d", help="Device to screen (cpu, cuda:0, ...; repeat it); default: every visible one."
    ),
    reference: Optional[Path] = path_option(
        None,
        "--reference",
        help=f"Reference digests per software stack (default ${REFERENCE_ENV} or "
        "~/.cache/sdcscope/screen_reference.json).",
    ),
    record: bool = typer.Option(
        False, "--record", help="Record this machine's digests as the reference of its stack (on a trusted device)."
    ),
    ledger: Optional[Path] = path_option(
        Path("ledger.json"), "--ledger", help="Device ledger to write the verdicts to ('' for none)."
    ),
    steps: int = typer.Option(8, "--steps", help="Golden training steps."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    faults: Optional[Path] = path_option(
        None,
        "--faults",
        help="Fault specs to inject into the golden workload (simulate a bad device; targets fc1, fc2).",
    ),
    history: Optional[Path] = path_option(
        None,
        "--history",
        help="Fleet history directory to append the pass/fail verdicts to (default $SDCSCOPE_FLEET when set; "
        "else none).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Screen devices: a device whose golden steps differ from the reference is marked faulty in the
    ledger (exit code 4); passing devices are marked healthy."""
    with user_errors():
        from sdcscope.localize.screen import ScreenConfig
        from sdcscope.localize.screen import screen as run_screen

        config = ScreenConfig(steps=steps, dtype=dtype)
        specs = load_fault_file("--faults", faults) if faults is not None else []
        ref = reference or default_reference()
        book = ledger if ledger is not None and str(ledger) not in ("", ".") else None
        from sdcscope.localize.history import HISTORY_ENV

        fleet = history or (Path(os.environ[HISTORY_ENV]).expanduser() if os.environ.get(HISTORY_ENV) else None)
        results = run_screen(device, ref, book, config, record=record, faults=specs, history=fleet)
    if as_json:
        out_console.print_json(json.dumps([r.to_dict() for r in results]))
    else:
        for r in results:
            where = "" if r.first_difference is None else f"  first difference: {r.first_difference}"
            out_console.print(f"{r.target:8} {r.device:28} {r.verdict:16} {r.seconds:7.2f}s{where}", highlight=False)
        out_console.print(
            f"reference: {ref}"
            + ("" if book is None else f"; ledger: {book}")
            + ("" if fleet is None else f"; history: {fleet}"),
            highlight=False,
        )
    failed = [r.target for r in results if r.verdict == "fail"]
    if failed:
        raise fail(
            f"devices failed screening: {', '.join(failed)} (marked faulty in the ledger)", ExitCode.GUARD_STOPPED
        )
    missing = [r.target for r in results if r.verdict == "no_reference"]
    if missing and not as_json:
        out_console.print(
            f"no reference for the stack of {', '.join(missing)}: record one on a trusted machine with --record",
            highlight=False,
        )
