"""The fleet history: each device's convictions, strikes and screens across jobs, hosts and weeks.

A run's ``ledger.json`` judges devices within a run (:mod:`sdcscope.localize.ledger`); the history
keeps what every run and every ``sdcscope screen`` concluded about each device, keyed by **host
and device** (``node7`` + ``cuda:3``, with its UUID / PCI bus id or CPU model where known), so
that a device convicted in last week's job and again today is a **repeat offender**
(:class:`RepeatRule`), which :mod:`sdcscope.localize.exports` hands to Slurm, NVRx and Kubernetes.

The store is a directory (``$SDCSCOPE_FLEET``, else ``~/.sdcscope/fleet``) of append-only
JSON-lines files, one per host (``<host>.jsonl``), one record a line. Many jobs on many hosts
append to it at once over a shared file system: each host writes only its own file (no two hosts
ever write one file), a record is one ``write`` of a whole line to a file opened ``O_APPEND``
under an exclusive ``lockf`` lock (which NFS forwards to its lock manager), and a record that is
already there (same ``id``) is not written again. SQLite is not used: its locking is unreliable
on network file systems (its own documentation warns of corruption there), while a JSON-lines file
can be read with ``jq`` and repaired with an editor. A reader skips a last line still being
written (no newline yet); any other line that is not a valid record is refused naming the file
and the line.

A record's ``id`` is a digest of what it is (host, device, kind and the time the ledger gave the
finding), not of the run that reported it: recording a run twice, or a ledger carried into the
next job, adds nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sdcscope.common.io import dumps, load_yaml, read_json, read_text
from sdcscope.common.validate import (
    brief,
    build_config,
    check_bool,
    check_float,
    check_non_negative,
    check_positive,
)
from sdcscope.localize.ledger import LEDGER_FILE, Ledger, utc_now

FORMAT = "sdcscope-fleet/1"
HISTORY_ENV = "SDCSCOPE_FLEET"
DEFAULT_HISTORY = "~/.sdcscope/fleet"
KINDS = ("conviction", "strike", "screen_pass", "screen_fail")
"""``conviction``: a run's ledger called the device faulty; ``strike``: one suspicion of it (a
finding the ledger counted); ``screen_pass`` / ``screen_fail``: an ``sdcscope screen`` verdict."""
SCREEN_KINDS = {"pass": "screen_pass", "fail": "screen_fail"}
_FIELDS = ("format", "id", "time", "host", "device", "run", "kind", "evidence", "identity")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z")
_HOST_FILE = re.compile(r"[^A-Za-z0-9._-]")
log = logging.getLogger("sdcscope.localize.history")
_THREADS = threading.Lock()
"""Appends of this process's threads, one at a time (``lockf`` locks belong to a process)."""


def default_history() -> Path:
    """The history directory when none is given: ``$SDCSCOPE_FLEET``, else ``~/.sdcscope/fleet``."""
    return Path(os.environ.get(HISTORY_ENV) or DEFAULT_HISTORY).expanduser()


