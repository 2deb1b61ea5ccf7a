"""The detector scoreboard on one fault space: the guard profiles ``minimal``, ``balanced`` and
``full`` and an external detector (``examples/zscore_detector.py``, a loss z-score) scored on the
same trials.

    python benchmarks/bench_scoreboard.py [--out DIR] [--workers N] [--profiles minimal balanced full]

Three campaigns run the same plan (the tiny GPT, 20 steps into training, followed for 4 steps;
exponent and mantissa flips in the forward product and the weight gradient of two Linears, and
in a weight, transient and permanent; two healthy baselines), each under one guard profile. Then
``sdcscope score DIR_minimal DIR_balanced DIR_full --detector examples/zscore_detector.py:detect``
scores them: recall, false-positive rate, localization (rank, layer, element) and latency per
fault class (site x model x pattern x schedule). The campaigns stay in ``--out`` (default: a new
temporary folder), so the score command can be run again on them. The last line reads each
detector's overall recall and false-positive rate.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = """name: scoreboard-{profile}
workload: {{name: gpt, preset: tiny, batch_size: 4, eval_batches: 1}}
seed: 0
inject_steps: [20]
horizon: 4
faults:
  sites: [gemm.forward, gemm.grad_weight, weight]
  targets: [blocks.0.mlp.fc, blocks.1.attn.q_proj]
  models: [bitflip]
  bits: [30, 22]
  patterns: [{{kind: element}}]
  schedules: [{{kind: transient}}, {{kind: permanent}}]
baseline: {{seeds: [101, 102]}}
guard: {{profile: {profile}}}
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder of the campaigns (default: a new temp one)")
    parser.add_argument("--workers", type=int, default=1, help="campaign workers (0: in this process)")
    parser.add_argument("--profiles", nargs="+", default=["minimal", "balanced", "full"])
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="scoreboard-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": os.environ.get("COLUMNS", "200")}
    sdcscope = [sys.executable, "-m", "sdcscope"]
    dirs = []
    for profile in args.profiles:
        spec, camp = out / f"{profile}.yaml", out / profile
        spec.write_text(SPEC.format(profile=profile))
        t0 = time.perf_counter()
        if not (camp / "campaign.yaml").is_file():
            subprocess.run([*sdcscope, "campaign", "init", str(camp), "--spec", str(spec)], check=True, env=env)
        subprocess.run([*sdcscope, "campaign", "run", str(camp), "-j", str(args.workers)], check=True, env=env)
        print(f"campaign {profile}: {time.perf_counter() - t0:.0f} s", flush=True)
        dirs.append(str(camp))
    scores = out / "scores.json"
    detector = f"{ROOT / 'examples' / 'zscore_detector.py'}:detect"
    cmd = [*sdcscope, "score", *dirs, "--detector", detector, "--json", str(scores), "--export", str(out / "rows")]
    subprocess.run(cmd, check=True, env=env)
    import json

    data = json.loads(scores.read_text())["scores"]
    print(
        "overall: "
        + "; ".join(
            f"{name} recall {s['all']['recall']:.0%} FP {s['clean']['fp_rate'] if 'clean' in s else 0:.0%}"
            f"/{s['all']['fp_rate']:.0%}"
            for name, s in data.items()
        )
        + " (recall of fired faults; false positives on clean trials / before the fault on faulty ones)"
    )


if __name__ == "__main__":
    main()
