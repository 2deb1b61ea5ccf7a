"""The silent-bugs benchmark: infer invariants on clean runs, check buggy runs and clean twins.

For each family of training scripts (see ``scenarios.py``), two clean reference runs are
traced (seeds 1 and 2, two learning rates) and invariants are inferred from them.  Every bug is
then run online under an ``InvariantChecker`` with a seed and learning rate the references did
not use (seed 100+i, lr 2.5e-3), and so is its clean twin (same script, seed and config, bug
off).  So is every clean variant (seed 200+i): a correct loop that differs from the references
in a setting (where gradients are cleared, gradient accumulation, ...).  A bug is detected when
its run raises at least one violation; a clean twin or variant with any violation is a false
positive.

    python benchmarks/silent_bugs/run.py [--bugs a,b,...] [--out DIR] [--jobs N]

The last line reads ``detected D/N bugs, false positives F/C clean runs``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import BUGS, FAMILIES, VARIANTS, Bug, Variant  # noqa: E402

from sdcscope.invariants import (  # noqa: E402
    Invariant,
    InvariantChecker,
    TraceRecorder,
    infer_invariants,
    save_invariants,
)


@dataclass
class Result:
    bug: Bug
    violations: list[dict[str, Any]]
    clean_violations: list[dict[str, Any]]

    @property
    def detected(self) -> bool:
        return bool(self.violations)

    @property
    def first(self) -> dict[str, Any] | None:
        return min(self.violations, key=lambda e: e["step"]) if self.violations else None


@dataclass
class VariantResult:
    variant: Variant
    violations: list[dict[str, Any]]


def recorder(out: Path):
    def attach(model, optimizer, **kw):
        return TraceRecorder(model, optimizer, out=out, **kw).attach()

    return attach


def checker(invariants: list[Invariant], run_dir: Path):
    def attach(model, optimizer, **kw):
        return InvariantChecker(model, optimizer, invariants, run_dir=run_dir, **kw).attach()

    return attach


def infer_family(name: str, out: Path) -> list[Invariant]:
    """Trace the family's clean references and infer the invariants that hold in all of them."""
    family = FAMILIES[name]
    runs = []
    for ref in family.references:
        run_dir = out / name / f"ref_seed{ref['seed']}"
        family.script(bug=None, attach=recorder(run_dir), **ref)
        runs.append(run_dir)
    invariants = infer_invariants(runs)
    save_invariants(invariants, out / name / "invariants.yaml", [str(r) for r in runs])
    return invariants


def run_benchmark(
    bugs: list[Bug], out: Path, log=print, variants: Sequence[Variant] = ()
) -> tuple[list[Result], list[VariantResult]]:
    invariants = {}
    for fam in dict.fromkeys(x.family for x in [*bugs, *variants]):
        invariants[fam] = infer_family(fam, out)
        n_refs = len(FAMILIES[fam].references)
        log(f"  {fam}: {len(invariants[fam])} invariants from {n_refs} clean references")

    def check(family: str, name: str, seed: int, bug: str | None, config: dict[str, Any]):
        run_dir = out / family / name
        return (
            FAMILIES[family]
            .script(
                seed=seed, bug=bug, attach=checker(invariants[family], run_dir), **FAMILIES[family].checked, **config
            )
            .violations
        )

    results = []
    for bug in bugs:
        seed = 100 + BUGS.index(bug)
        results.append(
            Result(
                bug,
                *(
                    check(bug.family, f"{bug.name}_{'bug' if which else 'clean'}", seed, which, bug.config)
                    for which in (bug.name, None)
                ),
            )
        )
    variant_results = [
        VariantResult(v, check(v.family, f"variant_{v.name}", 200 + VARIANTS.index(v), None, v.config))
        for v in variants
    ]
    return results, variant_results


def _alarms(violations: list[dict[str, Any]]) -> str:
    return "ok" if not violations else f"{len(violations)} FALSE ALARM(S)"