def parse_time(text: str) -> datetime:
    """A record's time (UTC, ISO 8601 with ``Z``) as an aware datetime; ValueError otherwise."""
    if not isinstance(text, str) or not _TIME.fullmatch(text):
        raise ValueError(f"time {brief(text)} is not a UTC ISO 8601 time such as 2026-12-07T16:00:00Z")
    return datetime.fromisoformat(text[:-1]).replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Record:
    """One fact about one device. ``evidence``: what it rests on (detector, step, module, verdict,
    site, reason); ``identity``: what is known of the device beyond its index."""

    host: str
    device: str
    run: str
    time: str
    kind: str
    evidence: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.host, self.device)

    @property
    def when(self) -> datetime:
        return parse_time(self.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "id": self.id,
            "time": self.time,
            "host": self.host,
            "device": self.device,
            "run": self.run,
            "kind": self.kind,
            "evidence": self.evidence,
            "identity": self.identity,
        }

    @classmethod
    def from_dict(cls, data: object) -> Record:
        """A record as a history file holds it; ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a record must be a JSON object, got {brief(data)}")
        unknown = sorted(set(data) - set(_FIELDS))
        missing = [k for k in _FIELDS if k not in data and k != "identity"]
        if unknown or missing:
            raise ValueError(f"record keys: unknown {unknown}, missing {missing}; allowed: {', '.join(_FIELDS)}")
        if data["format"] != FORMAT:
            raise ValueError(f"record format {brief(data['format'])}; readable: {FORMAT}")
        for name in ("id", "host", "device", "run"):
            if not isinstance(data[name], str) or not data[name]:
                raise ValueError(f"record {name} {brief(data[name])} must be a non-empty string")
        if data["kind"] not in KINDS:
            raise ValueError(f"record kind {brief(data['kind'])}; allowed: {', '.join(KINDS)}")
        parse_time(data["time"])
        for name in ("evidence", "identity"):
            if not isinstance(data.get(name, {}), dict):
                raise ValueError(f"record {name} must be a JSON object, got {brief(data[name])}")
        return cls(**{k: data.get(k, {}) for k in _FIELDS if k != "format"})


def make_record(
    host: str,
    device: str,
    run: str,
    time: str,
    kind: str,
    evidence: Mapping[str, Any],
    identity: Mapping[str, Any] | None = None,
    *,
    basis: object,
) -> Record:
    """A record whose ``id`` digests (host, device, kind, ``basis``): ``basis`` says what makes the
    fact itself one (its ledger time and site), not which run reported it."""
    digest = hashlib.sha256(json.dumps([host, device, kind, basis], sort_keys=True, default=str).encode())
    return Record(host, device, run, time, kind, dict(evidence), dict(identity or {}), digest.hexdigest()[:20])


@dataclass(kw_only=True)
class RepeatRule:
    """When a device is a **repeat offender** (what the exports exclude)."""

    convictions: int = 2
    """Convictions in distinct runs within ``window_days`` that make a repeat offender (a failed
    screen is one when ``screen_fail_counts``: a failed screen and one conviction make two)."""
    window_days: float = 30.0
    """Days a conviction, a failed screen or a strike is remembered for."""
    screen_fail_counts: bool = True
    """A failed ``sdcscope screen`` counts as a conviction (of the screen's own run)."""
    cleared_by_pass: bool = True
    """A passing screen forgives what came before it: only later evidence counts."""
    strike_runs: int = 0
    """Distinct runs with a strike against the device (a suspicion its ledger counted, convicted
    or not) within the window that make it a repeat offender too; 0: strikes alone never do."""
    count_injected: bool = False
    """Count the findings of runs and screens that injected faults (``evidence.injected``): a drill
    of the hand-off. Off, they are listed but never convict the hardware."""

    def __post_init__(self) -> None:
        check_positive("repeat rule convictions", self.convictions)
        check_float("repeat rule window_days", self.window_days, low=0, low_open=True)
        check_bool("repeat rule screen_fail_counts", self.screen_fail_counts)
        check_bool("repeat rule cleared_by_pass", self.cleared_by_pass)
        check_bool("repeat rule count_injected", self.count_injected)
        check_non_negative("repeat rule strike_runs", self.strike_runs)

    @classmethod
    def load(cls, path: str | Path) -> RepeatRule:
        """From a YAML/JSON file holding the rule's mapping (``{convictions: 2, window_days: 14}``);
        an empty file is every default; an unknown key is refused naming the allowed ones."""
        data = load_yaml(read_text(path), repr(str(path)))
        return cls() if data is None else build_config(cls, data, f"repeat rule {str(path)!r}")


@dataclass
class DeviceStatus:
    """A device as the history and a :class:`RepeatRule` judge it."""

    host: str
    device: str
    identity: dict[str, Any]
    convictions: list[Record]
    """Counted convictions (and failed screens): in the window, after the latest passing screen."""
    strikes: int
    screens: dict[str, int]
    last_seen: str
    injected: int = 0
    """Findings of runs with injected faults left uncounted (:attr:`RepeatRule.count_injected`)."""
    offender: bool = False
    since: str | None = None
    """When it became a repeat offender (the record that tipped it)."""
    reason: str = ""

    @property
    def runs(self) -> list[str]:
        return sorted({r.run for r in self.convictions})


def judge(records: Iterable[Record], rule: RepeatRule | None = None, now: datetime | None = None) -> list[DeviceStatus]:
    """Every device of ``records`` judged by ``rule`` at ``now`` (default: the current time)."""
    rule = rule or RepeatRule()
    now = now or datetime.now(timezone.utc)
    start = now - timedelta(days=rule.window_days)
    by_device: dict[tuple[str, str], list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.when, r.kind, r.id)):
        by_device.setdefault(r.key, []).append(r)
    found = []
    for (host, device), recs in sorted(by_device.items()):
        passes = [
            r.when for r in recs if r.kind == "screen_pass" and (rule.count_injected or not r.evidence.get("injected"))
        ]
        cleared = max(passes) if passes and rule.cleared_by_pass else None
        live = [r for r in recs if r.when >= start and (cleared is None or r.when > cleared)]
        simulated = [r for r in live if r.evidence.get("injected")]
        if not rule.count_injected:
            live = [r for r in live if r not in simulated]
        convicting = ("conviction", "screen_fail") if rule.screen_fail_counts else ("conviction",)
        status = DeviceStatus(
            host,
            device,
            next((r.identity for r in reversed(recs) if r.identity), {}),
            [r for r in live if r.kind in convicting],
            sum(r.kind == "strike" for r in live),
            {v: sum(r.kind == k for r in recs) for v, k in SCREEN_KINDS.items()},
            recs[-1].time,
            injected=0 if rule.count_injected else len(simulated),
        )
        _offence(status, [r for r in live if r.kind == "strike"], rule)
        found.append(status)
    return found


