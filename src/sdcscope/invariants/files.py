"""Invariant files: a YAML list a person can read and edit, validated strictly on load.

Each entry::

    - id: contain.optimizer.step.update         # the verdict events carry; unique
      relation: EventContain                    # a registered relation
      params: {parent: optimizer.step, child: update, tensors: ['*']}
      precondition: {phase: train, when: [optimizer.step]}
      description: optimizer.step changes every parameter in *
      support: 118                              # reference observations (informational)

Deleting an entry disables it; bounds, values and patterns can be edited.  Loading rejects an
unknown relation (listing the known ones), unknown keys and malformed params; patterns that
match nothing are rejected when the invariants are bound to a model or a trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from sdcscope.common.io import load_yaml, read_text
from sdcscope.invariants.relations import validate_invariant
from sdcscope.invariants.spec import Invariant, Precondition

ENTRY_KEYS = ("id", "relation", "params", "precondition", "description", "support")


def parse_invariants(data: Any, source: str = "<invariants>") -> list[Invariant]:
    if not isinstance(data, list):
        raise ValueError(f"{source}: expected a YAML list of invariants, got {type(data).__name__}")
    out: list[Invariant] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{source}: invariant #{i + 1}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping, not {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(ENTRY_KEYS)}")
        if "relation" not in entry:
            raise ValueError(f"{where} has no 'relation'")
        try:
            inv = Invariant(
                id=str(entry.get("id") or f"{entry['relation']}.{i + 1}"),
                relation=entry["relation"],
                params=entry.get("params") or {},
                precondition=Precondition.from_dict(entry.get("precondition")),
                description=str(entry.get("description", "")),
                support=int(entry.get("support", 0)),
            )
            validate_invariant(inv)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where} ({entry.get('id', entry['relation'])}): {exc}") from None
        if inv.id in seen:
            raise ValueError(f"{where}: duplicate id {inv.id!r}")
        seen.add(inv.id)
        out.append(inv)
    return out


def load_invariants(path: str | Path) -> list[Invariant]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"invariants file {str(path)!r} does not exist")
    invariants = parse_invariants(load_yaml(read_text(path), repr(str(path))), str(path))
    if not invariants:  # a check of nothing would pass every run
        raise ValueError(
            f"invariants file {str(path)!r} holds no invariants; give at least one "
            "(sdcscope invariants infer writes them)"
        )
    return invariants


def save_invariants(invariants: Iterable[Invariant], path: str | Path, sources: Iterable[str] = ()) -> Path:
    invariants = list(invariants)
    path = Path(path)
    lines = [f"# sdcscope invariants: {len(invariants)} inferred from clean run(s):"]
    lines += [f"#   {s}" for s in sources]
    lines += [
        "# Edit freely: delete an entry to disable it; bounds, values and patterns can be changed.",
        "# Check a run with `sdcscope invariants check --invariants FILE RUN_DIR`.",
        "",
    ]
    body = yaml.safe_dump([inv.to_dict() for inv in invariants], sort_keys=False, default_flow_style=None, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + body)
    return path
