"""``sdcscope checkpoint verify DIR``: check a checkpoint's files against its manifest and report its
certification (whether a guard vouched for the state it holds), on demand.

sdcscope checkpoint verify runs/r1/checkpoint      # one checkpoint directory
sdcscope checkpoint verify runs/r1                 # every checkpoint of a run, and the one --resume takes

A checkpoint verifies when what a resume checks holds: its files match their sha256 in the
manifest, and what a resume loads loads with ``weights_only=True`` and holds the manifest's step
(``state.pt``; a sharded run's ``rank{r}.pt``, beside its torch.distributed.checkpoint shards).
The command exits 2 when any checkpoint it names is bad.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import CLIError, out_console, path_argument, user_errors

checkpoint_app = typer.Typer(help="Checkpoints: verify files and certification.", no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")

CERTIFICATION = {True: "verified by the guard", False: "NOT verified (an unresolved guard finding)", None: "no guard"}


def _line(path: Path) -> tuple[bool, str]:
    """Whether the checkpoint in ``path`` verifies as a resume checks it, and one line saying so."""
    from sdcscope.engine.state import DCP_FORMAT, CheckpointError, check_loadable, verify_checkpoint

    try:
        manifest = verify_checkpoint(path)
        check_loadable(path, manifest)
    except CheckpointError as exc:
        return False, f"{path}: BAD: {exc}"
    files = len(manifest["files"])
    certified = CERTIFICATION[manifest.get("verified")]
    layout = manifest.get("layout") or {}
    sharded = ""
    if manifest.get("format") == DCP_FORMAT:
        where = f"--parallel {layout.get('parallel')} on {layout.get('world_size')} ranks"
        sharded = f", sharded (torch.distributed.checkpoint, {where})"
    return True, (
        f"{path}: step {manifest['step']}, {files} file(s) match their sha256 and load "
        f"(weights_only){sharded}, {certified}"
    )


@checkpoint_app.command()
def verify(
    directory: Path = path_argument(..., help="A checkpoint directory (manifest.json) or a run directory."),
) -> None:
    """Verify a checkpoint directory, or every checkpoint of a run directory, as a resume checks
    them (exit code 2 when any checkpoint named is bad)."""
    with user_errors():
        from sdcscope.engine.rundir import checkpoint_candidates, choose_checkpoint
        from sdcscope.engine.state import MANIFEST_FILE, CheckpointError

        if not directory.is_dir():
            raise FileNotFoundError(f"{str(directory)!r} is not a folder; give a checkpoint or a run directory")
        if (directory / MANIFEST_FILE).is_file():
            ok, line = _line(directory)
            if not ok:
                raise CLIError(line)
            out_console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        candidates = checkpoint_candidates(directory)
        if not candidates:
            raise CLIError(f"{str(directory)!r} holds no checkpoint (no manifest.json in it or in its checkpoints)")
        bad = []
        for _, path in candidates:
            ok, line = _line(path)
            out_console.print(line, markup=False, highlight=False, soft_wrap=True)
            if not ok:
                bad.append(str(path))
        try:
            chosen, _, _ = choose_checkpoint(directory)
        except CheckpointError as exc:
            raise CLIError(f"no checkpoint of {str(directory)!r} can be resumed: {exc}") from None
        out_console.print(f"train --resume {directory} continues from {chosen}", markup=False, highlight=False)
        if bad:
            raise CLIError(
                f"{len(bad)} of {len(candidates)} checkpoints of {str(directory)!r} are bad: {', '.join(bad)}"
            )