def table(results: list[Result], variant_results: Sequence[VariantResult] = ()) -> str:
    rows = [("bug", "family", "detected", "first step", "first violated invariant", "#inv", "clean twin")]
    for r in results:
        f = r.first
        rows.append(
            (
                r.bug.name,
                r.bug.family,
                "yes" if r.detected else "NO",
                str(f["step"]) if f else "-",
                f"{f['verdict']} @ {f['module']}" if f else "-",
                str(len({e["verdict"] for e in r.violations})),
                _alarms(r.clean_violations),
            )
        )
    if variant_results:
        rows.append(("clean variant", "family", "", "", "what", "", "violations"))
        rows += [
            (v.variant.name, v.variant.family, "", "", v.variant.what, "", _alarms(v.violations))
            for v in variant_results
        ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _chunk_job(bug_names: list[str], variant_names: list[str], out: Path) -> tuple[list, list]:
    """``run_benchmark`` on some bugs and variants of one family, in a worker process; plain
    values back (seeds follow the global lists, so the results are those of one process)."""
    results, variant_results = run_benchmark(
        [b for b in BUGS if b.name in bug_names],
        out,
        log=lambda *_: None,
        variants=[v for v in VARIANTS if v.name in variant_names],
    )
    return (
        [(r.bug.name, r.violations, r.clean_violations) for r in results],
        [(v.variant.name, v.violations) for v in variant_results],
    )


def run_parallel(
    bugs: list[Bug], variants: Sequence[Variant], out: Path, jobs: int, chunk: int = 4
) -> tuple[list[Result], list[VariantResult]]:
    """``run_benchmark`` in ``jobs`` processes, a family's bugs and variants ``chunk`` at a time
    (each chunk infers its family's invariants again, from the same references)."""
    tasks = []
    for fam in dict.fromkeys(x.family for x in [*bugs, *variants]):
        items = [x for x in [*bugs, *variants] if x.family == fam]
        for i in range(0, len(items), chunk):
            part = items[i : i + chunk]
            names = [x.name for x in part if isinstance(x, Bug)], [x.name for x in part if isinstance(x, Variant)]
            tasks.append((*names, out / f"chunk{len(tasks)}"))
    by_bug, by_variant = {}, {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for bug_rows, variant_rows in pool.map(_chunk_job, *zip(*tasks)):
            by_bug.update((name, rest) for name, *rest in bug_rows)
            by_variant.update(variant_rows)
    return [Result(b, *by_bug[b.name]) for b in bugs], [VariantResult(v, by_variant[v.name]) for v in variants]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bugs", default="", help="comma-separated subset of bugs and clean variants (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="keep run directories here")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (a loaded machine finishes sooner)")
    args = ap.parse_args()
    names = [n for n in args.bugs.split(",") if n]
    known = [x.name for x in [*BUGS, *VARIANTS]]
    unknown = sorted(set(names) - set(known))
    if unknown:
        sys.exit(f"unknown bug(s) or variant(s) {unknown}; known: {', '.join(known)}")
    bugs = [b for b in BUGS if not names or b.name in names]
    variants = [v for v in VARIANTS if not names or v.name in names]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        print(f"silent-bugs benchmark: {len(bugs)} bugs, {len(variants)} clean variants, runs in {out}")
        if args.jobs > 1:
            results, variant_results = run_parallel(bugs, variants, out, args.jobs)
        else:
            results, variant_results = run_benchmark(bugs, out, variants=variants)
    print(table(results, variant_results))
    clean = [(f"{r.bug.name} twin", r.clean_violations) for r in results]
    clean += [(f"variant {v.variant.name}", v.violations) for v in variant_results]
    for name, violations in clean:
        for e in violations:
            print(f"  false alarm in {name}: step {e['step']} {e['verdict']} {e['evidence']}")
    detected = sum(r.detected for r in results)
    false_pos = sum(bool(violations) for _, violations in clean)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"detected {detected}/{len(results)} bugs, false positives {false_pos}/{len(clean)} clean runs")


if __name__ == "__main__":
    main()
