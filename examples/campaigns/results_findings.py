"""The findings examples/campaigns/RESULTS.md states, each measured with its interval or test.

Every finding is one line: its verdict, the claim, the effect with its 95 % interval (or the counts
a count claim rests on), the number of units (training seeds x MAC cells, or trials) and the
healthy spread of the measure. An effect claim *holds* only when its interval excludes zero (or the
stated null) in the stated direction and its size exceeds the healthy spread; otherwise it is
*within noise* (``sdcscope.study.stats.effect_verdict``). A count claim ("no trial crashes") is a
statement about these trials: it holds or does not, with the Wilson interval of the rate beside it.

``cs`` maps a campaign folder name to its loaded results (``load`` of regenerate.py); a campaign of
several training seeds has one folder per seed (``replicas`` of regenerate.py): ``NAME``,
``NAME-seedS``. A MAC-cell campaign holds plain and swizzled trials of the same cells
(``swizzle_view``).
"""

from __future__ import annotations

import math
import statistics

from sdcscope.study.stats import bootstrap_interval, effect_verdict, mean_interval, wilson_interval

__all__ = ["CLAIMS", "findings", "healthy_spread", "seed_replicas", "swizzle_view"]

MANTISSA, EXPONENT = range(0, 23), range(23, 31)


def seed_replicas(cs: dict[str, dict], name: str) -> list[dict]:
    """The loaded folders of campaign ``name``, one per training seed (the spec's own seed first)."""
    return [cs[k] for k in sorted(cs, key=lambda k: (k != name, k)) if k == name or k.startswith(f"{name}-seed")]


def swizzle_view(c: dict, swizzled: bool) -> dict:
    """Campaign ``c`` with only its swizzled (or only its plain) trials: a MAC-cell campaign holds both
    patterns, paired by fault seed, over one golden run and one set of healthy runs."""
    return {**c, "rows": [r for r in c["rows"] if bool(r["swizzle"]) == swizzled]}


def healthy_spread(cs: list[dict], key: str) -> float:
    """The healthy spread of validation measure ``key`` (``val_loss`` or ``val_acc``): the range of
    golden's value and its re-seeded healthy runs', the largest over the training seeds."""
    step = lambda c: c["spec"].inject_steps[0]  # noqa: E731
    spans = []
    for c in cs:
        vals = [c["refs"][step(c)][key]] + [b[key] for b in c["baselines"] if b[key] is not None]
        spans.append(max(vals) - min(vals))
    return max(spans)


def _units(cs: list[dict]) -> str:
    cells = len({r["fault_seed"] for c in cs for r in c["rows"]})
    return f"{len(cs)} training seed{'s' if len(cs) > 1 else ''} × {cells} MAC cells"


def _effect(values: list[float], spread: float, direction: str, unit: str, units: str) -> tuple[str, str]:
    """(verdict, evidence) of a mean paired difference against the healthy spread."""
    if len(values) < 2:
        return "within noise", f"{len(values)} unit: no interval ({units})"
    iv = mean_interval(values)
    text = (
        f"effect {iv['mean']:+.3f} {unit}, 95 % t interval [{iv['lo']:+.3f}, {iv['hi']:+.3f}], n = {iv['n']} "
        f"({units}); healthy spread {spread:.3f} {unit}"
    )
    return effect_verdict(iv, spread, direction), text


def _count(k: int, n: int, what: str, ok: bool) -> tuple[str, str]:
    lo, hi = wilson_interval(k, n) if n else (0.0, 1.0)
    return ("holds" if ok else "does not hold"), f"{what}: {k}/{n} trials (Wilson 95 % [{lo:.2f}, {hi:.2f}])"


def _paired(plain: list[dict], swz: list[dict]) -> list[tuple[dict, dict]]:
    """(plain row, swizzled row) of each training seed x cell, paired by seed and fault seed."""
    out = []
    for p, s in zip(plain, swz):
        by_seed = {r["fault_seed"]: r for r in s["rows"]}
        out += [(r, by_seed[r["fault_seed"]]) for r in p["rows"] if r["fault_seed"] in by_seed]
    return out


def _median_ratio(base: list[float], other: list[float]) -> float:
    """median(other) / median(base), infinite where the base's median is 0 (a resample of zeros)."""
    m = statistics.median(base)
    return statistics.median(other) / m if m else math.inf


def _sign_test(increments: list[float]) -> float:
    """One-sided sign test: P(at least this many positive increments) when each is + or - at 1/2."""
    m, k = len(increments), sum(d > 0 for d in increments)
    return sum(math.comb(m, j) for j in range(k, m + 1)) / 2**m if m else 1.0


