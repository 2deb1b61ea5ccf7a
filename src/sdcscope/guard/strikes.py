"""Strikes: the guard's findings in one process go to the device ledger, and repeats escalate.

Every finding of a step (after its replay verdict) is noted in the
:class:`~sdcscope.localize.ledger.Ledger` against this process's device and the finding's site.
A site met ``strikes`` times within ``window`` steps, or a device with ``max_suspicions``
suspicions, turns the finding's verdict into ``persistent``: the policy's ``*:persistent`` rule
answers it (by default a veto -- or, for corrupted state, a rollback -- and ``quarantine``, which
in one process is a clean stop), so a recurring fault never gets more than ``strikes - 1``
recomputes. Any suspicion also asks ABFT for full coverage over the next ``cooldown`` steps.
Under DDP the rank guard's :class:`~sdcscope.localize.ranks.RankLedger` does the same per rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sdcscope.detect import Event
from sdcscope.detect.state import MAX_NAMED
from sdcscope.localize.ledger import LEDGER_FILE, Ledger, LedgerConfig, device_id

if TYPE_CHECKING:
    from sdcscope.guard.guard import Guard

log = logging.getLogger("sdcscope.guard.strikes")


class Strikes:
    """The ledger of a single-process guard (``ledger``: the file; default ``run_dir/ledger.json``,
    written once there is a finding; neither: kept in memory)."""

    def __init__(
        self, guard: Guard, config: LedgerConfig, *, run_dir: str | Path | None, ledger: str | Path | None
    ) -> None:
        self.guard, self.config = guard, config
        path = Path(ledger) if ledger is not None else None if run_dir is None else Path(run_dir) / LEDGER_FILE
        self.ledger = Ledger(path, config, entries=Ledger.read(path))
        device = next((p.device for p in guard.model.parameters()), None)
        self.device = device_id(device)
        self.known_faulty = self.ledger.faulty(self.device)
        if self.known_faulty:
            reason = self.ledger.entries[self.device].get("reason")
            log.warning("ledger %s already calls device %s faulty (%s)", path, self.device, reason)

    def judge(self, events: list[Event], clock: int) -> None:
        """Note ``events`` (their replay verdicts set) in the ledger; a repeat at one site, or a
        device found faulty, makes a finding ``persistent``."""
        for e in events:
            note = self.ledger.note(self.device, e, when=clock)
            if not note.suspicion:
                continue
            evidence: dict[str, Any] = {
                "device": self.device,
                "site": note.site,
                "strikes": note.strikes,
                "of": self.config.strikes,
            }
            faulty = self.ledger.faulty(self.device) and not self.known_faulty
            if (note.persistent or faulty) and e.verdict != "persistent":
                evidence["why"] = (
                    f"{note.strikes} findings at this site within {self.config.window} steps"
                    if note.persistent
                    else f"device faulty: {self.ledger.entries[self.device]['reason']}"
                )
                e.evidence = {**e.evidence, "finding": e.evidence.get("finding", e.verdict)}
                e.verdict = "persistent"
            e.evidence = {**e.evidence, "ledger": evidence}

    def stop_reason(self, event: Event) -> str:
        """Why the ledger stops the run, as the ledger has it: a site it marks persistent (its
        strikes), else the device it calls faulty (its reason) with the finding that tipped it."""
        noted = event.evidence.get("ledger") or {}
        site = noted.get("site")
        entry = self.ledger.entries.get(self.device, {})
        record = entry.get("sites", {}).get(site) if site else None
        finding = f"{event.detector}: {event.verdict}"
        if record is not None and record.get("persistent"):
            return (
                f"persistent fault at {site} on device {self.device} ({finding}, {noted.get('strikes')} "
                f"strikes within {self.config.window} steps)"
            )
        where = f" at {site}" if site else f" in {event.module}" if event.module else ""
        if entry.get("faulty"):
            return f"device {self.device} is faulty ({entry.get('reason')}); the last finding: {finding}{where}"
        return f"{finding}{where} on device {self.device}: the policy stops training"


def escalate(guard: Guard, steps: int) -> None:
    """Ask ABFT for full coverage over the next ``steps`` steps (a replay of this step included)."""
    fn = getattr(guard.abft, "escalate", None)
    if steps > 0 and callable(fn):
        guard.safe(lambda: fn(steps), "abft escalate")


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def name_from_snapshot(guard: Guard, events: list[Event]) -> None:
    """Name every corrupted element of the blocks a state-checksum event could only give as a range
    (several words changed in one block: a row fault), when the latest snapshot holds the very state
    the checksums were recorded from (no update since it: right after a snapshot or a rollback)."""
    state, session = guard.ring.latest(), guard.session
    if state is None or session.progress.since_snapshot != 0:
        return
    params = dict(guard.model.named_parameters())
    order = {id(p): i for i, p in enumerate(p for group in guard.optimizer.param_groups for p in group["params"])}
    for e in events:
        ev = e.evidence
        if e.detector != "state_checksum" or not ev.get("blocks") or len(ev["blocks"]) >= MAX_NAMED:
            continue
        name, _, key = ev["tensor"].partition(":")
        p = params.get(name)
        if p is None:
            continue
        if key:
            ref, now = state.optimizer["state"].get(order.get(id(p)), {}).get(key), guard.optimizer.state[p].get(key)
        else:
            ref, now = state.model.get(name), p
        if not isinstance(ref, torch.Tensor) or now is None or ref.shape != now.shape or ref.dtype != now.dtype:
            continue
        ints = _BITS.get(now.element_size())
        if ints is None or now.dtype == torch.bool:
            continue
        a, b = now.detach().reshape(-1).view(ints), ref.reshape(-1).view(ints).to(now.device)
        found = torch.cat([(a[lo:hi] != b[lo:hi]).nonzero().flatten() + lo for lo, hi in ev["blocks"]])
        elements = found.tolist()
        flipped = torch.bitwise_xor(a[found], b[found]).tolist()
        bits = sorted({k for x in flipped for k in range(8 * now.element_size()) if (x >> k) & 1})
        kept = {k: v for k, v in ev.items() if k != "note"}
        e.evidence = {**kept, "elements": elements[:MAX_NAMED], "corrupted_elements": len(elements), "bits": bits}
        e.evidence["named_by"] = f"comparison with the snapshot of step {state.step}"
