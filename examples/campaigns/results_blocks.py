"""The generated blocks of examples/campaigns/RESULTS.md and the findings its text states, from
finished campaigns (``load`` of regenerate.py: rows, baselines, references, thresholds).

Each block is a Markdown table or a list of measured facts; ``fill`` writes them between the
``<!-- generated: NAME -->`` / ``<!-- end: NAME -->`` markers of the document; ``check`` compares the
blocks of two documents (a committed one and a regenerated one). The findings are measured in
results_findings.py.
"""

from __future__ import annotations

import math
import re
import statistics
from itertools import zip_longest
from pathlib import Path

CAMPAIGNS = ("gpt_bits", "nvdla_cnn", "nvdla_gpt", "nvdla_cnn_noisy", "nodes_gpt")

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


def nvdla_block(plains: list[dict], swzs: list[dict], cells: dict, metric: str) -> tuple[str, dict]:
    """The per-cell table of a pair of NVDLA campaigns (``metric``: acc or loss), one pair of folders
    per training seed (a seed column when there are several), and its facts."""
    seeded = len(plains) > 1
    lines, rows_p, rows_s = [], [], []

    def cell(r, present: bool) -> str:
        if metric == "acc":
            acc, loss = (r["val_acc_fault"], r["val_loss_fault"]) if present else (r["val_acc"], r["val_loss"])
            return f"{_f(acc)} ({_f(loss)})"
        loss = r["val_loss_fault"] if present else r["val_loss"]
        return _f(loss) if present else f"{_f(loss)} ({r['val_delta']:+.3f})"

    for plain, swz in zip(plains, swzs):
        ss = _by_seed(swz)
        for p in plain["rows"]:
            k, w = p["fault_seed"], ss.get(p["fault_seed"])
            row = ([plain["spec"].seed] if seeded else []) + [f"({cells[k][0]}, {cells[k][1]})"]
            row += [cell(p, True), cell(p, False)] + ([_label(p)] if metric == "loss" else [])
            row += [cell(w, True), cell(w, False)] if w else ["–", "–"]
            row += [_label(w) if w else "–"] if metric == "loss" else []
            lines.append(row)
            rows_p.append(p)
            rows_s += [w] if w else []

    def mean_cell(rs, present: bool) -> str:
        if metric == "acc":
            keys = ("val_acc_fault", "val_loss_fault") if present else ("val_acc", "val_loss")
            return f"**{_f(_mean(r[keys[0]] for r in rs))} ({_f(_mean(r[keys[1]] for r in rs))})**"
        if present:
            return f"**{_f(_mean(r['val_loss_fault'] for r in rs))}**"
        return f"**{_f(_mean(r['val_loss'] for r in rs))} ({_mean(r['val_delta'] for r in rs):+.3f})**"

    n_sdc = lambda rs: sum(r["outcome"] == "sdc" for r in rs)  # noqa: E731
    mean = ([""] if seeded else []) + [f"**mean of {len(rows_p)}**", mean_cell(rows_p, True), mean_cell(rows_p, False)]
    mean += [f"{n_sdc(rows_p)} sdc"] if metric == "loss" else []
    mean += [mean_cell(rows_s, True), mean_cell(rows_s, False)]
    mean += [f"{n_sdc(rows_s)} sdc"] if metric == "loss" else []
    lines.append(mean)
    headers = ["training seed"] if seeded else []
    if metric == "acc":
        headers += ["cell (a, b)", "plain: fault present", "plain: fault removed", "swizzled: present"]
        headers += ["swizzled: removed"]
    else:
        headers += ["cell (a, b)", "plain: fault present", "plain: fault removed (Δ)", "outcome"]
        headers += ["swizzled: present", "swizzled: removed (Δ)", "outcome"]
    facts = {
        "golden": [(c["spec"].seed, c["refs"][c["spec"].inject_steps[0]]) for c in plains],
        "healthy": [
            (c["spec"].seed, [(b["val_acc"], b["val_loss"], b["val_delta"]) for b in c["baselines"]]) for c in plains
        ],
        "bounds": [(c["spec"].seed, c["thresholds"][c["spec"].inject_steps[0]]) for c in plains],
        "dist_faulty": [r["dist_golden"] for r in rows_p + rows_s if r["dist_golden"] is not None],
        "dist_healthy": [b["dist_golden"] for c in plains for b in c["baselines"]],
        "outcomes_plain": _counts(rows_p),
        "outcomes_swizzled": _counts(rows_s),
    }
    return _table(headers, lines), facts