CLAIMS = {
    "a1": "CNN: no trial crashes or is masked (a stuck cell in every layer always changes the run)",
    "a2": "CNN: with the fault present, accuracy stays within the healthy spread of golden's",
    "a3": "CNN: with the fault removed, accuracy stays within the healthy spread of golden's (no collapse)",
    "a4": "CNN: every trial's weights end beyond the chaos envelope (perturbation twins), none beyond the "
    "re-seed spread",
    "a5": "CNN plain: removing the fault changes accuracy by no more than the healthy spread (no dependence "
    "on the fault, unlike the GPT's b1)",
    "b1": "GPT plain: the model comes to depend on the fault: with it removed the validation loss is worse "
    "than with it present (gap, removed − present > 0)",
    "b2": "GPT plain: with the fault present the loss stays within the healthy spread of golden's",
    "b3": "GPT: swizzling narrows that dependence (gap, plain − swizzled > 0, paired by seed and cell)",
    "b4": "GPT: swizzled training costs while the fault is present (loss with the fault present, swizzled − "
    "plain > 0, paired)",
    "b5": "GPT plain, worst cell: the gap (removed − present) is positive at the end and grows over the run",
    "c1": "bits: no crash; masked trials only among mantissa bits",
    "c2": "bits: exponent flips move the parameters at least 10x more than mantissa flips (median)",
    "c3": "bits: no single flip takes the weights beyond the re-seed spread",
    "c4": "bits: some exponent flips move the weights beyond the chaos envelope (perturbation twins); no "
    "one-ulp flip (bit 0) does",
    "d1": "nodes: the impact differs between nodes: the median worst-step gradient noise-to-signal ratio of "
    "the most affected profile is over 10x that of the least affected one with a nonzero median",
    "d2": "nodes: in most trials the perturbation of the gradients is small: worst-step noise-to-signal "
    "ratio below 0.1 (Wilson lower bound above one half)",
    "d3": "nodes: a normal loss curve does not certify the weights: some trials end beyond the chaos "
    "envelope with training and validation loss inside the healthy spread, while no healthy twin does",
    "d4": "nodes: some node's fault spikes the loss or collapses the training (sdc:sharp or a non-finite loss)",
    "d5": "nodes: some node shows no SDC at the submodule level at the injection step in most of its trials",
    "e1": "noisy-label CNN plain: the model comes to depend on the fault: with it removed the validation "
    "loss is worse than with it present (gap, removed − present > 0), as on the GPT (b1)",
    "e2": "noisy-label CNN plain: with the fault present the loss stays within the healthy spread of golden's",
    "e3": "noisy-label CNN: swizzling narrows that dependence (gap, plain − swizzled > 0, paired by seed and cell)",
    "e4": "noisy-label CNN: swizzled training costs while the fault is present (loss with the fault present, "
    "swizzled − plain > 0, paired)",
    "e5": "noisy-label CNN plain: trained under the fault and evaluated without it, the model does better than "
    "golden (loss with the fault removed − golden's < 0)",
}
"""Each finding's claim, as the text of RESULTS.md states it."""
_NEEDS = {"a": "nvdla_cnn", "b": "nvdla_gpt", "c": "gpt_bits", "d": "nodes_gpt", "e": "nvdla_cnn_noisy"}


def _cnn(cs: dict[str, dict]) -> dict[str, tuple[str, str]]:
    seeds = seed_replicas(cs, "nvdla_cnn")
    plain, swz = [swizzle_view(c, False) for c in seeds], [swizzle_view(c, True) for c in seeds]
    every = plain + swz
    rows = [r for c in every for r in c["rows"]]
    golden = {id(r): c["refs"][c["spec"].inject_steps[0]]["val_acc"] for c in every for r in c["rows"]}
    spread = healthy_spread(plain, "val_acc")
    units = f"{_units(plain)}, plain and swizzled"
    odd = sum(r["effect"] not in ("benign", "sdc") for r in rows)
    beyond = sum(r["drift_twin"] == 1 for r in rows)
    spread_n = sum(bool(r["drift_spread"]) for r in rows)
    removal = [r["val_acc"] - r["val_acc_fault"] for c in plain for r in c["rows"]]
    return {
        "a1": _count(odd, len(rows), "crashed or masked", odd == 0),
        "a2": _effect([r["val_acc_fault"] - golden[id(r)] for r in rows], spread, "0", "accuracy", units),
        "a3": _effect([r["val_acc"] - golden[id(r)] for r in rows], spread, "0", "accuracy", units),
        "a4": _count(
            beyond,
            len(rows),
            f"beyond the envelope ({spread_n} beyond the re-seed spread)",
            beyond == len(rows) and spread_n == 0,
        ),
        "a5": _effect(removal, spread, "0", "accuracy", _units(plain)),
    }


