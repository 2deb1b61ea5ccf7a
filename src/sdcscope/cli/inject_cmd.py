"""``sdcscope inject``: golden run + faulty run from the same seed and data, and their comparison."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import (
    fmt_loss,
    load_fault_file,
    out_console,
    path_option,
    step_progress,
    storage_errors,
    user_errors,
)
from sdcscope.cli.options import (
    BATCH_SIZE_OPT,
    CORPUS_OPT,
    GRAD_ACCUM_OPT,
    GUARD_CONFIG_OPT,
    GUARD_OPT,
    LR_OPT,
    PRESET_OPT,
    SEED_OPT,
    STEPS_OPT,
    WORKLOAD_OPT,
    build_configs,
    check_steps,
    guard_config,
)
from sdcscope.cli.output import JSON_OPT, json_output, note
from sdcscope.common.exitcodes import ExitCode


def print_comparison(out: Path, c: dict) -> None:
    size = c["param_rel_l2"]
    size = f"{size:.3g}" if isinstance(size, float) else size
    val, vf = c["val_loss_delta"], c["val_loss_faulty"]
    out_console.print(
        f"[bold]{c['outcome']}[/]: {c['injections']} fault(s) fired; first divergence at step "
        f"{c['first_divergence_step']}; final parameter distance (rel. L2) {size}; "
        f"val loss {fmt_loss(c['val_loss_golden'])} → {fmt_loss(vf)} "
        f"(Δ {val if val is None else format(val, '+.4g')})"
    )
    if "guarded" in c:
        g = c["guarded"]
        out_console.print(
            f"[bold]guarded[/]: {len(g['events'])} event(s); outcome vs golden {g['outcome']}; "
            f"val loss {fmt_loss(g['val_loss_faulty'])} (golden {fmt_loss(c['val_loss_golden'])})"
        )
        for e in g["events"][:5]:
            out_console.print(
                f"  step {e['step']}: {e['detector']} {e['verdict']} "
                f"{e.get('module') or ''} {e.get('gemm') or ''} → {e['action']}"
            )
    runs = ", ".join(str(out / r) for r in ("golden", "faulty", "guarded") if (out / r).is_dir())
    out_console.print(f"runs: {runs}; comparison: {out / 'comparison.json'}, {out / 'comparison.html'}")
    note(**c, out=str(out), comparison_file=str(out / "comparison.json"))


@app.command()
def inject(
    ctx: typer.Context,
    spec: Path = path_option(..., "--spec", help="YAML/JSON list of fault specs."),
    out: Path = path_option(..., "--out", "-o", help="New directory for golden/, faulty/, comparison.json."),
    workload: str = WORKLOAD_OPT,
    preset: str = PRESET_OPT,
    steps: int = STEPS_OPT,
    seed: int = SEED_OPT,
    corpus: Optional[Path] = CORPUS_OPT,
    batch_size: Optional[int] = BATCH_SIZE_OPT,
    lr: Optional[float] = LR_OPT,
    grad_accum: int = GRAD_ACCUM_OPT,
    guard: bool = GUARD_OPT,
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Run the golden and the faulty run and compare them."""
    json_output(ctx, as_json)
    with user_errors():
        check_steps(steps)
        from sdcscope.study.experiment import Experiment

        specs = load_fault_file("--spec", spec)
        wcfg, tcfg = build_configs(
            workload, preset, seed, corpus=corpus, batch_size=batch_size, lr=lr, grad_accum=grad_accum
        )
        fresh = not out.exists() or (out.is_dir() and not any(out.iterdir()))
        experiment = Experiment(out, wcfg, tcfg, specs, guard=guard_config(guard, guard_config_path), steps=steps)
        from sdcscope.study.trace import trace_experiment

        trace = trace_experiment(experiment, steps)  # parameter distance to golden, for comparison.html
    try:
        with storage_errors():
            comparison = experiment.run(steps, progress=lambda label, total: step_progress(total, label=label))
            from sdcscope.study.compare_page import write_outputs

            write_outputs(out, comparison, trace)  # comparison.html and loss_curves.png
    except typer.Exit as exc:
        if fresh and exc.exit_code == ExitCode.STORAGE:  # an experiment the disk cut short leaves nothing half-made
            _remove_contents(out)
        raise
    print_comparison(out, comparison)


def _remove_contents(out: Path) -> None:
    import contextlib
    import shutil

    with contextlib.suppress(OSError):
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
