"""``sdcscope demo``: the main job on the default workload.

The tiny GPT learns to predict the next byte of Python's standard library source, three times from
the same seed and data: golden (no fault), faulty and guarded (the same fault under the Guard). The
fault is a memory fault in a weight that writes the residual stream: the top exponent bit of fp16
(a half-precision copy of the weights) flipped in one row of the last block's MLP output
projection, halfway, which multiplies each value of the row by 2^16 -- large, yet finite.
Unguarded, the loss jumps and the run settles on a worse curve with parameters far from the golden
ones; the guard's checksums of the weights find the changed words before the step's update, it
rolls back to its verified snapshot, and the guarded run ends bitwise equal to the golden one. The
demo writes ``comparison.html`` and ``loss_curves.png`` and says in one sentence each what the
fault did, what the guard detected and how it repaired it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from sdcscope.cli.app import app
from sdcscope.cli.common import fmt_loss, out_console, path_option, step_progress, user_errors
from sdcscope.cli.options import build_configs

DEMO_MARKER = "demo.json"
DEMO_FAULT = """\
- site: weight                  # a parameter in memory
  target: blocks.1.mlp.proj     # the last block's MLP output projection: it writes the residual stream
  model: bitflip
  format: fp16                  # the fault lives in a half-precision copy of the weights
  bits: [14]                    # the top exponent bit of fp16: a value below 2 becomes 2^16 times larger
  pattern: {kind: row, index: random}
  schedule: {kind: transient, step: %d}
  seed: 1
"""
DEPARTED = 0.1
"""The loss difference (or a crash) that counts as the unguarded run leaving the golden curve."""


DEMO_OUTPUTS = frozenset(
    {DEMO_MARKER, "golden", "faulty", "guarded", "comparison.json", "comparison.html", "loss_curves.png"}
)
"""What the demo writes in its folder: all it may replace."""


def prepare_demo_dir(out: Path) -> None:
    """The demo may replace its own earlier output (a folder holding its marker and nothing but
    what it writes), never anything else."""
    from sdcscope.engine import check_new_run_dir

    if (out / DEMO_MARKER).is_file():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in DEMO_OUTPUTS)
        if foreign:
            raise ValueError(
                f"--out {str(out)!r} holds an earlier demo and other files ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}), which the demo does not replace; give a "
                "new or empty folder"
            )
        for name in DEMO_OUTPUTS:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    check_new_run_dir(out)


@app.command()
def demo(
    out: Path = path_option(Path("runs/demo"), "--out", "-o", help="Where to write the demo's runs."),
    steps: int = typer.Option(200, "--steps", "-n", help="Training steps of each run (the fault fires halfway)."),
) -> None:
    """Inject a fault into the tiny GPT, detect, localize and repair it: golden vs faulty vs guarded."""
    with user_errors():
        if steps < 2:
            raise ValueError(f"--steps {steps}: the demo needs at least 2 steps (the fault fires halfway)")
        prepare_demo_dir(out)
        import torch

        from sdcscope.engine import write_json
        from sdcscope.faults import load_specs
        from sdcscope.guard import GuardConfig
        from sdcscope.study.experiment import Experiment
        from sdcscope.study.trace import trace_experiment

        specs = load_specs(DEMO_FAULT % (steps // 2))
        wcfg, tcfg = build_configs("gpt", "tiny", 0)
        experiment = Experiment(out, wcfg, tcfg, specs, guard=GuardConfig(), steps=steps)
        trace = trace_experiment(experiment, steps)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / DEMO_MARKER, {"command": "sdcscope demo", "steps": steps})
    out_console.print(f"training {experiment.golden.workload.task()}", highlight=False)
    out_console.print(
        f"{steps} steps × 3 runs from one seed (golden, faulty, guarded); fault at step {steps // 2}: the top "
        "fp16 exponent bit of one row of blocks.1.mlp.proj's weights (each value × 2^16)",
        highlight=False,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a d=64 model gains nothing from intra-op threads, which stall on a busy machine
    try:
        c = experiment.run(steps, progress=lambda label, total: step_progress(total, label=label))
    finally:
        torch.set_num_threads(threads)
    from sdcscope.study.compare_page import write_outputs
    from sdcscope.study.compare_series import departure

    page = write_outputs(out, c, trace)
    g = c["guarded"]
    out_console.print(f"golden   val loss {fmt_loss(c['val_loss_golden'])}")
    out_console.print(f"faulty   val loss {fmt_loss(c['val_loss_faulty'])} → [bold]{c['outcome']}[/] vs golden")
    out_console.print(f"guarded  val loss {fmt_loss(g['val_loss_faulty'])} → [bold]{g['outcome']}[/] vs golden")
    for line in page["story"]:
        out_console.print(line, highlight=False)
    d = departure(page["series"], "faulty", min(page["figure"]["fault_steps"], default=None))
    if d["crash_step"] is None and abs(d["peak"]) < DEPARTED:
        out_console.print(f"note: this fault moved the unguarded loss by {d['peak']:+.3g} only (< {DEPARTED})")
    out_console.print(
        f"outputs: {out}/golden, faulty, guarded (run directories), comparison.json, comparison.html, loss_curves.png"
    )