def _offence(status: DeviceStatus, strikes: list[Record], rule: RepeatRule) -> None:
    """Set ``status.offender`` (and when, and why) by ``rule``: the first moment ``rule.convictions``
    distinct runs convicted it, or ``rule.strike_runs`` distinct runs struck it."""
    runs: dict[str, Record] = {}
    for r in status.convictions:
        runs.setdefault(r.run, r)
        if len(runs) >= rule.convictions:
            status.offender, status.since = True, r.time
            cited = "; ".join(f"{x.run} at {x.time}: {x.evidence.get('reason') or x.kind}" for x in runs.values())
            status.reason = f"convicted in {len(runs)} runs within {rule.window_days:g} days ({cited})"
            return
    struck: dict[str, Record] = {}
    for r in strikes:
        struck.setdefault(r.run, r)
        if rule.strike_runs and len(struck) >= rule.strike_runs:
            status.offender, status.since = True, r.time
            status.reason = f"strikes in {len(struck)} runs within {rule.window_days:g} days ({', '.join(struck)})"
            return


class History:
    """The history directory ``root`` (see the module docstring for the layout and why)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_history()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"fleet history {str(self.root)!r} is not a directory")

    def file(self, host: str) -> Path:
        return self.root / f"{_HOST_FILE.sub('_', host) or '_'}.jsonl"

    def append(self, records: Iterable[Record]) -> int:
        """Append ``records`` not already in the history (by ``id``); returns how many were written."""
        by_host: dict[str, list[Record]] = {}
        for r in records:
            by_host.setdefault(r.host, []).append(r)
        written = 0
        for host, recs in by_host.items():
            self.root.mkdir(parents=True, exist_ok=True)
            with _locked(self.file(host)) as (fd, text):
                known = {_id_of(line) for line in text.splitlines()}
                new = [r for r in {r.id: r for r in recs}.values() if r.id not in known]
                if new:
                    os.write(fd, "".join(dumps(r.to_dict()) + "\n" for r in new).encode())
                    os.fsync(fd)
                written += len(new)
        return written

    def read(self, *, strict: bool = True) -> tuple[list[Record], list[str]]:
        """``(records, problems)``: every record of the history (one per ``id``) and, with
        ``strict=False``, what was skipped (``file:line: why``); ``strict`` raises ValueError at
        the first bad record instead."""
        records: dict[str, Record] = {}
        problems: list[str] = []
        if not self.root.is_dir():
            return [], []
        for path in sorted(self.root.glob("*.jsonl")):
            text = path.read_text(encoding="utf-8", errors="replace")
            lines = text.split("\n")
            for number, line in enumerate(lines, 1):
                if not line.strip() or (number == len(lines) and not text.endswith("\n")):
                    continue  # blank, or the last line still being written
                try:
                    record = Record.from_dict(json.loads(line))
                except (json.JSONDecodeError, ValueError, TypeError) as exc:
                    problem = f"{path}:{number}: {exc}"
                    if strict:
                        raise ValueError(f"bad fleet history record at {problem}") from None
                    problems.append(problem)
                    continue
                records.setdefault(record.id, record)
        return list(records.values()), problems


def _id_of(line: str) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        return json.loads(line).get("id")
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[tuple[int, str]]:
    """``path`` opened for appending under an exclusive lock, with its text. A last line without
    its newline is a writer killed mid-record (every writer holds the lock): it is cut off first.
    ``lockf`` excludes other processes; this process's threads take :data:`_THREADS` first."""
    with _THREADS:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            try:
                import fcntl

                fcntl.lockf(fd, fcntl.LOCK_EX)
            except (ImportError, OSError) as exc:  # no lock on this file system: appends stay whole lines
                log.debug("fleet history %s: no lock (%s)", path, exc)
            data = b""
            while chunk := os.pread(fd, 1 << 20, len(data)):
                data += chunk
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                log.warning(
                    "fleet history %s: dropped a torn record (%d bytes) of a killed writer", path, len(data) - keep
                )
                os.ftruncate(fd, keep)
                data = data[:keep]
            yield fd, data.decode("utf-8", errors="replace")
        finally:
            os.close(fd)  # releases the lock


