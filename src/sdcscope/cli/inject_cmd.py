"""``sdcscope inject``: golden run + faulty run from the same seed and data, and their comparison;
or faults in a user's own script, unchanged (``sdcscope inject --spec F --out DIR -- python train.py``)."""

from __future__ import annotations

import math
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
    PRECISION_OPT,
    PRESET_OPT,
    SEED_OPT,
    STEPS_OPT,
    WORKLOAD_OPT,
    build_configs,
    check_steps,
    guard_config,
)
from sdcscope.cli.output import JSON_OPT, json_output, note


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def comparison_line(c: dict) -> str:
    """The faulty run against golden in one line, saying plainly what has no value: no divergence,
    parameters that are not finite, a run that crashed before its evaluation."""
    size, val, vf = c["param_rel_l2"], c["val_loss_delta"], c["val_loss_faulty"]
    first = c["first_divergence_step"]
    parts = [
        f"{c['injections']} fault(s) fired",
        "the loss never left the golden curve" if first is None else f"first divergence at step {first}",
        f"final parameter distance (rel. L2) {size:.3g}"
        if _finite(size)
        else "the faulty parameters are not finite (no distance to golden)",
    ]
    golden = fmt_loss(c["val_loss_golden"])
    if _finite(vf) and val is not None:
        parts.append(f"val loss {golden} → {fmt_loss(vf)} (Δ {val:+.4g})")
    elif c["outcome"] == "crash":
        parts.append(f"val loss {golden} golden, none for the faulty run: it crashed after {c['steps_faulty']} steps")
    else:
        parts.append(f"val loss {golden} golden, none for the faulty run ({vf})")
    return f"[bold]{c['outcome']}[/]: " + "; ".join(parts)


def print_comparison(out: Path, c: dict) -> None:
    out_console.print(comparison_line(c))
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
    precision: str = PRECISION_OPT,
    guard: bool = GUARD_OPT,
    guard_config_path: Optional[Path] = GUARD_CONFIG_OPT,
    as_json: bool = JSON_OPT,
    command: Optional[list[str]] = typer.Argument(
        None,
        metavar="[-- python SCRIPT.py ARGS | -- torchrun OPTS SCRIPT.py ARGS]",
        help="Inject into your own training script, unchanged, instead of a workload: one run into "
        "--out (with --guard: the guard attached too); the workload options are ignored.",
        show_default=False,
    ),
) -> None:
    """Run the golden and the faulty run and compare them; or inject into your own script:
    ``sdcscope inject --spec F --out DIR [--guard] -- python train.py ARGS``."""
    if command:
        from sdcscope.cli.script import run_attached

        run_attached(command, out, guard_file=guard_config_path, guard=guard, spec=spec)
        return
    json_output(ctx, as_json)
    from sdcscope.common.storage import new_outputs

    with new_outputs(out):  # a failed experiment (a full disk, Ctrl-C, a bug) leaves no folder behind
        with user_errors():
            check_steps(steps)
            from sdcscope.study.experiment import Experiment

            specs = load_fault_file("--spec", spec)
            wcfg, tcfg = build_configs(
                workload,
                preset,
                seed,
                corpus=corpus,
                batch_size=batch_size,
                lr=lr,
                grad_accum=grad_accum,
                precision=precision,
            )
            experiment = Experiment(out, wcfg, tcfg, specs, guard=guard_config(guard, guard_config_path), steps=steps)
            from sdcscope.study.trace import trace_experiment

            trace = trace_experiment(experiment, steps)  # parameter distance to golden, for comparison.html
        with storage_errors():
            comparison = experiment.run(steps, progress=lambda label, total: step_progress(total, label=label))
            from sdcscope.study.compare_page import write_outputs

            write_outputs(out, comparison, trace)  # comparison.html and loss_curves.png
    print_comparison(out, comparison)
