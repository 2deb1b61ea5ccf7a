"""The device ledger: every finding keyed by device and site, persisted as ``ledger.json``.

One ledger serves every run -- a single process, data-parallel ranks, ``sdcscope screen`` -- so
that a fault which keeps coming back is judged as such instead of being repaired forever:

* a **site** is where a finding points: ``abft:<layer>:<gemm>:col=<c>`` (a GEMM's output
  column), ``state:<tensor>[<element>]`` (a stored weight or optimizer-state word),
  ``nonfinite:<layer>:<what>``, a rank guard's detector and module;
* ``strikes`` findings at one site within ``window`` steps make the site ``persistent``: a
  recurring fault gets fewer than ``strikes`` recomputes, then escalates (quarantine of a
  data-parallel rank, or a clean stop);
* ``max_suspicions`` suspicions on one device within ``window`` steps, or one persistent site,
  make the **device** ``faulty``; a ledger carried into a later job keeps it so, and a launcher
  or scheduler reads the file to exclude the node (``docs/guard.md`` documents the schema);
* ``cooldown``: steps of heightened ABFT coverage after each suspicion (the guard asks its ABFT
  detector to check every layer for that long).

Time is counted in steps begun (a rolled-back step that runs again is a new moment), so a fault
met again after a rollback counts again. Each suspicion and each conviction also carries its wall
time (UTC, ``time`` / ``since``), and a device entry what is known of the device itself
(``identity``: UUID and PCI bus id of a local GPU, the CPU model): the fleet history
(:mod:`sdcscope.localize.history`) keys its records by them, so a ledger carried into a later job
is not counted again there.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import platform
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from sdcscope.common.io import write_json
from sdcscope.common.validate import check_positive
from sdcscope.detect.events import Event

LEDGER_FILE = "ledger.json"
FORMAT = "sdcscope-ledger/2"
READABLE = ("sdcscope-ledger/1", FORMAT)
SUSPICIONS = (
    "nonfinite",
    "grad_outlier",
    "transient",
    "unverified",
    "ambiguous",
    "replica_mismatch",
    "reduce_mismatch",
    "corrupt",
    "checksum_mismatch",
)
"""Verdicts that count as a suspicion of the device (``persistent`` makes it faulty at once;
``correct_result`` and a reproducible non-finite value or spike are the data's doing). An ABFT
finding the replay reproduced (``abft`` + ``reproducible``) counts too: the GEMM fails its
checksum again on re-execution; so does ``ambiguous``, each of two replicas that accuse each other
(:func:`sdcscope.localize.ranks.settle_two_replicas`)."""
log = logging.getLogger("sdcscope.localize.ledger")


@dataclass(kw_only=True)
class LedgerConfig:
    max_suspicions: int = 3
    """Steps with a suspicion (see :data:`SUSPICIONS`) within ``window`` steps that make a device
    faulty; a ``persistent`` verdict or site does at once."""
    window: int = 10_000
    """Steps a finding is remembered for (strikes and suspicions older than this are forgiven)."""
    strikes: int = 3
    """Findings at one site within ``window`` steps that make the site ``persistent``."""
    cooldown: int = 50
    """Steps of full ABFT coverage after each suspicion (escalation; 0: none)."""

    def __post_init__(self) -> None:
        check_positive("max_suspicions", self.max_suspicions)
        check_positive("window", self.window)
        check_positive("strikes", self.strikes)
        if isinstance(self.cooldown, bool) or not isinstance(self.cooldown, int) or self.cooldown < 0:
            raise ValueError(f"cooldown={self.cooldown!r} must be an integer >= 0 (0: no escalation)")


def device_id(device: torch.device | str | None = None) -> str:
    """A device as the ledger knows it: ``host:cuda:i`` or ``host:cpu:local_rank``. Without
    ``device``: this process's (the current CUDA device once CUDA is initialized)."""
    host = socket.gethostname()
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return f"{host}:cuda:{index}"
        if device.type != "cpu":
            return f"{host}:{device.type}:{device.index or 0}"
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{host}:cuda:{torch.cuda.current_device()}"
    return f"{host}:cpu:{os.environ.get('LOCAL_RANK', '0')}"


def utc_now() -> str:
    """The current time as the ledger and the fleet history write it (UTC, ISO 8601 to the
    microsecond, ``Z``): two findings of one device are told apart by it."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def device_identity(device: str) -> dict[str, Any]:
    """What this process can tell of ``device`` (a ledger key, ``host:cuda:i``) beyond its index:
    a local GPU's UUID and PCI bus id, the CPU model of a CPU device; empty for a device of another
    host (a remote rank's) or one not visible here."""
    host, _, rest = device.partition(":")
    kind, _, index = rest.partition(":")
    if host != socket.gethostname():
        return {}
    if kind == "cpu":
        model = _cpu_model()
        return {"cpu": model} if model else {}
    if kind != "cuda" or not index.isdigit() or not torch.cuda.is_available():
        return {}
    if int(index) >= torch.cuda.device_count():
        return {}
    props = torch.cuda.get_device_properties(int(index))
    found: dict[str, Any] = {"name": props.name}
    if getattr(props, "uuid", None) is not None:
        found["uuid"] = f"GPU-{props.uuid}"
    if getattr(props, "pci_bus_id", None) is not None:
        domain, bus, dev = (getattr(props, k, 0) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        found["pci_bus_id"] = f"{domain:08X}:{bus:02X}:{dev:02X}.0"  # as nvidia-smi writes it
    return found


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def is_suspicion(event: Event) -> bool:
    return (
        event.verdict in SUSPICIONS
        or event.verdict == "persistent"
        or (event.detector in ("abft", "collectives") and event.verdict == "reproducible")
    )


def site_of(event: Event) -> str | None:
    """Where ``event`` points, as a ledger site key (None: no site, e.g. a loss spike)."""
    d, ev = event.detector, event.evidence
    if d == "abft":
        col = event.index[-1] if event.index else None
        return f"abft:{event.module}:{event.gemm}" + ("" if col is None else f":col={col}")
    if d == "state_checksum":
        elements = ev.get("elements") or []
        where = (
            f"[{elements[0]}]"
            if len(elements) == 1
            else f"[{ev['block'][0]}:{ev['block'][1]}]"
            if ev.get("block")
            else ""
        )
        return f"state:{ev.get('tensor', event.module)}{where}"
    if d == "nonfinite":
        return f"nonfinite:{event.module}:{ev.get('what')}"
    if d == "collectives":  # a link: the pair of ranks, the collective
        src = "*" if ev.get("src") is None else ev["src"]
        return f"link:{src}->{ev.get('dst')}:{ev.get('collective')}"
    if d in ("spike", "attention_logit", "guard", "quarantine"):
        return None
    return f"{d}:{event.module}" if event.module is not None else None


def _note_link(entry: dict[str, Any], event: Event) -> None:
    """A collective's link that failed: the pair (source rank -> destination rank), how often, and
    whom the topology suspects (``sender``, ``receiver`` or the ``link`` itself)."""
    ev = event.evidence
    pair = f"{'*' if ev.get('src') is None else ev['src']}->{ev.get('dst')}"
    link = entry.setdefault("links", {}).setdefault(
        pair, {"src": ev.get("src"), "dst": ev.get("dst"), "collectives": [], "count": 0, "steps": []}
    )
    link["count"] += 1
    link["steps"] = (link["steps"] + [event.step])[-16:]
    link["suspect"] = ev.get("suspect", "receiver")
    if ev.get("collective") not in link["collectives"]:
        link["collectives"].append(ev.get("collective"))


@dataclass
class Note:
    """What the ledger made of one finding."""

    suspicion: bool = False
    site: str | None = None
    strikes: int = 0  # findings at the site within the window, this one included
    persistent: bool = False  # the site reached ``strikes`` (or the verdict says so)
    became_faulty: bool = False  # this finding made the device faulty


def _new_entry(rank: int | None) -> dict[str, Any]:
    return {"rank": rank, "faulty": False, "reason": None, "suspicions": [], "sites": {}}


def _convict(entry: dict[str, Any], reason: str | None, by: str) -> None:
    """Mark ``entry`` faulty, with when (``since``) and by what (``by``: the guard's ``ledger``, a
    ``screen``, an ``operator``): the fleet history counts a conviction once, by its time."""
    entry.update(faulty=True, reason=reason, since=utc_now(), by=by)


class Ledger:
    """Findings per device and site, persisted as ``path`` (written when ``writer``).

    ``entries``: what :meth:`read` returned for an existing file, carried over so a device judged
    faulty then stays so. Suspicions count once per moment (step, or the caller's clock)."""

    def __init__(
        self,
        path: str | Path | None = None,
        config: LedgerConfig | None = None,
        *,
        writer: bool = True,
        entries: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.config = config or LedgerConfig()
        self.path = None if path is None else Path(path)
        self.writer = writer
        self.entries: dict[str, dict[str, Any]] = {}
        for dev, entry in copy.deepcopy(entries or {}).items():
            self.entries[dev] = {**_new_entry(entry.get("rank")), **entry}

    @staticmethod
    def read(path: str | Path | None) -> dict[str, dict[str, Any]] | None:
        """The device entries of the ledger at ``path``; ``None`` when there is no file."""
        if path is None:
            return None
        path = Path(path)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            entries = data["devices"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"corrupt ledger {str(path)!r}: {exc}") from None
        if not isinstance(entries, dict):
            raise ValueError(f"corrupt ledger {str(path)!r}: 'devices' is not a mapping")
        if data.get("format", READABLE[0]) not in READABLE:
            raise ValueError(f"ledger {str(path)!r} has format {data.get('format')!r}; readable: {', '.join(READABLE)}")
        return entries

    def entry(self, device: str, rank: int | None = None) -> dict[str, Any]:
        if device not in self.entries:
            self.entries[device] = _new_entry(rank)
            identity = device_identity(device)
            if identity:
                self.entries[device]["identity"] = identity
        return self.entries[device]

    def note(self, device: str, event: Event, *, when: int | None = None, rank: int | None = None) -> Note:
        """Record ``event`` against ``device``; ``when``: the moment it counts at (default its
        step). Returns what the ledger made of it (the file is saved when it changed)."""
        if not is_suspicion(event):
            return Note()
        c = self.config
        when = event.step if when is None else when
        entry = self.entry(device, rank)
        site = site_of(event)
        entry["suspicions"].append(
            {
                "step": event.step,
                "t": when,
                "detector": event.detector,
                "verdict": event.verdict,
                "module": event.module,
                "site": site,
                "time": utc_now(),
            }
        )
        if event.detector == "collectives":
            _note_link(entry, event)
        strikes, persistent = 0, event.verdict == "persistent"
        if site is not None:
            s = entry["sites"].setdefault(
                site, {"times": [], "count": 0, "first_step": event.step, "persistent": False}
            )
            if when not in s["times"]:
                s["times"].append(when)
                s["count"] += 1
            s["times"] = [t for t in s["times"] if when - t < c.window][-c.strikes :]
            s["last_step"] = event.step
            strikes = len(s["times"])
            s["persistent"] = s["persistent"] or strikes >= c.strikes or persistent
            persistent = s["persistent"]
        moments = {x.get("t", x["step"]) for x in entry["suspicions"] if when - x.get("t", x["step"]) < c.window}
        was = entry["faulty"]
        if not was and (persistent or len(moments) >= c.max_suspicions):
            _convict(
                entry,
                f"persistent fault at {site or event.detector}"
                if persistent
                else f"{len(moments)} suspicions within {c.window} steps",
                "ledger",
            )
            log.warning("ledger: device %s is faulty (%s)", device, entry["reason"])
        self.save()
        return Note(True, site, strikes, persistent, entry["faulty"] and not was)

    def mark(self, device: str, faulty: bool | None, reason: str | None, **record: Any) -> None:
        """Set a device's verdict directly (a screen, an operator; ``faulty`` None: leave it as it
        is); ``record`` joins its ``screens``. A conviction is dated (``since``), a clearing
        removes the date."""
        entry = self.entry(device)
        if faulty and entry["faulty"]:
            entry["reason"] = reason  # already convicted: the first conviction keeps its date
        elif faulty:
            _convict(entry, reason, "screen" if "screen" in record else "operator")
        elif faulty is not None:
            entry.update(faulty=False, reason=reason)
            entry.pop("since", None)
            entry.pop("by", None)
        if record:
            entry.setdefault("screens", []).append(record)
        self.save()

    def faulty(self, device: str) -> bool:
        return bool(self.entries.get(device, {}).get("faulty"))

    def save(self) -> None:
        if self.writer and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(
                self.path,
                {
                    "format": FORMAT,
                    "updated": utc_now(),
                    "devices": self.entries,
                },
            )
