"""Drift against the chaos floor: one-ulp faults stay inside the perturbation twins' envelope at
every horizon, exponent flips do not, and the twins' own false-drift rate.

    python benchmarks/bench_drift_floor.py [--horizon 500] [--twins 8] [--inject-steps 20 60]
        [--margin 2.0] [--lr 3e-3] [--workers 2] [--threads 1] [--keep DIR]

Runs one campaign on the tiny GPT (batch 4): weight faults at each injection step in three
Linears (``blocks.0.mlp.fc``, ``blocks.1.attn.v_proj``, ``blocks.1.mlp.proj``), bit 0 (one ulp)
and bit 24 (exponent) of one random element and of one random row, followed for ``--horizon``
steps, with ``--twins`` perturbation twins per injection step. For every trial and every drift
offset (8 over the horizon) it compares the distance to golden with the twins' envelope there --
the verdict a campaign whose horizon ended at that offset would give (twins, trial and golden
are the same runs up to it) -- and prints one line per trial: its distance and the envelope at
each offset, the old fixed-bound verdict (0.01) and the new one. The twins are tested
leave-one-out at every offset (their false-drift rate). Last line: one-ulp trials beyond the
envelope at any offset (target 0), exponent-row trials beyond it at the end, the twins'
false-drift rate over all offsets (target <= 5 %) and over ends, and the old bound's verdicts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SPEC = """
name: drift-floor
workload: {{name: gpt, preset: tiny, batch_size: 4, eval_batches: 1, lr: {lr}}}
inject_steps: {steps}
horizon: {horizon}
faults:
  sites: [weight]
  targets: [blocks.0.mlp.fc, blocks.1.attn.v_proj, blocks.1.mlp.proj]
  models: [bitflip]
  bits: [0, 24]
  patterns: [{{kind: element}}, {{kind: row}}]
  schedules: [{{kind: transient}}]
baseline: {{seeds: [101, 102], twins: {twins}, twin_margin: {margin}}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizon", type=int, default=500)
    parser.add_argument("--twins", type=int, default=8)
    parser.add_argument("--inject-steps", type=int, nargs="+", default=[20, 60])
    parser.add_argument("--margin", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=3e-3, help="the GPT's learning rate (3e-3: its default)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", type=Path, default=None, help="run the campaign here (kept) instead of a temp dir")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from sdcscope.study import init_campaign, run_campaign
    from sdcscope.study.outcomes import TWIN_BOUND
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import ResultsDB
    from sdcscope.study.twins import envelope_bound
    from sdcscope.study.worker import drift_offsets

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        spec_path = root / "spec.yaml"
        spec_path.write_text(
            SPEC.format(
                steps=list(args.inject_steps), horizon=args.horizon, twins=args.twins, margin=args.margin, lr=args.lr
            )
        )
        t0 = time.perf_counter()
        if not (root / "c" / "results.sqlite").exists():
            init_campaign(root / "c", spec_path)
        run_campaign(root / "c", workers=args.workers)
        wall = time.perf_counter() - t0
        spec = load_campaign(root / "c" / "campaign.yaml")
        with ResultsDB(root / "c" / "results.sqlite", spec) as db:
            trials, twins = db.trials(), db.twins()
    offsets = drift_offsets(args.horizon)
    alpha, margin = spec.baseline.alpha, spec.baseline.twin_margin
    env: dict[int, list[float]] = {}
    twin_any, twin_tests, twin_end = 0, 0, 0
    for s in spec.inject_steps:
        mine = [t for t in twins if t["inject_step"] == s]
        env[s] = [envelope_bound([t["drift"][k] for t in mine], alpha, margin)["bound"] for k in range(len(offsets))]
        for i, t in enumerate(mine):
            others = mine[:i] + mine[i + 1 :]
            for k in range(len(offsets)):
                bound = envelope_bound([o["drift"][k] for o in others], alpha, margin)["bound"]
                beyond = t["drift"][k] > bound
                twin_any += beyond
                twin_tests += 1
                twin_end += beyond and k == len(offsets) - 1
        print(f"step {s}: envelope " + " ".join(f"{o}:{b:.2g}" for o, b in zip(offsets, env[s])))
        print(
            f"step {s}: twins    "
            + " ".join(f"{o}:{max(t['drift'][k] for t in mine):.2g}" for k, o in enumerate(offsets))
        )
    ulp_beyond, expo_row, expo_row_beyond, old_drift, n_ulp = 0, 0, 0, 0, 0
    for r in trials:
        pattern = "row" if "row" in r["pattern"] else "element"
        d = r["drift"] or []
        beyond = [k for k, v in enumerate(d) if v is not None and v > env[r["inject_step"]][k]]
        old = d and d[-1] is not None and d[-1] > TWIN_BOUND
        healthy_loss = r["outcome"] != "sdc" or r["sdc_kind"] == "drift"
        label = r["outcome"] + (f":{r['sdc_kind']}" if r["sdc_kind"] else "")
        print(
            f"step {r['inject_step']} {r['target']:<20} bit {r['bit']:>2} {pattern:<7} "
            f"outcome {label}, old bound {'drift' if old else '-'}; "
            + " ".join(f"{o}:{v:.2g}{'*' if k in beyond else ''}" for k, (o, v) in enumerate(zip(offsets, d)))
        )
        if r["bit"] == 0:
            n_ulp += 1
            ulp_beyond += bool(beyond)
            old_drift += bool(old)
        elif pattern == "row" and healthy_loss:
            expo_row += 1
            expo_row_beyond += bool(d) and (len(d) - 1) in beyond
    n_twins = len(twins)
    print(f"campaign wall {wall:.0f} s on {args.workers} worker(s), {args.threads} thread(s)")
    print(
        f"horizon {args.horizon}, margin {margin:g}: one-ulp trials beyond the envelope at any offset "
        f"{ulp_beyond}/{n_ulp} (old bound 0.01 at the end: {old_drift}/{n_ulp}); exponent-row trials with a "
        f"healthy loss beyond it at the end {expo_row_beyond}/{expo_row}; twins' false drift "
        f"{twin_any}/{twin_tests} = {twin_any / max(twin_tests, 1):.1%} over all offsets, "
        f"{twin_end}/{n_twins} at the end"
    )


if __name__ == "__main__":
    main()