def run_id(run_dir: str | Path) -> str:
    """A run directory's identity in the history: its name and a digest of its absolute path and
    ``config.json`` (the same run recorded again, or resumed, keeps it)."""
    run_dir = Path(run_dir).resolve()
    config = run_dir / "config.json"
    data = config.read_bytes() if config.is_file() else b""
    return f"{run_dir.name}-{hashlib.sha256(str(run_dir).encode() + data).hexdigest()[:10]}"


def _split(key: str) -> tuple[str, str]:
    host, _, device = key.partition(":")
    if not host or not device:
        raise ValueError(f"ledger device {brief(key)} is not host:kind:index")
    return host, device


def screen_record(
    key: str, screen: Mapping[str, Any], run: str, identity: Mapping[str, Any] | None = None
) -> Record | None:
    """The record of one ``sdcscope screen`` result of device ``key`` (as the ledger's ``screens``
    hold it); None for a verdict that says nothing of the device (``no_reference``, ...)."""
    kind = SCREEN_KINDS.get(screen.get("screen"))
    if kind is None:
        return None
    host, device = _split(key)
    when = screen.get("time") or utc_now()
    evidence = {k: screen[k] for k in ("screen", "first_difference", "injected") if k in screen}
    key_text = json.dumps(screen.get("key"), sort_keys=True)
    return make_record(host, device, screen.get("run") or run, when, kind, evidence, identity, basis=[when, key_text])


