"""False positives of learned invariants on legitimate changes of hyper-parameters.

The invariants of each loop family of the silent-bugs benchmark are inferred from the same two
clean references that catch its bugs (``benchmarks/silent_bugs``: seeds 1 and 2, learning rates
3e-3 and 2e-3); then correct runs of the same loops are checked online with other
hyper-parameters, within the range sdcscope documents as tolerated (docs/invariants.md):

- learning rate: 1/3x the references' lowest to 3x their highest (here 6.7e-4 .. 9e-3);
- warm-up length: 0 to 4x the references' longest (here 0 .. 20 steps; 0 .. 80 for ``engine``,
  whose references warm up over 20 steps, longer than their 16-step runs);
- batch size: 1/2x to 2x the references' (GPT 8 .. 32 sequences, CNN 64 .. 256 images);

each alone and in combinations, with a seed no reference used.  Any violation in a variant is a
false positive.

    python benchmarks/bench_invariants_fp.py [--families gpt_loop,engine] [--out DIR] [--jobs N --chunk K]

The last line reads ``false positives X/N legitimate variants``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "silent_bugs"))

from run import checker, infer_family  # noqa: E402
from scenarios import FAMILIES  # noqa: E402

LRS = (7e-4, 1e-3, 5e-3, 9e-3)
"""Learning rates of the variants, inside [1/3 x 2e-3, 3 x 3e-3]."""


def _schedule_variants(warms: tuple[int, ...], batch: tuple[int, int]) -> list[dict[str, Any]]:
    small, large = batch
    return [
        *({"lr": lr} for lr in LRS),
        *({"warm": w} for w in warms),
        {"batch": small},
        {"batch": large},
        {"warm": warms[-1], "lr": LRS[-1]},
        {"warm": warms[0], "batch": small, "lr": LRS[1]},
        {"warm": warms[2], "batch": large, "lr": LRS[2]},
    ]


def _plain_variants(batch: tuple[int, int]) -> list[dict[str, Any]]:
    small, large = batch
    return [
        *({"lr": lr} for lr in LRS),
        {"batch": small},
        {"batch": large},
        {"batch": small, "lr": LRS[0]},
        {"batch": large, "lr": LRS[-1]},
    ]


VARIANTS: dict[str, list[dict[str, Any]]] = {
    "gpt_loop": _schedule_variants((0, 2, 10, 16, 20), (8, 32)),
    "gpt_groups": _schedule_variants((0, 2, 10, 16, 20), (8, 32)),
    "engine": _schedule_variants((0, 5, 40, 80), (8, 32)),
    "gpt_amp": _plain_variants((8, 32)),
    "cnn_epochs": _plain_variants((64, 256)),
    "replicas": [{"lr": LRS[0]}, {"lr": LRS[-1]}, {"batch": 8}],
}


def _name(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items())


def run_family(family: str, out: Path, first: int, which: range) -> tuple[int, list[tuple[str, str, str]], list]:
    """Infer the family's invariants, check ``which`` of its variants (the i-th with seed 300 +
    first + i); rows and alarms."""
    invariants = infer_family(family, out)
    rows, alarms = [], []
    for i, config in zip(which, VARIANTS[family][which.start : which.stop]):
        i += first
        name = _name(config)
        tool = FAMILIES[family].script(
            seed=300 + i, bug=None, attach=checker(invariants, out / family / f"variant_{i}"), **config
        )
        found = tool.violations
        rows.append((family, name, "ok" if not found else f"{len(found)} FALSE ALARM(S)"))
        alarms += [(family, name, e) for e in found]
    return len(invariants), rows, alarms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=None, help="keep run directories here")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--chunk", type=int, default=100, help="variants per job (each job infers its invariants)")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f] or list(VARIANTS)
    unknown = sorted(set(families) - set(VARIANTS))
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {', '.join(VARIANTS)}")
    n = sum(len(VARIANTS[f]) for f in families)
    print(f"invariant false positives: {n} legitimate variants of {len(families)} loops", flush=True)
    t0 = time.perf_counter()
    firsts = dict(zip(families, itertools.accumulate((len(VARIANTS[f]) for f in families), initial=1)))
    rows, alarms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx) as pool:
            futures = {
                pool.submit(run_family, f, out / f"chunk{k}", firsts[f], which): f
                for k, (f, which) in enumerate(
                    (f, range(i, min(i + args.chunk, len(VARIANTS[f]))))
                    for f in families
                    for i in range(0, len(VARIANTS[f]), args.chunk)
                )
            }
            for future in concurrent.futures.as_completed(futures):
                n_inv, family_rows, family_alarms = future.result()
                family = futures[future]
                bad = sum(not r[2].startswith("ok") for r in family_rows)
                print(f"  {family}: {n_inv} invariants, {bad}/{len(family_rows)} variants alarmed", flush=True)
                for name, e in ((n, e) for f, n, e in family_alarms):
                    print(f"    false alarm [{name}]: step {e['step']} {e['verdict']}", flush=True)
                rows += family_rows
                alarms += family_alarms
    order = {(f, _name(c)): i for i, (f, c) in enumerate((f, c) for f in families for c in VARIANTS[f])}
    rows.sort(key=lambda r: order[r[0], r[1]])
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
    for family, name, e in alarms:
        print(f"  false alarm in {family} [{name}]: step {e['step']} {e['verdict']} {e['evidence']}")
    false_pos = sum(not r[2].startswith("ok") for r in rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"false positives {false_pos}/{len(rows)} legitimate variants")


if __name__ == "__main__":
    main()