def _dependence(cs: dict[str, dict], name: str) -> tuple[list[tuple[str, str]], float]:
    """The four validation-loss effects of a MAC-cell campaign over its training seeds x cells --
    dependence on the fault (removed - present, plain), the fault present against golden (plain),
    swizzling narrowing the dependence and swizzling's cost with the fault present (both paired) --
    and the healthy spread they are judged against."""
    seeds = seed_replicas(cs, name)
    plain, swz = [swizzle_view(c, False) for c in seeds], [swizzle_view(c, True) for c in seeds]
    spread = healthy_spread(plain, "val_loss")
    units, pairs = _units(plain), _paired(plain, swz)
    gap = lambda r: r["val_loss"] - r["val_loss_fault"]  # noqa: E731
    golden = {id(r): c["refs"][c["spec"].inject_steps[0]]["val_loss"] for c in plain for r in c["rows"]}
    rows = [r for c in plain for r in c["rows"]]
    effects = [
        _effect([gap(r) for r in rows], spread, "+", "nats", units),
        _effect([r["val_loss_fault"] - golden[id(r)] for r in rows], spread, "0", "nats", units),
        _effect([gap(p) - gap(s) for p, s in pairs], spread, "+", "nats", units),
        _effect([s["val_loss_fault"] - p["val_loss_fault"] for p, s in pairs], spread, "+", "nats", units),
    ]
    return effects, spread


def _gpt(cs: dict[str, dict], gap_curve: dict | None) -> dict[str, tuple[str, str]]:
    effects, spread = _dependence(cs, "nvdla_gpt")
    b5 = ("within noise", "no gap curve")
    if gap_curve:
        gaps = [r - p for p, r in zip(gap_curve["present"], gap_curve["removed"])]
        steps = [b - a for a, b in zip(gaps, gaps[1:])]
        p = _sign_test(steps)
        b5 = (
            "holds" if p < 0.05 and gaps[-1] > spread else "does not hold" if gaps[-1] <= 0 else "within noise",
            f"gap {gaps[0]:+.3f} → {gaps[-1]:+.3f} nats over {len(gaps)} evaluations, "
            f"{sum(d > 0 for d in steps)}/{len(steps)} increments positive (sign test p = {p:.3f}); one trial; "
            f"healthy spread {spread:.3f} nats",
        )
    return {**dict(zip(("b1", "b2", "b3", "b4"), effects)), "b5": b5}


def _noisy(cs: dict[str, dict]) -> dict[str, tuple[str, str]]:
    effects, spread = _dependence(cs, "nvdla_cnn_noisy")
    plain = [swizzle_view(c, False) for c in seed_replicas(cs, "nvdla_cnn_noisy")]
    removed = [r["val_delta"] for c in plain for r in c["rows"]]  # fault removed − golden
    return {**dict(zip(("e1", "e2", "e3", "e4"), effects)), "e5": _effect(removed, spread, "-", "nats", _units(plain))}


def _bits(cs: dict[str, dict]) -> dict[str, tuple[str, str]]:
    c = cs["gpt_bits"]
    bits = c["rows"]
    bound = c["thresholds"][c["spec"].inject_steps[0]]["dist_golden"]
    mant = [r["dist_golden"] for r in bits if r["bit"] in MANTISSA and r["dist_golden"] is not None]
    expo = [r["dist_golden"] for r in bits if r["bit"] in EXPONENT and r["dist_golden"] is not None]
    crash = sum(r["effect"] == "crash" for r in bits)
    masked_hi = sum(r["effect"] == "masked" and r["bit"] not in MANTISSA for r in bits)
    spread_n = sum(bool(r["drift_spread"]) for r in bits)
    beyond_e = sum(bool(r["drift_twin"]) for r in bits if r["bit"] in EXPONENT)
    beyond_0 = sum(bool(r["drift_twin"]) for r in bits if r["bit"] == 0)
    n_e, n_0 = sum(r["bit"] in EXPONENT for r in bits), sum(r["bit"] == 0 for r in bits)
    c2 = ("within noise", f"{len(expo)} exponent and {len(mant)} mantissa trials with a distance")
    if mant and expo and statistics.median(mant) > 0:
        iv = bootstrap_interval([mant, expo], _median_ratio)
        c2 = (
            effect_verdict(iv, 0.0, "+", null=10.0),
            f"median ratio {iv['mean']:.3g}, bootstrap 95 % [{iv['lo']:.3g}, {iv['hi']:.3g}] over {len(expo)} "
            f"exponent and {len(mant)} mantissa trials (null: 10)",
        )
    return {
        "c1": _count(crash + masked_hi, len(bits), "crashed, or masked outside the mantissa", crash + masked_hi == 0),
        "c2": c2,
        "c3": _count(spread_n, len(bits), f"beyond the re-seed bound {bound:.3g}", spread_n == 0),
        "c4": (
            "holds" if beyond_e > 0 and beyond_0 == 0 else "does not hold",
            f"{_count(beyond_e, n_e, 'exponent flips beyond the envelope', True)[1]}; "
            f"{_count(beyond_0, n_0, 'bit-0 flips beyond it', True)[1]}",
        ),
    }


