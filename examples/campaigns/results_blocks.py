"""The generated blocks of examples/campaigns/RESULTS.md and the findings its text states, from
finished campaigns (``load`` of regenerate.py: rows, baselines, references, thresholds).

Each block is a Markdown table or a list of measured facts; ``fill`` writes them between the
``<!-- generated: NAME -->`` / ``<!-- end: NAME -->`` markers of the document. ``findings`` measures
each finding (which outcome classes appear, the sign and order of magnitude of each effect).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

CAMPAIGNS = ("gpt_bits", "nvdla_cnn", "nvdla_cnn_swizzled", "nvdla_gpt", "nvdla_gpt_swizzled")

SITE_NAMES = {"gemm.forward": "forward", "gemm.grad_input": "dX", "gemm.grad_weight": "dW"}
FIELDS = (("0–22 (mantissa)", range(0, 23)), ("23–30 (exponent)", range(23, 31)), ("31 (sign)", range(31, 32)))


def _f(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.1e}"
    return str(v)


def _g(v) -> str:
    return "–" if v is None else f"{v:.2g}" if abs(v) < 0.1 and v != 0 else f"{v:.3g}"


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# ------------------------------------------------------------------------------------ rendering


def _label(r: dict) -> str:
    return f"sdc:{r['sdc_kind']}" if r["outcome"] == "sdc" else r["outcome"]


def _counts(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[_label(r)] = counts.get(_label(r), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _tail_loss(losses: list[float], n: int = 100) -> float:
    return statistics.fmean(losses[-n:])


def _by_seed(c: dict) -> dict[int, dict]:
    return {r["fault_seed"]: r for r in c["rows"]}


def nvdla_block(plain: dict, swz: dict, cells: dict, metric: str) -> tuple[str, dict]:
    """The per-cell table of a pair of NVDLA campaigns (``metric``: acc or loss) and its facts."""
    ref = plain["refs"][plain["spec"].inject_steps[0]]
    ps, ss = _by_seed(plain), _by_seed(swz)
    seeds = [r["fault_seed"] for r in plain["rows"]]
    lines = []

    def cell(r, present: bool) -> str:
        if metric == "acc":
            acc, loss = (r["val_acc_fault"], r["val_loss_fault"]) if present else (r["val_acc"], r["val_loss"])
            return f"{_f(acc)} ({_f(loss)})"
        loss = r["val_loss_fault"] if present else r["val_loss"]
        return _f(loss) if present else f"{_f(loss)} ({r['val_delta']:+.3f})"

    for k in seeds:
        p, w = ps[k], ss.get(k)
        row = [f"({cells[k][0]}, {cells[k][1]})", cell(p, True), cell(p, False)]
        if metric == "loss":
            row.append(_label(p))
        row += [cell(w, True), cell(w, False)] if w else ["–", "–"]
        if metric == "loss":
            row.append(_label(w) if w else "–")
        lines.append(row)
    rows_p, rows_s = plain["rows"], [ss[k] for k in seeds if k in ss]

    def mean_cell(rs, present: bool) -> str:
        if metric == "acc":
            keys = ("val_acc_fault", "val_loss_fault") if present else ("val_acc", "val_loss")
            return f"**{_f(_mean(r[keys[0]] for r in rs))} ({_f(_mean(r[keys[1]] for r in rs))})**"
        if present:
            return f"**{_f(_mean(r['val_loss_fault'] for r in rs))}**"
        return f"**{_f(_mean(r['val_loss'] for r in rs))} ({_mean(r['val_delta'] for r in rs):+.3f})**"

    n_sdc = lambda rs: sum(r["outcome"] == "sdc" for r in rs)  # noqa: E731
    mean = [f"**mean of {len(seeds)}**", mean_cell(rows_p, True), mean_cell(rows_p, False)]
    if metric == "loss":
        mean.append(f"{n_sdc(rows_p)} sdc")
    mean += [mean_cell(rows_s, True), mean_cell(rows_s, False)]
    if metric == "loss":
        mean.append(f"{n_sdc(rows_s)} sdc")
    lines.append(mean)
    if metric == "acc":
        headers = [
            "cell (a, b)",
            "plain: fault present",
            "plain: fault removed",
            "swizzled: present",
            "swizzled: removed",
        ]
    else:
        headers = ["cell (a, b)", "plain: fault present", "plain: fault removed (Δ)", "outcome"]
        headers += ["swizzled: present", "swizzled: removed (Δ)", "outcome"]
    base = plain["baselines"]
    th = plain["thresholds"][plain["spec"].inject_steps[0]]
    facts = {
        "golden_acc": ref["val_acc"],
        "golden_loss": ref["val_loss"],
        "healthy": [(b["seed"], b["val_acc"], b["val_loss"], b["val_delta"]) for b in base],
        "bound_val_delta": th["val_delta"],
        "bound_dist": th["dist_golden"],
        "dist_faulty": [r["dist_golden"] for r in rows_p + rows_s if r["dist_golden"] is not None],
        "dist_healthy": [b["dist_golden"] for b in base],
        "outcomes_plain": _counts(rows_p),
        "outcomes_swizzled": _counts(rows_s),
        "delta_plain": [r["val_delta"] for r in rows_p],
        "delta_swizzled": [r["val_delta"] for r in rows_s],
        "present_minus_golden_plain": [r["val_loss_fault"] - ref["val_loss"] for r in rows_p],
        "present_minus_golden_swizzled": [r["val_loss_fault"] - ref["val_loss"] for r in rows_s],
        "acc_present": [r["val_acc_fault"] for r in rows_p + rows_s],
        "acc_removed": [r["val_acc"] for r in rows_p + rows_s],
    }
    return _table(headers, lines), facts


def nvdla_facts_text(name: str, plain: dict, swz: dict, facts: dict) -> str:
    h = ", ".join(
        f"{_f(a)} (loss {_f(lo)})" if a is not None else f"{_f(lo)} (Δ {d:+.3f})" for _, a, lo, d in facts["healthy"]
    )
    golden = (
        f"{_f(facts['golden_acc'])} (loss {_f(facts['golden_loss'])})"
        if facts["golden_acc"]
        else _f(facts["golden_loss"])
    )
    lines = [
        f"- Golden (fault-free) run: {golden}; the {len(facts['healthy'])} healthy runs re-seeded from the "
        f"injection snapshot: {h}.",
        f"- Outcomes: plain {facts['outcomes_plain']}; swizzled {facts['outcomes_swizzled']}.",
        f"- Healthy-spread bounds: Δ validation loss {_f(facts['bound_val_delta'])}, parameter distance to golden "
        f"{_f(facts['bound_dist'])}. Faulty runs' distance to golden: {_f(min(facts['dist_faulty']))}–"
        f"{_f(max(facts['dist_faulty']))}; healthy re-seeded runs: {_f(min(facts['dist_healthy']))}–"
        f"{_f(max(facts['dist_healthy']))}.",
    ]
    g = load_golden_losses(plain["dir"])
    span = lambda xs: f"{_f(min(xs))}–{_f(max(xs))}"  # noqa: E731
    tail = lambda c: [_tail_loss(r["losses"]) for r in c["rows"]]  # noqa: E731
    hl = [_tail_loss(b["losses"]) for b in plain["baselines"]]
    lines.append(
        f"- Mean training loss over the last 100 steps: golden {_f(_tail_loss(g))}, healthy {span(hl)}, "
        f"plain faulty {span(tail(plain))}, swizzled faulty {span(tail(swz))}."
    )
    return "\n".join(lines)


def load_golden_losses(directory: Path) -> list[float]:
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import ResultsDB

    with ResultsDB(directory / "results.sqlite", load_campaign(directory / "campaign.yaml")) as db:
        return db.golden_losses()


def gap_block(curve: dict, row: dict, cells: dict) -> str:
    cell = cells[row["fault_seed"]]
    same = (curve["present"][-1], curve["removed"][-1]) == (row["val_loss_fault"], row["val_loss"])
    table = _table(
        ["steps after injection", *map(str, curve["steps"])],
        [
            ["fault present", *(_f(v) for v in curve["present"])],
            ["fault removed", *(_f(v) for v in curve["removed"])],
            ["gap", *(f"{r - p:+.3f}" for p, r in zip(curve["present"], curve["removed"]))],
        ],
    )
    return (
        f"Trial {row['trial_id']}, cell ({cell[0]}, {cell[1]}), the plain trial with the largest Δ. "
        f"The re-run {'reproduces' if same else 'does NOT reproduce'} the campaign row "
        f"({_f(row['val_loss_fault'], 4)} / {_f(row['val_loss'], 4)}) at the end.\n\n{table}"
    )


def bits_block(c: dict) -> tuple[str, str, dict]:
    from sdcscope.study.stats import pvf_table

    rows, lines, groups = c["rows"], [], {}
    for field, bits in FIELDS:
        sites = ("forward", "dX", "dW") if field != "31 (sign)" else ("each",)
        for site in sites:
            rs = [r for r in rows if r["bit"] in bits and (site == "each" or SITE_NAMES[r["site"]] == site)]
            if not rs:
                continue
            groups[(field, site)] = rs
            d = [r["dist_golden"] for r in rs if r["dist_golden"] is not None]
            v = [abs(r["val_delta"]) for r in rs if r["val_delta"] is not None]
            count = lambda o: sum(1 for r in rs if r["effect"] == o)  # noqa: E731
            lines.append(
                [field, site, len(rs), count("masked"), count("benign"), count("sdc"), count("crash")]
                + [sum(1 for r in rs if r["drift_twin"]), _g(statistics.median(d)) if d else "–"]
                + [_g(max(d)) if d else "–", _g(max(v)) if v else "–"]
            )
    headers = ["bits", "site", "trials", "masked", "benign", "sdc", "crash", "beyond chaos envelope"]
    headers += ["median param distance", "max param distance", "max \\|Δ val loss\\|"]
    th = c["thresholds"][c["spec"].inject_steps[0]]
    pvf = pvf_table(rows, ("site",))
    facts = (
        f"Outcomes: {_counts(rows)}. Healthy-spread bounds: {_g(th['val_delta'])} on the validation-loss change, "
        f"{_g(th['dist_golden'])} on the parameter distance and {_g(th['loss_excess'])} on the largest per-step "
        f"loss excess (K = {len(c['spec'].baseline.seeds)} seeds). PVF per site: "
        + "; ".join(f"{p['site']} {p['incorrect']}/{p['trials']} [{p['lo']:.3f}, {p['hi']:.3f}]" for p in pvf)
        + "."
    )
    return _table(headers, lines), facts, groups


def drift_block(cs: dict[str, dict]) -> str:
    lines = []
    for name, c in cs.items():
        rs = [r for r in c["rows"] if r["effect"] != "not_fired"]
        d = [r["dist_golden"] for r in rs if r["dist_golden"] is not None]
        f = [r["disagree_final"] for r in rs if r["disagree_final"] is not None]
        h = [b["dist_golden"] for b in c["baselines"]]
        hf = [b["disagree"][-1] for b in c["baselines"] if b["disagree"]]
        twins = [t["drift_twin"] for t in c.get("twins", []) if t["drift_twin"] is not None]
        lines.append(
            [f"`{name}`", len(rs), sum(1 for r in rs if r["drift_twin"]), sum(1 for r in rs if r["drift_spread"])]
            + [f"{sum(twins)}/{len(twins)}" if twins else "no twins"]
            + [f"{_g(min(d))}–{_g(max(d))}" if d else "–", f"{_g(min(h))}–{_g(max(h))}"]
            + [f"{_g(min(f))}–{_g(max(f))}" if f else "not measured", f"{_g(min(hf))}–{_g(max(hf))}" if hf else "–"]
        )
    headers = ["campaign", "trials", "beyond chaos envelope", "beyond re-seed spread", "twins' false drift"]
    headers += ["weight distance to twin", "healthy re-seeded", "prediction disagreement", "healthy re-seeded"]
    return _table(headers, lines)


# ------------------------------------------------------------------------------------- findings


def findings(cs: dict[str, dict], gap_curve_: dict | None) -> list[tuple[str, str, bool]]:
    """(id, claim, holds) of every finding RESULTS.md states, measured on these results."""
    empty = {"rows": [], "refs": {0: {"val_acc": 0.0, "val_loss": 0.0}}, "thresholds": {0: {"val_delta": 0.0}}}
    cs = {n: cs.get(n, empty) for n in CAMPAIGNS}
    cnn = [r for n in ("nvdla_cnn", "nvdla_cnn_swizzled") for r in cs[n]["rows"]]
    cnn_ref = cs["nvdla_cnn"]["refs"][0]
    gp, gs = cs["nvdla_gpt"]["rows"], cs["nvdla_gpt_swizzled"]["rows"]
    g_ref, g_th = cs["nvdla_gpt"]["refs"][0], cs["nvdla_gpt"]["thresholds"][0]
    removed_p, removed_s = _mean(r["val_loss"] for r in gp) or 0, _mean(r["val_loss"] for r in gs) or 0
    present_p, present_s = _mean(r["val_loss_fault"] for r in gp) or 0, _mean(r["val_loss_fault"] for r in gs) or 0
    gaps = [r - p for p, r in zip(gap_curve_["present"], gap_curve_["removed"])] if gap_curve_ else [0.0]
    bits = cs["gpt_bits"]["rows"]
    mant = [r for r in bits if r["bit"] <= 22 and r["dist_golden"] is not None]
    expo = [r for r in bits if 23 <= r["bit"] <= 30 and r["dist_golden"] is not None]
    med = lambda rs: statistics.median(r["dist_golden"] for r in rs) if rs else 0.0  # noqa: E731
    return [
        (
            "a1",
            "CNN: no trial crashes or is masked (a stuck cell in every layer always changes the run)",
            all(r["effect"] in ("benign", "sdc") for r in cnn),
        ),
        (
            "a2",
            "CNN: with the fault present, mean accuracy is within 0.05 of golden's",
            abs((_mean(r["val_acc_fault"] for r in cnn) or 0) - cnn_ref["val_acc"]) < 0.05,
        ),
        (
            "a3",
            "CNN: with the fault removed, mean accuracy is within 0.05 of golden's (no collapse)",
            abs((_mean(r["val_acc"] for r in cnn) or 0) - cnn_ref["val_acc"]) < 0.05,
        ),
        (
            "a4",
            "CNN: every trial's weights end beyond the chaos envelope (perturbation twins), none beyond the "
            "re-seed spread",
            all(r["drift_twin"] == 1 and r["drift_spread"] == 0 for r in cnn),
        ),
        (
            "b1",
            "GPT plain: the model comes to depend on the fault: with it removed the validation loss is worse "
            "than with it present (mean gap > 0), by 10^-3 to 10^0 nats",
            0.001 <= removed_p - present_p < 1,
        ),
        (
            "b2",
            "GPT plain: with the fault present the loss is within the healthy bound of golden's",
            abs(present_p - g_ref["val_loss"]) <= g_th["val_delta"],
        ),
        (
            "b3",
            "GPT: swizzling removes that dependence (mean gap, removed − present: swizzled < plain)",
            removed_s - present_s < removed_p - present_p,
        ),
        (
            "b4",
            "GPT: swizzled training costs while the fault is present (mean loss, fault present: swizzled > plain)",
            present_s > present_p,
        ),
        (
            "b5",
            "GPT plain, worst cell: the gap (removed − present) is positive at the end and grows over the run",
            gaps[-1] > 0 and gaps[-1] > gaps[0],
        ),
        (
            "c1",
            "bits: no crash; masked trials only among mantissa bits",
            all(r["effect"] != "crash" for r in bits) and all(r["bit"] <= 22 for r in bits if r["effect"] == "masked"),
        ),
        (
            "c2",
            "bits: exponent flips move the parameters at least 10x more than mantissa flips (median)",
            med(expo) >= 10 * med(mant) > 0,
        ),
        (
            "c3",
            "bits: no single flip takes the weights beyond the re-seed spread",
            all(not r["drift_spread"] for r in bits),
        ),
        (
            "c4",
            "bits: some exponent flips move the weights beyond the chaos envelope (perturbation twins); no "
            "one-ulp flip (bit 0) does",
            any(r["drift_twin"] for r in expo) and not any(r["drift_twin"] for r in mant if r["bit"] == 0),
        ),
    ]


# ---------------------------------------------------------------------------------------- main

MARK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?:.*?\n)?(<!-- end: (?P=name) -->)", re.S)


def fill(template: str, blocks: dict[str, str]) -> str:
    """``template`` with each generated block replaced; every block must have its marker."""
    names = {m.group("name") for m in MARK.finditer(template)}
    if names != set(blocks):
        raise ValueError(f"RESULTS.md blocks {sorted(names)} differ from the generated {sorted(blocks)}")
    return MARK.sub(lambda m: m.group(1) + blocks[m.group("name")] + "\n" + m.group(3), template)