def nvdla_facts_text(name: str, plains: list[dict], swzs: list[dict], facts: dict) -> str:
    seeded = len(plains) > 1
    golden, healthy, bounds = [], [], []
    for (seed, ref), (_, hs), (_, th) in zip(facts["golden"], facts["healthy"], facts["bounds"]):
        at = f"seed {seed}: " if seeded else ""
        golden.append(
            at + (f"{_f(ref['val_acc'])} (loss {_f(ref['val_loss'])})" if name == "cnn" else _f(ref["val_loss"]))
        )
        healthy.append(
            at + ", ".join(f"{_f(a)} (loss {_f(lo)})" if name == "cnn" else f"{_f(lo)} (Δ {d:+.3f})" for a, lo, d in hs)
        )
        bounds.append(
            at + f"Δ validation loss {_f(th['val_delta'])}, parameter distance to golden {_f(th['dist_golden'])}"
        )
    k = len(facts["healthy"][0][1])
    lines = [
        f"- Golden (fault-free) run: {'; '.join(golden)}. The {k} healthy runs re-seeded from the injection "
        f"snapshot: {'; '.join(healthy)}.",
        f"- Outcomes: plain {facts['outcomes_plain']}; swizzled {facts['outcomes_swizzled']}.",
        f"- Healthy-spread bounds: {'; '.join(bounds)}. Faulty runs' distance to golden: "
        f"{_f(min(facts['dist_faulty']))}–{_f(max(facts['dist_faulty']))}; healthy re-seeded runs: "
        f"{_f(min(facts['dist_healthy']))}–{_f(max(facts['dist_healthy']))}.",
    ]
    span = lambda xs: f"{_f(min(xs))}–{_f(max(xs))}"  # noqa: E731
    tail = lambda cs: [_tail_loss(r["losses"]) for c in cs for r in c["rows"]]  # noqa: E731
    g = [_tail_loss(load_golden_losses(c["dir"])) for c in plains]
    hl = [_tail_loss(b["losses"]) for c in plains for b in c["baselines"]]
    lines.append(
        f"- Mean training loss over the last 100 steps: golden {span(g) if seeded else _f(g[0])}, healthy "
        f"{span(hl)}, plain faulty {span(tail(plains))}, swizzled faulty {span(tail(swzs))}."
    )
    return "\n".join(lines)


def load_golden_losses(directory: Path) -> list[float]:
    from sdcscope.study.spec import load_campaign
    from sdcscope.study.store import ResultsDB

    with ResultsDB(directory / "results.sqlite", load_campaign(directory / "campaign.yaml")) as db:
        return db.golden_losses()


def gap_block(curve: dict, row: dict, cells: dict, seed: int) -> str:
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
        f"Training seed {seed}, trial {row['trial_id']}, cell ({cell[0]}, {cell[1]}), the plain trial with the "
        "largest Δ. "
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


def nodes_block(c: dict) -> str:
    """The three levels per node profile (the campaign's report table, sdcscope.study.nodes) and the
    healthy nodes' line: how many perturbation twins end beyond the envelope of the others."""
    from sdcscope.study.nodes import LEVEL_COLUMNS, level_rows, profile_levels

    rows = level_rows(profile_levels(c["rows"], c["thresholds"]))
    cells = [[_g(v) if isinstance(v, float) else "–" if v is None else v for v in r] for r in rows]
    twins = [t["drift_twin"] for t in c["twins"] if t["drift_twin"] is not None]
    spec = c["spec"]
    return (
        _table(LEVEL_COLUMNS, cells)
        + f"\n\nInjection at step {spec.inject_steps[0]}, {spec.horizon} steps after it, training seed {spec.seed}. "
        f"Healthy nodes: {sum(twins)}/{len(twins)} perturbation twins end beyond the chaos envelope of the "
        "others (the false-drift rate)."
    )


# ---------------------------------------------------------------------------------------- main

MARK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?:.*?\n)?(<!-- end: (?P=name) -->)", re.S)


def fill(template: str, blocks: dict[str, str]) -> str:
    """``template`` with each generated block replaced; every block must have its marker."""
    names = {m.group("name") for m in MARK.finditer(template)}
    if names != set(blocks):
        raise ValueError(f"RESULTS.md blocks {sorted(names)} differ from the generated {sorted(blocks)}")
    return MARK.sub(lambda m: m.group(1) + blocks[m.group("name")] + "\n" + m.group(3), template)


UNCHECKED = ("provenance",)
"""Blocks that differ between runs of the same specs (wall times, date, load): never compared."""


def blocks(text: str) -> dict[str, str]:
    """Each generated block of a document, by name (its text between the markers)."""
    return {m.group("name"): m.group(0)[len(m.group(1)) : -len(m.group(3))] for m in MARK.finditer(text)}


def blocks_only(text: str) -> str:
    """The compared blocks of ``text`` with their markers and without the prose: what a committed
    reference of the shrunken specs holds."""
    return "\n".join(
        f"<!-- generated: {n} -->\n{b}<!-- end: {n} -->\n" for n, b in blocks(text).items() if n not in UNCHECKED
    )


def check(committed: str, regenerated: str) -> list[str]:
    """One line per generated block whose committed text is not what the regeneration wrote (runs are
    bit-reproducible, so every number must match exactly; UNCHECKED blocks left out): [] when every
    committed number regenerates."""
    a, b = blocks(committed), blocks(regenerated)
    out = []
    for name in sorted((set(a) | set(b)) - set(UNCHECKED)):
        if name not in a or name not in b:
            out.append(f"{name}: only in the {'regenerated' if name in b else 'committed'} document")
            continue
        pairs = list(zip_longest(a[name].splitlines(), b[name].splitlines(), fillvalue="(none)"))
        diff = next(((x, y) for x, y in pairs if x != y), None)
        if diff:
            out.append(f"{name}: committed {diff[0]!r} but regenerated {diff[1]!r}")
    return out