def _nodes(cs: dict[str, dict]) -> dict[str, tuple[str, str]]:
    from sdcscope.study.nodes import profile_levels

    c = cs["nodes_gpt"]
    levels = profile_levels(c["rows"], c["thresholds"])
    finite = lambda xs: [float(x) for x in xs if math.isfinite(float(x))]  # noqa: E731  (a crash's NSR is inf)
    medians = {s["profile"]: statistics.median(finite(s["b_nsr_max"])) for s in levels if finite(s["b_nsr_max"])}
    nonzero = {p: m for p, m in medians.items() if m > 0}
    d1 = ("within noise", f"{len(nonzero)} profiles with a nonzero median worst-step NSR")
    if len(nonzero) >= 2:
        hi, lo = max(nonzero, key=nonzero.get), min(nonzero, key=nonzero.get)
        by = {s["profile"]: finite(s["b_nsr_max"]) for s in levels}
        iv = bootstrap_interval([by[lo], by[hi]], _median_ratio)
        d1 = (
            effect_verdict(iv, 0.0, "+", null=10.0),
            f"{hi} / {lo}: median ratio {iv['mean']:.3g}, bootstrap 95 % [{iv['lo']:.3g}, {iv['hi']:.3g}] over "
            f"{len(by[hi])} and {len(by[lo])} trials (null: 10)",
        )
    active = [r for r in c["rows"] if r["activated"] and r["nsr_max"] is not None]
    small = sum(float(r["nsr_max"]) < 0.1 for r in active)
    lo_small = wilson_interval(small, len(active))[0] if active else 0.0
    twins = [t["drift_twin"] for t in c["twins"] if t["drift_twin"] is not None]
    quiet = sum(s["c_drift_quiet_loss"] for s in levels)
    n = len(c["rows"])
    spike = sum(s["c_sharp"] + s["c_crash"] for s in levels)
    silent = [(s["profile"], s["trials"] - sum(f > 0 for f in s["a_frequency"]), s["trials"]) for s in levels]
    most = max(silent, key=lambda x: x[1] / x[2])
    return {
        "d1": d1,
        "d2": (
            "holds" if lo_small > 0.5 else "does not hold",
            f"NSR below 0.1: {small}/{len(active)} activated trials (Wilson 95 % [{lo_small:.2f}, "
            f"{wilson_interval(small, len(active))[1] if active else 1.0:.2f}])",
        ),
        "d3": (
            "holds" if quiet > 0 and sum(twins) == 0 else "does not hold",
            f"{_count(quiet, n, 'beyond the envelope with a healthy loss', True)[1]}; "
            f"twins beyond it: {sum(twins)}/{len(twins)}",
        ),
        "d4": _count(spike, n, "sdc:sharp or crash", spike > 0),
        "d5": _count(
            most[1], most[2], f"{most[0]}: no submodule mismatch at the injection step", most[1] * 2 > most[2]
        ),
    }


def findings(cs: dict[str, dict], gap_curve: dict | None) -> list[tuple[str, str, str | None, str]]:
    """(id, claim, verdict, evidence) of every finding RESULTS.md states; verdict None (and no
    evidence) for a finding whose campaigns are not all finished in ``cs``."""
    measured: dict[str, tuple[str, str]] = {}
    for group, measure in (("a", _cnn), ("b", _gpt), ("c", _bits), ("d", _nodes), ("e", _noisy)):
        if _NEEDS[group] in cs:
            measured.update(measure(cs, gap_curve) if group == "b" else measure(cs))
    return [(i, claim, *measured.get(i, (None, ""))) for i, claim in CLAIMS.items()]