def records_from_ledger(
    entries: Mapping[str, Mapping[str, Any]], run: str, updated: str | None = None, *, injected: bool = False
) -> list[Record]:
    """The history records of a ledger's ``entries`` (:meth:`Ledger.read`) reported by ``run``: a
    ``conviction`` per faulty device (one a screen made is its ``screen_fail``), a ``strike`` per
    suspicion, a record per passing or failing screen. ``updated``: the ledger's own time, for
    findings of a ledger written before findings were dated (those are keyed by ``run``);
    ``injected``: the run injected faults, so its findings are marked (``evidence.injected``): a
    simulated fault is no evidence against the hardware (:attr:`RepeatRule.count_injected`)."""
    fallback = updated or utc_now()
    mark = {"injected": True} if injected else {}
    found: list[Record] = []
    for key, entry in entries.items():
        host, device = _split(key)
        identity = entry.get("identity") or {}
        suspicions = list(entry.get("suspicions") or [])
        convicted_by = entry.get("by") or (
            "screen" if str(entry.get("reason") or "").startswith("screen:") else "ledger"
        )
        if entry.get("faulty") and convicted_by != "screen":
            last = suspicions[-1] if suspicions else {}
            evidence = {"reason": entry.get("reason"), "rank": entry.get("rank"), "by": convicted_by, **mark}
            evidence.update({k: last.get(k) for k in ("detector", "step", "module", "verdict", "site") if k in last})
            since = entry.get("since")
            found.append(
                make_record(
                    host, device, run, since or fallback, "conviction", evidence, identity, basis=since or ["run", run]
                )
            )
        for s in suspicions:
            evidence = {**{k: s.get(k) for k in ("detector", "step", "module", "verdict", "site")}, **mark}
            basis = [
                s.get("time") or ["run", run],
                s.get("step"),
                s.get("t"),
                s.get("site"),
                s.get("detector"),
                s.get("verdict"),
            ]
            found.append(
                make_record(host, device, run, s.get("time") or fallback, "strike", evidence, identity, basis=basis)
            )
        for s in entry.get("screens") or []:
            record = screen_record(key, s, run, identity)
            if record is not None:
                found.append(record)
    return found


def injected_faults(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` injected faults (its config.json lists fault specs)."""
    config = Path(run_dir) / "config.json"
    return config.is_file() and bool(read_json(config).get("faults"))


def record_ledger(history: History, ledger: str | Path, run: str, *, injected: bool = False) -> tuple[int, int]:
    """Ingest the ledger file ``ledger`` of run ``run`` into ``history``: ``(written, found)``
    (nothing when there is no file: a run without findings writes none); ``injected``: see
    :func:`records_from_ledger`."""
    entries = Ledger.read(ledger)
    if entries is None:
        return 0, 0
    records = records_from_ledger(entries, run, read_json(ledger).get("updated"), injected=injected)
    return history.append(records), len(records)


def record_run(
    history: History, run_dir: str | Path, *, ledger: str | Path | None = None, run: str | None = None
) -> tuple[int, int, str]:
    """Ingest a finished run's ledger (``ledger``, default ``run_dir/ledger.json``) into
    ``history``: ``(written, found, run id)``. A run without findings has no ledger: nothing to
    record. Recording a run again writes nothing new; a run that injected faults is recorded with
    its findings marked ``injected``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not (run_dir / "config.json").is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no config.json)")
    if ledger is not None and not Path(ledger).is_file():
        raise ValueError(f"ledger {str(ledger)!r} does not exist")
    run = run or run_id(run_dir)
    path = ledger if ledger is not None else run_dir / LEDGER_FILE
    written, found = record_ledger(history, path, run, injected=injected_faults(run_dir))
    return written, found, run


def statuses(
    history: History, rule: RepeatRule | None = None, *, strict: bool = True
) -> tuple[list[DeviceStatus], list[str]]:
    """The history judged by ``rule``: ``(statuses, problems)`` (see :meth:`History.read`)."""
    records, problems = history.read(strict=strict)
    return judge(records, rule), problems
