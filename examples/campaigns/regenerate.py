"""Regenerate every table of examples/campaigns/RESULTS.md from the campaign specs beside it.

    python examples/campaigns/regenerate.py                    # full specs: runs/results/, then RESULTS.md
    python examples/campaigns/regenerate.py --check examples/campaigns/RESULTS.md   # compare, write nothing there
    python examples/campaigns/regenerate.py --shrink --check examples/campaigns/shrunk_blocks.md   # as CI

Runs (or resumes: a finished campaign is only read) each campaign of CAMPAIGNS in ``--runs`` (the
GPT and noisy-label CNN MAC-cell campaigns once per training seed of TRAIN_SEEDS), re-runs the worst plain GPT MAC-cell
trial with evaluations along the way (the gap table), then writes each generated block of
RESULTS.md (between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``) and measures each
finding the prose states with its interval or test (results_findings.py). ``--check FILE``
compares FILE's blocks with the regenerated ones, exactly (runs are bit-reproducible). ``--shrink``
runs shrunken variants (fewer trials and steps, SHRINK, one training seed) into their own folder.
Exit status 1 when a finding does not hold, 2 when a committed block differs from its regeneration.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_blocks import (  # noqa: E402
    CAMPAIGNS,
    MARK,
    bits_block,
    blocks_only,
    check,
    drift_block,
    fill,
    gap_block,
    nodes_block,
    nvdla_block,
    nvdla_facts_text,
)
from results_findings import findings, seed_replicas, swizzle_view  # noqa: E402

__all__ = [
    "CAMPAIGNS",
    "HERE",
    "MARK",
    "SHRINK",
    "SHRUNK_BLOCKS",
    "TRAIN_SEEDS",
    "check",
    "main",
    "regenerate",
    "replicas",
    "run",
]

HERE = Path(__file__).resolve().parent
SHRUNK_BLOCKS = HERE / "shrunk_blocks.md"
"""The generated blocks of the shrunken specs, committed: CI regenerates them and compares (``check``)."""
GAP_POINTS = 6
# what --shrink changes in each spec (merged into it): the same fault models, fewer trials and steps
_NVDLA_CNN = {"horizon": 60, "faults": {"repeats": 2}, "baseline": {"seeds": [1, 2], "twins": 3}}
_NVDLA_GPT = {
    "horizon": 100,
    "workload": {"eval_batches": 2, "batch_size": 8},
    "faults": {"repeats": 2},
    "baseline": {"seeds": [1, 2], "twins": 3},
}
SHRINK = {
    "gpt_bits": {
        "inject_steps": [10],
        "horizon": 6,
        "workload": {"eval_batches": 2, "batch_size": 4},
        "faults": {"targets": ["head"], "bits": [0, 22, 27, 30, 31]},
        "sampling": {"kind": "exhaustive"},
        "baseline": {"seeds": [101, 102], "twins": 3},
    },
    "nvdla_cnn": _NVDLA_CNN,
    "nvdla_cnn_noisy": _NVDLA_CNN,
    "nvdla_gpt": _NVDLA_GPT,
    "nodes_gpt": {
        "inject_steps": [10],
        "horizon": 12,
        "workload": {"eval_batches": 2, "batch_size": 4},
        "faults": {
            "profiles": {
                p: {"repeats": 2} for p in yaml.safe_load((HERE / "nodes_gpt.yaml").read_text())["faults"]["profiles"]
            }
        },
        "baseline": {"seeds": [1, 2], "twins": 3},
    },
}


# the training seeds each campaign runs with (one campaign folder per seed; the spec's own seed first):
# the MAC-cell effects of the GPT and the noisy-label CNN are measured over seeds x cells, the shrunken
# specs keep the spec's seed only
TRAIN_SEEDS = {"nvdla_gpt": (7, 8), "nvdla_cnn_noisy": (7, 8)}


def replicas(name: str, shrink: bool) -> list[str]:
    """The campaign folders of campaign ``name``: ``name`` (the spec's seed), then ``name-seedS`` for
    each further training seed S of TRAIN_SEEDS (none with ``shrink``)."""
    return [name] + ([] if shrink else [f"{name}-seed{s}" for s in TRAIN_SEEDS.get(name, ())])


def _merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` (nested mappings merged, except ``sampling``: replaced whole)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        deep = isinstance(v, dict) and isinstance(out.get(k), dict) and k != "sampling"
        out[k] = _merge(out[k], v) if deep else copy.deepcopy(v)
    return out


# ------------------------------------------------------------------------------------- running


_RUN = """
import resource, sys, time
from sdcscope.study import run_campaign
for d in sys.argv[2:]:
    t0 = time.perf_counter()
    run_campaign(d, workers=int(sys.argv[1]))
    print(f"{d}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
u = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(f"{sys.argv[2:]}: {sum(x.ru_utime + x.ru_stime for x in u):.1f} s CPU", file=sys.stderr)
"""


def run(runs: Path, shrink: bool, workers: int, parallel: int = 1, names: tuple[str, ...] = CAMPAIGNS) -> float:
    """Init (when new) and run or resume every campaign of ``names``: ``parallel`` groups share them
    out (longest horizon first), the lightest run here and each other in a process of its own, each running
    its campaigns one after the other with ``workers`` workers; returns the wall seconds."""
    from sdcscope.study import init_campaign, run_campaign

    runs.mkdir(parents=True, exist_ok=True)
    folders = []
    for name in names:
        for folder in replicas(name, shrink):
            directory, spec = runs / folder, HERE / f"{name}.yaml"
            if shrink or folder != name:
                data = _merge(yaml.safe_load(spec.read_text()), SHRINK[name] if shrink else {})
                data["seed"] = int(folder.rpartition("-seed")[2]) if folder != name else data["seed"]
                spec = runs / f"{folder}.{'shrunk' if shrink else 'seed'}.yaml"
                spec.write_text(yaml.safe_dump(data, sort_keys=False))
            if not (directory / "campaign.yaml").is_file():
                init_campaign(directory, spec)
            folders.append(folder)
    names = tuple(folders)
    cost = {n: yaml.safe_load((runs / n / "campaign.yaml").read_text())["horizon"] for n in names}
    groups: list[list[str]] = [[] for _ in range(max(1, parallel))]
    for name in sorted(names, key=lambda n: -cost[n]):
        min(groups, key=lambda g: sum(cost[n] for n in g)).append(name)
    t0, env = time.perf_counter(), {**os.environ, "OMP_NUM_THREADS": "1"}
    groups = sorted((g for g in groups if g), key=lambda g: sum(cost[n] for n in g))
    procs = [  # the lightest group runs here (this process has more to do after), the others apart
        subprocess.Popen([sys.executable, "-c", _RUN, str(workers), *(str(runs / n) for n in g)], env=env)
        for g in groups[1:]
    ]
    with torch.random.fork_rng():
        threads = torch.get_num_threads()
        try:
            for name in groups[0]:
                run_campaign(runs / name, workers=workers)
        finally:
            torch.set_num_threads(threads)
    if any(p.wait() for p in procs):
        raise RuntimeError("a campaign failed (see above); run again to resume")
    return time.perf_counter() - t0


def load(directory: Path) -> dict:
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import ResultsDB

    spec = load_campaign(directory / "campaign.yaml")
    with ResultsDB(directory / "results.sqlite", spec) as db:
        return {
            "spec": spec,
            "dir": directory,
            "rows": db.trials(),
            "baselines": db.baselines(),
            "twins": db.twins(),
            "refs": db.references(),
            "thresholds": db.thresholds(),
        }


def _finished(c: dict) -> bool:
    """Whether every planned trial of the campaign has its row."""
    return len(c["rows"]) == len(_plan(c))


def _plan(c: dict) -> list:
    """The campaign's trials (planned once per campaign)."""
    from sdcscope.study.runner import plan_campaign

    if "plan" not in c:
        c["plan"] = plan_campaign(c["spec"])
    return c["plan"]


def _trial(c: dict, trial_id: int):
    return next(t for t in _plan(c) if t.trial_id == trial_id)


def mac_cells(c: dict) -> dict[int, tuple[int, int]]:
    """The MAC cell (input row a, output column b) of each trial, by fault seed: one forward pass
    with the trial's fault, unswizzled, read from its first injection record (the weight element it
    hit); a swizzled trial of the same fault seed has the same cell."""
    from sdcscope.inject import Injector
    from sdcscope.workloads import make_workload

    spec = c["spec"]
    workload = make_workload(spec.workload_config())
    with torch.random.fork_rng():
        model = workload.build_model()
    x = workload.batch(spec.seed, 0)[0]
    out = {}
    for t in (t for t in _plan(c) if not t.swizzle):
        fault = t.fault_spec(spec.faults.space(t.profile).format)
        with Injector(model, [fault], warn_unfired=False) as inj:
            inj.set_position(0, 0)
            with torch.no_grad():
                model(x)
        rec = next(r for r in inj.records if r["index"])  # a cell outside conv1's one input row misses it
        o, i = np.unravel_index(rec["index"][0], tuple(model.get_submodule(rec["module"]).weight.shape))[:2]
        rows, cols = fault.pattern.array
        out[t.fault_seed] = (int(i) % rows, int(o) % cols)
    return out


def gap_curve(c: dict, trial_id: int, points: int = GAP_POINTS) -> dict:
    """Re-run one permanent-fault trial from its golden snapshot, evaluating ``points`` times along
    the horizon with the fault present and removed (a hook-free copy of the model)."""
    from sdcscope.engine import Trainer, load_checkpoint
    from sdcscope.inject import Injector
    from sdcscope.workloads import make_workload

    spec, trial = c["spec"], _trial(c, trial_id)
    torch.set_num_threads(1)
    workload = make_workload(spec.workload_config())
    trainer = Trainer(workload, spec.train_config())
    trainer.restore(load_checkpoint(c["dir"] / "golden" / f"step-{trial.inject_step}"))
    injector = Injector(
        trainer.model,
        [trial.fault_spec(spec.faults.space(trial.profile).format)],
        trainer.optimizer,
        warn_unfired=False,
    )
    trainer.add_callback(injector.attach().callback())
    with torch.random.fork_rng():
        clean = workload.build_model()
    clean.eval()
    out = {"trial_id": trial_id, "steps": [], "present": [], "removed": []}
    for k in range(1, points + 1):
        stop = trial.inject_step + round(spec.horizon * k / points)
        while trainer.step < stop:
            trainer.train_step()
        out["steps"].append(trainer.step - trial.inject_step)
        out["present"].append(trainer.evaluate()["val_loss"])  # as the campaign did at the end
        clean.load_state_dict(trainer.model.state_dict())
        out["removed"].append(workload.evaluate(clean)["val_loss"])
    injector.close()
    return out


def gap(c: dict, cache: Path) -> dict:
    """The gap curve of the plain GPT trial with the largest loss change with the fault removed
    (cached in ``cache``, keyed by spec hash and trial)."""
    worst = max(c["rows"], key=lambda r: r["val_delta"] if r["val_delta"] is not None else -math.inf)
    key = f"{c['spec'].hash}:{worst['trial_id']}:{GAP_POINTS}"
    if cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())
    curve = {"key": key, **gap_curve(c, worst["trial_id"])}
    cache.write_text(json.dumps(curve))
    return curve


NEEDS = {
    "cnn-table": ("nvdla_cnn",),
    "cnn-facts": ("nvdla_cnn",),
    "gpt-table": ("nvdla_gpt",),
    "gpt-facts": ("nvdla_gpt",),
    "gap-table": ("nvdla_gpt",),
    "cnn_noisy-table": ("nvdla_cnn_noisy",),
    "cnn_noisy-facts": ("nvdla_cnn_noisy",),
    "bits-table": ("gpt_bits",),
    "bits-facts": ("gpt_bits",),
    "nodes-table": ("nodes_gpt",),
}


def regenerate(
    runs: Path,
    shrink: bool,
    workers: int,
    template: Path,
    out: Path,
    parallel: int = 1,
    only: tuple[str, ...] = CAMPAIGNS,
) -> list[tuple[str, str, str | None, str]]:
    """Run (or resume) the campaigns ``only`` (default all), write ``out`` from ``template`` with every
    finished campaign in ``runs`` and return the findings (id, claim, verdict, evidence; verdict
    None for a finding whose campaign is not finished; their blocks say so)."""
    walls = run(runs, shrink, workers, parallel, only)
    folders = {n: replicas(n, shrink) for n in CAMPAIGNS}
    loaded = {
        f: c
        for fs in folders.values()
        for f in fs
        if (runs / f / "results.sqlite").is_file() and _finished(c := load(runs / f))
    }
    # a campaign counts once its spec's own seed has finished; a further training seed not finished
    # yet is left out of every block and finding, and the provenance line names it
    cs = {f: loaded[f] for n, fs in folders.items() if n in loaded for f in fs if f in loaded}
    blocks: dict[str, str] = {}
    curve = None
    for kind, metric in (("cnn", "acc"), ("gpt", "loss"), ("cnn_noisy", "loss")):
        if f"nvdla_{kind}" not in cs:
            continue
        seeds = seed_replicas(cs, f"nvdla_{kind}")
        plains, swzs = [swizzle_view(c, False) for c in seeds], [swizzle_view(c, True) for c in seeds]
        cells = mac_cells(seeds[0])  # the cells depend on the fault seed only, not on the training seed
        table, facts = nvdla_block(plains, swzs, cells, metric)
        blocks[f"{kind}-table"] = table
        blocks[f"{kind}-facts"] = nvdla_facts_text(kind, plains, swzs, facts)
        if kind == "gpt":
            worst = max(plains, key=lambda c: max(r["val_delta"] for r in c["rows"]))
            curve = gap(worst, runs / "gap.json")
            row = next(r for r in worst["rows"] if r["trial_id"] == curve["trial_id"])
            blocks["gap-table"] = gap_block(curve, row, cells, worst["spec"].seed)
    if "gpt_bits" in cs:
        blocks["bits-table"], blocks["bits-facts"], _ = bits_block(cs["gpt_bits"])
    if "nodes_gpt" in cs:
        blocks["nodes-table"] = nodes_block(cs["nodes_gpt"])
    for name, needs in NEEDS.items():
        if name not in blocks:
            missing = ", ".join(f"`{n}`" for n in needs if n not in cs)
            blocks[name] = (
                f"_Not regenerated: campaign {missing} has not finished in `{runs}` (see the provenance line)._"
            )
    blocks["drift-table"] = drift_block(cs)
    found = findings(cs, curve)
    word = {"holds": "holds", "within noise": "**within noise**", "does not hold": "**does not hold**"}
    blocks["findings"] = "\n".join(
        f"- {word[v]} ({i}): {claim} — {ev}." if v else f"- not measured in this run ({i}): {claim}"
        for i, claim, v, ev in found
    )
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    missing = [f for fs in folders.values() for f in fs if f not in cs]
    blocks["provenance"] = (
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python examples/campaigns/regenerate.py"
        f"{' --shrink' if shrink else ''} --workers {workers} --parallel {parallel}` from the specs in this folder "
        f"({'shrunken' if shrink else 'full'}): {walls:.0f} s of campaign wall time in this call (a campaign "
        f"already finished is only read); load average at the end {load_avg} on {os.cpu_count()} cores."
        + ("" if only == CAMPAIGNS else f" Campaigns run by this call: {', '.join(only)}.")
        + (f" Not finished: {', '.join(missing)}." if missing else "")
    )
    out.write_text(fill(template.read_text(encoding="utf-8"), blocks), encoding="utf-8")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shrink", action="store_true", help="shrunken specs (fewer trials and steps), as CI runs them")
    ap.add_argument("--runs", type=Path, help="campaign folders (default runs/results, or runs/results-shrink)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes per campaign (0: in this process)")
    ap.add_argument("--parallel", type=int, default=1, help="campaigns run at once, each in its own process")
    ap.add_argument(
        "--only", nargs="+", choices=CAMPAIGNS, help="run only these (others are read when finished, else left out)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="the document to write (default RESULTS.md; with --shrink or --check: RUNS/RESULTS.md)",
    )
    ap.add_argument(
        "--check",
        type=Path,
        metavar="FILE",
        help="compare every generated block of FILE (RESULTS.md, or SHRUNK_BLOCKS with --shrink) with the "
        "regenerated one; exit status 1 on any difference",
    )
    ap.add_argument("--save-blocks", type=Path, metavar="FILE", help="also write the generated blocks alone to FILE")
    args = ap.parse_args(argv)
    runs = args.runs or Path("runs") / ("results-shrink" if args.shrink else "results")
    out = args.out or (runs / "RESULTS.md" if args.shrink or args.check else HERE / "RESULTS.md")
    only = tuple(n for n in CAMPAIGNS if n in (args.only or CAMPAIGNS))
    found = regenerate(runs, args.shrink, args.workers, HERE / "RESULTS.md", out, args.parallel, only)
    for i, claim, verdict, evidence in found:
        print(f"{verdict or 'not measured'} {i}: {claim} — {evidence}")
    print(f"wrote {out}; {sum(v == 'holds' for _, _, v, _ in found)}/{len(found)} findings hold")
    text = out.read_text(encoding="utf-8")
    if args.save_blocks:
        args.save_blocks.write_text(blocks_only(text), encoding="utf-8")
    status = 1 if any(v == "does not hold" for _, _, v, _ in found) else 0
    if args.check:
        mismatches = check(args.check.read_text(encoding="utf-8"), text)
        for line in mismatches:
            print(f"MISMATCH {line}")
        verdict = f"{len(mismatches)} block(s) differ" if mismatches else "every committed number regenerates"
        print(f"checked {args.check}: {verdict}")
        status = 2 if mismatches else status
    return status


if __name__ == "__main__":
    sys.exit(main())
