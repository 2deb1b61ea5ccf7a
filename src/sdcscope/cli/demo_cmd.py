"""``sdcscope demo``: the main job on the default workload.

The tiny GPT trains on Python's own source three times from the same seed and data: golden
(no fault), faulty (an exponent-bit flip in one element of the attention query GEMM's output),
and guarded (the same fault under the Guard). The guard detects the flip in the same step
(ABFT names the layer and the GEMM), proves it transient by replaying the step, and keeps the
clean re-execution, so the guarded run ends where the golden one does.
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
- site: gemm.forward            # Y = X Wᵀ of an nn.Linear, in the forward pass
  target: blocks.0.attn.q_proj  # the query projection of the first block
  model: bitflip
  bits: [30]                    # the top exponent bit of fp32
  pattern: {kind: element, index: random}
  schedule: {kind: transient, step: %d}
  seed: 1
"""


DEMO_OUTPUTS = frozenset({DEMO_MARKER, "golden", "faulty", "guarded", "comparison.json", "loss_curves.png"})
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


def plot_losses(out: Path, labels: list[str], fault_step: int | None = None, detections: list[int] = ()) -> Path:
    """``loss_curves.png``: the training losses of the runs in ``labels`` (the first is the
    reference) and, below, each other run's difference from the reference, where a fault's
    effect shows even when the curves overlap; the fault's step and the guard's detections
    (``detections``: steps) are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdcscope.engine import read_jsonl

    curves = {}
    for label in labels:
        rows = read_jsonl(out / label / "metrics.jsonl")
        curves[label] = {int(r["step"]): float(r["loss"]) for r in rows}
    ref = curves[labels[0]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    styles = ("-", "--", ":")
    for i, label in enumerate(labels):
        steps = sorted(curves[label])
        top.plot(steps, [curves[label][s] for s in steps], styles[i % 3], label=label, color=f"C{i}")
        if i:
            shared = [s for s in steps if s in ref]
            bottom.plot(
                shared,
                [curves[label][s] - ref[s] for s in shared],
                styles[i % 3],
                label=f"{label} − {labels[0]}",
                color=f"C{i}",
            )
    for ax in (top, bottom):
        if fault_step is not None:
            ax.axvline(fault_step, color="grey", lw=0.8, ls="-.")
        for j, s in enumerate(detections):
            ax.axvline(s, color="C3", lw=0.8, alpha=0.6, label="guard detection" if ax is bottom and j == 0 else None)
    if fault_step is not None:
        top.annotate(
            "fault",
            (fault_step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            color="grey",
        )
    top.set_ylabel("training loss")
    top.set_yscale("log")
    top.legend()
    top.set_title(f"tiny GPT: {' vs '.join(labels)}")
    bottom.set_yscale("symlog", linthresh=1e-4)  # a bitwise-equal run stays at 0
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"loss − {labels[0]} loss")
    bottom.legend()
    fig.tight_layout()
    path = out / "loss_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@app.command()
def demo(
    out: Path = path_option(Path("runs/demo"), "--out", "-o", help="Where to write the demo's runs."),
    steps: int = typer.Option(300, "--steps", "-n", help="Training steps of each run."),
) -> None:
    """Inject a fault into the tiny GPT, detect, localize and repair it: golden vs faulty vs guarded."""
    with user_errors():
        if steps < 2:
            raise ValueError(f"--steps {steps}: the demo needs at least 2 steps (the fault fires halfway)")
        prepare_demo_dir(out)
        from sdcscope.engine import write_json
        from sdcscope.faults import load_specs
        from sdcscope.guard import GuardConfig
        from sdcscope.study.experiment import Experiment

        specs = load_specs(DEMO_FAULT % (steps // 2))
        wcfg, tcfg = build_configs("gpt", "tiny", 0)
        experiment = Experiment(out, wcfg, tcfg, specs, guard=GuardConfig())
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / DEMO_MARKER, {"command": "sdcscope demo", "steps": steps})
    source = experiment.golden.workload.describe()["corpus_source"]
    out_console.print(
        f"tiny byte-level GPT on {source}: {steps} steps × 3 runs; "
        f"fault: bit 30 flip in blocks.0.attn.q_proj's forward GEMM at step {steps // 2}"
    )
    c = experiment.run(steps, progress=lambda label, total: step_progress(total, label=label))
    g = c["guarded"]
    out_console.print(f"golden   val loss {fmt_loss(c['val_loss_golden'])}")
    out_console.print(
        f"faulty   val loss {fmt_loss(c['val_loss_faulty'])} → [bold]{c['outcome']}[/] "
        f"(diverged at step {c['first_divergence_step']})"
    )
    out_console.print(f"guarded  val loss {fmt_loss(g['val_loss_faulty'])} → [bold]{g['outcome']}[/] vs golden")
    for e in g["events"]:
        out_console.print(
            f"  step {e['step']}: {e['detector']} found {e['evidence'].get('finding')} "
            f"in {e.get('module') or '-'} {e.get('gemm') or ''}; replay: {e['verdict']} "
            f"→ {e['action']}"
        )
    plot = plot_losses(out, ["golden", "faulty", "guarded"], steps // 2, sorted({int(e["step"]) for e in g["events"]}))
    out_console.print(f"outputs: {out}/golden, faulty, guarded (run directories), comparison.json, {plot.name}")
