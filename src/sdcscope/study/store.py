"""``results.sqlite``: one row per trial, committed per trial, bound to one campaign spec.

Tables: ``meta`` (spec hash and the normalized spec), ``golden`` (the golden loss curve),
``reference`` (golden at the end of each horizon), ``baseline`` (healthy re-seeded runs),
``twins`` (perturbation twins: the chaos floor, :mod:`.twins`), ``thresholds`` (the healthy-spread
bound of each measure at each injection step, and the twins' envelope ``dist_twin``) and ``trials``.
A database of an older schema is migrated when opened (see :meth:`ResultsDB._migrate`). Only the
campaign's main process writes; every row is its own transaction, so a killed runner loses at most
the trials in flight, and a trial id is its primary key, so none is written twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

from sdcscope.common.io import dumps
from sdcscope.common.storage import storage_cause, writing
from sdcscope.study.spec import CampaignSpec, space_hash

__all__ = ["ResultsDB", "TRIAL_COLUMNS", "BASELINE_COLUMNS", "TWIN_COLUMNS", "DB_FILE"]

DB_FILE = "results.sqlite"
SCHEMA = 5
"""2: the drift columns; 3: a trial's ``detector`` (the guard's first detector after the fault);
4: the ``twins`` table and a baseline's ``drift_twin`` / ``drift_spread`` labels; 5: a trial's
``profile`` (its node profile, :class:`~sdcscope.study.space.FaultProfiles`)."""
JSON_COLUMNS = {"losses", "drift", "disagree", "first_divergence", "lockstep", "nsr", "drift_steps"}
TRIAL_COLUMNS: dict[str, str] = {
    "trial_id": "INTEGER PRIMARY KEY",
    "spec_hash": "TEXT NOT NULL",
    "key": "TEXT UNIQUE NOT NULL",
    "inject_step": "INTEGER",
    "site": "TEXT",
    "target": "TEXT",
    "model": "TEXT",
    "bit": "INTEGER",
    "pattern": "TEXT",
    "schedule": "TEXT",
    "swizzle": "INTEGER",
    "repeat": "INTEGER",
    "fault_seed": "INTEGER",
    "profile": "TEXT",
    "outcome": "TEXT",
    "effect": "TEXT",
    "sdc_kind": "TEXT",
    "fired": "INTEGER",
    "activated": "INTEGER",
    "injections": "INTEGER",
    "crash": "INTEGER",
    "masked": "INTEGER",
    "error": "TEXT",
    "steps": "INTEGER",
    "first_diff_step": "INTEGER",
    "final_loss": "REAL",
    "loss_excess": "REAL",
    "loss_diff_max": "REAL",
    "loss_diff_mean": "REAL",
    "val_loss": "REAL",
    "val_acc": "REAL",
    "val_loss_fault": "REAL",
    "val_acc_fault": "REAL",
    "val_delta": "REAL",
    "dist_golden": "REAL",
    "dist_healthy": "REAL",
    "disagree_final": "REAL",
    "drift_twin": "INTEGER",
    "drift_spread": "INTEGER",
    "detected": "INTEGER",
    "detect_step": "INTEGER",
    "detector": "TEXT",
    "latency": "INTEGER",
    "guard_events": "INTEGER",
    "nsr_max": "REAL",
    "nsr_mean": "REAL",
    "losses": "TEXT",
    "drift": "TEXT",
    "first_divergence": "TEXT",
    "lockstep": "TEXT",
    "nsr": "TEXT",
    "wall_s": "REAL",
    "disagree": "TEXT",
}
_HEALTHY_COLUMNS: dict[str, str] = {
    "val_loss": "REAL",
    "val_acc": "REAL",
    "val_delta": "REAL",
    "loss_excess": "REAL",
    "dist_golden": "REAL",
    "guard_events": "INTEGER",
    "losses": "TEXT",
    "drift": "TEXT",
    "wall_s": "REAL",
    "disagree": "TEXT",
    "drift_twin": "INTEGER",
    "drift_spread": "INTEGER",
}
"""What every healthy run (a re-seeded baseline, a perturbation twin) records."""
BASELINE_COLUMNS: dict[str, str] = {"inject_step": "INTEGER", "seed": "INTEGER", **_HEALTHY_COLUMNS}
TWIN_COLUMNS: dict[str, str] = {"inject_step": "INTEGER", "twin": "INTEGER", "changed": "INTEGER", **_HEALTHY_COLUMNS}
"""A perturbation twin; ``drift_twin``: beyond the envelope of the other twins, ``drift_spread``:
beyond the re-seed spread (each a false drift)."""
_TABLES = {
    "meta": "key TEXT PRIMARY KEY, value TEXT",
    "golden": "step INTEGER PRIMARY KEY, loss REAL",
    "reference": "inject_step INTEGER PRIMARY KEY, end_step INTEGER, val_loss REAL, val_acc REAL, "
    "param_sha256 TEXT, drift_steps TEXT",
    "baseline": ", ".join(f"{k} {v}" for k, v in BASELINE_COLUMNS.items()) + ", PRIMARY KEY (inject_step, seed)",
    "thresholds": "inject_step INTEGER, measure TEXT, bound REAL, n INTEGER, mean REAL, sd REAL, max REAL, "
    "t REAL, alpha REAL, rule TEXT, PRIMARY KEY (inject_step, measure)",
    "trials": ", ".join(f"{k} {v}" for k, v in TRIAL_COLUMNS.items()),
    "twins": ", ".join(f"{k} {v}" for k, v in TWIN_COLUMNS.items()) + ", PRIMARY KEY (inject_step, twin)",
}


def _encode(key: str, value: Any) -> Any:
    return dumps(value) if key in JSON_COLUMNS and value is not None else value


def _decode(row: sqlite3.Row) -> dict[str, Any]:
    return {k: (json.loads(row[k]) if k in JSON_COLUMNS and row[k] is not None else row[k]) for k in row.keys()}


class ResultsDB:
    """The results database of one campaign directory.

    ``ResultsDB(path, spec)`` opens (or creates) it and refuses one made for another spec,
    without writing anything.
    """

    def __init__(self, path: str | Path, spec: CampaignSpec, plan_size: int | None = None) -> None:
        self.path = Path(path)
        exists = self.path.exists()
        self.extended = False
        """Whether the spec extends the one the database was made for (:meth:`_extends`)."""
        self.readonly = exists and not all(os.access(p, os.W_OK) for p in (self.path, self.path.parent))
        with writing("the results database", self.path):
            self.conn = (
                self._connect() if self.readonly else sqlite3.connect(self.path, isolation_level=None, timeout=30)
            )
        self.conn.row_factory = sqlite3.Row
        try:
            if exists:
                try:
                    self._check(spec)
                except sqlite3.OperationalError:  # even a read needs room for WAL files: read it as it is
                    if self.readonly:
                        raise
                    self.conn.close()
                    self.conn, self.readonly = self._connect(), True
                    self.conn.row_factory = sqlite3.Row
                    self._check(spec)
            else:
                self._create(spec, plan_size)
        except Exception:
            self.conn.close()
            if not exists:  # a database that could not be made whole is not left behind
                for suffix in ("", "-wal", "-shm", "-journal"):
                    with contextlib.suppress(OSError):
                        os.unlink(f"{self.path}{suffix}")
            raise

    def _connect(self) -> sqlite3.Connection:
        """A read-only connection (a read-only file or folder: an archived campaign, a read-only
        mount). SQLite's WAL mode needs a writable folder even to read, unless the file is opened
        as immutable (nothing else writes it: nothing can)."""
        uri = self.path.resolve().as_uri()
        try:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, isolation_level=None)
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            conn.close()
        return sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)

    def _check(self, spec: CampaignSpec) -> None:
        try:
            meta = {r["key"]: r["value"] for r in self.conn.execute("SELECT key, value FROM meta")}
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and storage_cause(exc) is not None:
                raise  # the storage refused, the file is fine: see __init__
            raise ValueError(f"{str(self.path)!r} is not an sdcscope results database ({exc})") from None
        extended = meta.get("spec_hash") != spec.hash and self._extends(meta, spec)
        if int(meta.get("schema") or 1) < SCHEMA and (extended or meta.get("spec_hash") == spec.hash):
            self._migrate(spec)  # an extended spec's database too, before rows with the new columns
        if extended:
            return
        if meta.get("spec_hash") != spec.hash:
            old = json.loads(meta.get("spec", "{}")).get("name", "?")
            raise ValueError(
                f"{str(self.path)!r} holds results of another campaign spec ({old!r}, hash "
                f"{str(meta.get('spec_hash'))[:12]}…), not of this campaign.yaml ({spec.name!r}, hash "
                f"{spec.hash[:12]}…); refusing to mix them: restore the original campaign.yaml or use a "
                "new campaign directory"
            )

    def _migrate(self, spec: CampaignSpec) -> None:
        """An older schema -> :data:`SCHEMA`: add the tables and columns it lacks -- 2: the drift
        columns (a trial's ``disagree``, ``disagree_final``, ``drift_twin``, ``drift_spread``; a
        baseline's ``disagree``), 3: a trial's ``detector``, 4: the ``twins`` table and a
        baseline's ``drift_twin`` / ``drift_spread``, 5: a trial's ``profile`` -- and decide each
        finished trial's outcome again from its stored measures (:meth:`_reclassify`); the measures it did not take stay
        empty. Until the next ``campaign run`` adds the perturbation twins, ``drift_twin`` is
        decided against the fixed :data:`~sdcscope.study.outcomes.TWIN_BOUND`. A database that
        cannot be written is read as it is (the new columns read as None, no twins)."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(f"CREATE TABLE IF NOT EXISTS twins ({_TABLES['twins']})")
            for table, columns in (("trials", TRIAL_COLUMNS), ("baseline", BASELINE_COLUMNS)):
                have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}
                for name, kind in columns.items():
                    if name not in have:
                        self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
            self._reclassify(spec)
            self.conn.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA),))
            self.conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:  # read-only file or folder
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            logging.getLogger("sdcscope.study.store").warning(
                "%s: older schema database not migrated to %s (%s); its newer columns read as None",
                self.path,
                SCHEMA,
                exc,
            )
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise

    def _reclassify(self, spec: CampaignSpec) -> None:
        """Decide every stored trial's outcome and drift labels again from its stored measures
        and the current thresholds (inside the caller's transaction)."""
        from sdcscope.study.outcomes import classify, drift_flags

        thresholds = self.thresholds()
        for r in self._rows("SELECT * FROM trials"):
            if r["inject_step"] not in thresholds:
                continue
            m = {**r, "crash": bool(r["crash"]), "masked": bool(r["masked"])}
            th = thresholds[r["inject_step"]]
            new = {**classify(m, th, bool(spec.guard)), **drift_flags(m, th)}
            self.conn.execute(
                "UPDATE trials SET effect=?, sdc_kind=?, outcome=?, drift_twin=?, drift_spread=? WHERE trial_id=?",
                [new[k] for k in ("effect", "sdc_kind", "outcome", "drift_twin", "drift_spread")] + [r["trial_id"]],
            )

    def write_envelope(self, spec: CampaignSpec, rows: list[dict[str, Any]], twin_flags, baseline_flags) -> None:
        """The twins' envelope rows (measure ``dist_twin``; replacing any), the twins' and the
        baselines' drift labels (``{(inject_step, twin or seed): {"drift_twin", "drift_spread"}}``),
        and every stored trial decided again against the envelope: one transaction."""
        with self._writing("the perturbation twins' envelope"):
            for row in rows:
                self.conn.execute(
                    "DELETE FROM thresholds WHERE inject_step=? AND measure=?", (row["inject_step"], row["measure"])
                )
                self._insert("thresholds", row)
            for table, key, labels in (("twins", "twin", twin_flags), ("baseline", "seed", baseline_flags)):
                for (s, k), flags in labels.items():
                    self.conn.execute(
                        f"UPDATE {table} SET drift_twin=?, drift_spread=? WHERE inject_step=? AND {key}=?",
                        (flags["drift_twin"], flags["drift_spread"], s, k),
                    )
            self._reclassify(spec)

    def _extends(self, meta: dict[str, str], spec: CampaignSpec) -> bool:
        """Whether ``spec`` extends the stored one (only its sampling differs: see
        :class:`~sdcscope.study.spec.Sampling`); if so the database is bound to ``spec`` from now
        on (every row kept; a read-only database is read as it is)."""
        try:
            stored = json.loads(meta.get("spec", "{}"))
        except ValueError:
            return False
        if not isinstance(stored, dict) or space_hash(stored) != spec.space_hash:
            return False
        self.extended = True
        if not self.readonly:
            with self._writing("the extended campaign spec"):
                self.conn.execute("UPDATE meta SET value=? WHERE key='spec_hash'", (spec.hash,))
                self.conn.execute("UPDATE meta SET value=? WHERE key='spec'", (json.dumps(spec.to_dict()),))
                self.conn.execute("UPDATE meta SET value='None' WHERE key='plan_size'")  # the new plan's: unknown
        return True

    @property
    def plan_size(self) -> int | None:
        """The number of trials planned, or None where it is not known (a spec just extended,
        before its plan was made: :func:`sdcscope.study.runner.count_plan`)."""
        value = self.meta().get("plan_size")
        return int(value) if value is not None and value.isdigit() else None

    def set_plan_size(self, plan_size: int) -> None:
        """The number of trials planned (it grows when a campaign is extended)."""
        if self.meta().get("plan_size") != str(plan_size):
            with self._writing("the plan size"):
                self.conn.execute("UPDATE meta SET value=? WHERE key='plan_size'", (str(plan_size),))

    def _create(self, spec: CampaignSpec, plan_size: int | None) -> None:
        with writing("the results database", self.path):
            self._create_tables(spec, plan_size)

    def _create_tables(self, spec: CampaignSpec, plan_size: int | None) -> None:
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("BEGIN")
        for name, cols in _TABLES.items():
            self.conn.execute(f"CREATE TABLE {name} ({cols})")
        meta = {
            "schema": str(SCHEMA),
            "spec_hash": spec.hash,
            "spec": json.dumps(spec.to_dict()),
            "plan_size": str(plan_size),
        }
        self.conn.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ResultsDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing (one transaction each) ------------------------------------------------------
    def _insert(self, table: str, row: dict[str, Any]) -> None:
        keys = list(row)
        sql = f"INSERT INTO {table} ({', '.join(keys)}) VALUES ({', '.join('?' * len(keys))})"
        self.conn.execute(sql, [_encode(k, row[k]) for k in keys])

    @contextlib.contextmanager
    def _writing(self, what: str):
        """One transaction; a write the storage refuses is rolled back (no partial rows) and
        raised as :class:`~sdcscope.common.storage.StorageError` naming the database."""
        with writing(what, self.path):
            try:
                self.conn.execute("BEGIN")
                yield
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.conn.execute("ROLLBACK")
                raise

    def write_golden(self, losses: list[float], references: list[dict[str, Any]]) -> None:
        with self._writing("the golden run's results"):
            self.conn.executemany("INSERT INTO golden VALUES (?, ?)", enumerate(losses))
            for ref in references:
                self._insert("reference", ref)

    def write_baseline(self, row: dict[str, Any]) -> None:
        with self._writing("a baseline's results"):
            self._insert("baseline", {k: row.get(k) for k in BASELINE_COLUMNS})

    def write_twin(self, row: dict[str, Any]) -> None:
        with self._writing("a perturbation twin's results"):
            self._insert("twins", {k: row.get(k) for k in TWIN_COLUMNS})

    def write_thresholds(self, rows: list[dict[str, Any]]) -> None:
        with self._writing("the thresholds"):
            for row in rows:
                self._insert("thresholds", row)

    def write_trial(self, row: dict[str, Any]) -> None:
        with self._writing(f"trial {row.get('trial_id')}'s results"):
            self._insert("trials", {k: row.get(k) for k in TRIAL_COLUMNS})

    # -- reading -----------------------------------------------------------------------------
    def _rows(self, sql: str, *args) -> list[dict[str, Any]]:
        return [_decode(r) for r in self.conn.execute(sql, args)]

    def meta(self) -> dict[str, str]:
        return {r["key"]: r["value"] for r in self.conn.execute("SELECT key, value FROM meta")}

    def golden_losses(self) -> list[float]:
        return [r["loss"] for r in self.conn.execute("SELECT loss FROM golden ORDER BY step")]

    def references(self) -> dict[int, dict[str, Any]]:
        return {r["inject_step"]: r for r in self._rows("SELECT * FROM reference ORDER BY inject_step")}

    def baselines(self) -> list[dict[str, Any]]:
        return [
            {**dict.fromkeys(BASELINE_COLUMNS), **r}
            for r in self._rows("SELECT * FROM baseline ORDER BY inject_step, seed")
        ]

    def twins(self) -> list[dict[str, Any]]:
        """The perturbation twins (none in a database written before them and not run since)."""
        if not self.conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='twins'").fetchone():
            return []
        return [
            {**dict.fromkeys(TWIN_COLUMNS), **r} for r in self._rows("SELECT * FROM twins ORDER BY inject_step, twin")
        ]

    def thresholds(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for r in self.conn.execute("SELECT inject_step, measure, bound FROM thresholds"):
            out.setdefault(r["inject_step"], {})[r["measure"]] = r["bound"]
        return out

    def threshold_rows(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM thresholds ORDER BY inject_step, measure")

    def done_trials(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT trial_id FROM trials")}

    def trial_keys(self) -> dict[int, str]:
        """``{trial_id: key}`` of every stored trial."""
        return {r[0]: r[1] for r in self.conn.execute("SELECT trial_id, key FROM trials")}

    def trials(self) -> list[dict[str, Any]]:
        return [{**dict.fromkeys(TRIAL_COLUMNS), **r} for r in self._rows("SELECT * FROM trials ORDER BY trial_id")]
