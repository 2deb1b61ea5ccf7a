"""The gist of an invariant violation's evidence in one short line, for tables and logs.

Each relation's ``check`` returns its own evidence (a flat dict; see the relations).  This reads
the facts they record, the most telling first, and otherwise lists the facts as ``key=value``:
any evidence prints, because a violation a table cannot print would hide the violation.
"""

from __future__ import annotations

from typing import Any

META = frozenset({"relation", "phase", "description"})
"""Evidence fields every violation has (the full record is in events.jsonl)."""
VALUE_FIELDS = ("value", "step_loss", "share")
"""Fields holding the value a ``bounds`` judged: a metric or call field, a step loss, a share."""


def few(items: list, total: int | None = None) -> str:
    """The first three items and how many more there are."""
    total = len(items) if total is None else total
    return ", ".join(map(str, items[:3])) + (f" (+{total - 3})" if total > 3 else "")


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def summarize(ev: dict[str, Any]) -> str:
    """One line saying what the violation was (``ev``: an event's ``evidence``)."""
    if ev.get("meaning"):
        return str(ev["meaning"])
    if ev.get("missing"):
        return f"missing: {few(ev['missing'], ev.get('n_missing'))}"
    if ev.get("extra"):
        return f"unexpected: {few(ev['extra'], ev.get('n_extra'))}"
    if "recent_mean" in ev:
        start = "the references' start" if ev.get("resumed") else "the run's first steps"
        return (
            f"loss {_num(ev['recent_mean'])} over {ev.get('window', '?')} steps is {_num(ev.get('ratio'))} x "
            f"{start} ({_num(ev.get('first_mean'))}), not below {_num(ev.get('max_ratio'))} x"
        )
    if "bounds" in ev and len(ev["bounds"]) == 2:
        value = next((ev[k] for k in VALUE_FIELDS if k in ev), "?")
        lo, hi = ev["bounds"]
        return f"{_num(value)} outside [{_num(lo)}, {_num(hi)}]"
    if "expected_ratio" in ev:
        return f"expected ratio {_num(ev['expected_ratio'])}, observed {ev.get('observed_ratio', ev.get('observed'))}"
    if "first_value" in ev:
        return (
            f"{ev.get('metric', 'value')} {_num(ev.get('value'))} is worse ({ev.get('direction')}) than "
            f"{_num(ev['first_value'])} at the first evaluation (step {ev.get('first_step')})"
        )
    if "observed" in ev:
        seen = few(ev["observed"]) if isinstance(ev["observed"], list) else ev["observed"]
        return f"expected {ev.get('expected')}, observed {seen}"
    if "first_seen_step" in ev:
        return f"same value as at step {ev['first_seen_step']}"
    if ev.get("differing"):
        return f"{ev.get('n_differing')}/{ev.get('n_pairs')} pairs differ: {' != '.join(map(str, ev['differing'][0]))}"
    if ev.get("written_outside_optimizer_step"):
        return f"written outside optimizer.step: {few(ev['written_outside_optimizer_step'], ev.get('n_written'))}"
    return ", ".join(f"{k}={_num(v)}" for k, v in ev.items() if k not in META)
