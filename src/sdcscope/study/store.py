"""``results.sqlite``: one row per trial, committed per trial, bound to one campaign spec.

Tables: ``meta`` (spec hash and the normalized spec), ``golden`` (the golden loss curve),
``reference`` (golden at the end of each horizon), ``baseline`` (healthy re-seeded runs),
``thresholds`` (the healthy-spread bound of each measure at each injection step) and ``trials``.
Only the campaign's main process writes; every row is its own transaction, so a killed runner
loses at most the trials in flight, and a trial id is its primary key, so none is written twice.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from sdcscope.common.io import dumps
from sdcscope.study.spec import CampaignSpec

__all__ = ["ResultsDB", "TRIAL_COLUMNS", "BASELINE_COLUMNS", "DB_FILE"]

DB_FILE = "results.sqlite"
SCHEMA = 1
JSON_COLUMNS = {"losses", "drift", "first_divergence", "lockstep", "nsr", "drift_steps"}
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
    "detected": "INTEGER",
    "detect_step": "INTEGER",
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
}
BASELINE_COLUMNS: dict[str, str] = {
    "inject_step": "INTEGER",
    "seed": "INTEGER",
    "val_loss": "REAL",
    "val_acc": "REAL",
    "val_delta": "REAL",
    "loss_excess": "REAL",
    "dist_golden": "REAL",
    "guard_events": "INTEGER",
    "losses": "TEXT",
    "drift": "TEXT",
    "wall_s": "REAL",
}
_TABLES = {
    "meta": "key TEXT PRIMARY KEY, value TEXT",
    "golden": "step INTEGER PRIMARY KEY, loss REAL",
    "reference": "inject_step INTEGER PRIMARY KEY, end_step INTEGER, val_loss REAL, val_acc REAL, "
    "param_sha256 TEXT, drift_steps TEXT",
    "baseline": ", ".join(f"{k} {v}" for k, v in BASELINE_COLUMNS.items()) + ", PRIMARY KEY (inject_step, seed)",
    "thresholds": "inject_step INTEGER, measure TEXT, bound REAL, n INTEGER, mean REAL, sd REAL, max REAL, "
    "t REAL, alpha REAL, rule TEXT, PRIMARY KEY (inject_step, measure)",
    "trials": ", ".join(f"{k} {v}" for k, v in TRIAL_COLUMNS.items()),
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
        self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        self.conn.row_factory = sqlite3.Row
        try:
            if exists:
                self._check(spec)
            else:
                self._create(spec, plan_size)
        except Exception:
            self.conn.close()
            raise

    def _check(self, spec: CampaignSpec) -> None:
        try:
            meta = {r["key"]: r["value"] for r in self.conn.execute("SELECT key, value FROM meta")}
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{str(self.path)!r} is not an sdcscope results database ({exc})") from None
        if meta.get("spec_hash") != spec.hash:
            old = json.loads(meta.get("spec", "{}")).get("name", "?")
            raise ValueError(
                f"{str(self.path)!r} holds results of another campaign spec ({old!r}, hash "
                f"{str(meta.get('spec_hash'))[:12]}…), not of this campaign.yaml ({spec.name!r}, hash "
                f"{spec.hash[:12]}…); refusing to mix them: restore the original campaign.yaml or use a "
                "new campaign directory"
            )

    def _create(self, spec: CampaignSpec, plan_size: int | None) -> None:
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

    def write_golden(self, losses: list[float], references: list[dict[str, Any]]) -> None:
        self.conn.execute("BEGIN")
        self.conn.executemany("INSERT INTO golden VALUES (?, ?)", enumerate(losses))
        for ref in references:
            self._insert("reference", ref)
        self.conn.execute("COMMIT")

    def write_baseline(self, row: dict[str, Any]) -> None:
        self._insert("baseline", {k: row.get(k) for k in BASELINE_COLUMNS})

    def write_thresholds(self, rows: list[dict[str, Any]]) -> None:
        self.conn.execute("BEGIN")
        for row in rows:
            self._insert("thresholds", row)
        self.conn.execute("COMMIT")

    def write_trial(self, row: dict[str, Any]) -> None:
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
        return self._rows("SELECT * FROM baseline ORDER BY inject_step, seed")

    def thresholds(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for r in self.conn.execute("SELECT inject_step, measure, bound FROM thresholds"):
            out.setdefault(r["inject_step"], {})[r["measure"]] = r["bound"]
        return out

    def threshold_rows(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM thresholds ORDER BY inject_step, measure")

    def done_trials(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT trial_id FROM trials")}

    def trials(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM trials ORDER BY trial_id")
