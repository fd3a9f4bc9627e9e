"""The soak's seed ledger: an SQLite file of every run and every soak, kept across nights."""

from __future__ import annotations

import sqlite3
from pathlib import Path


class Ledger:
    """One row per run, kept across nights: commit, scenario (name + JSON), seed, verdict,
    duration, the command that reproduces it, its history digest."""

    SCHEMA = """
    CREATE TABLE IF NOT EXISTS runs (
        id INTEGER PRIMARY KEY, soak TEXT NOT NULL, time TEXT NOT NULL, commit_sha TEXT,
        scenario TEXT, scenario_json TEXT, seed INTEGER, device TEXT, verdict TEXT, duration_s REAL,
        steps INTEGER, command TEXT, history_digest TEXT, determinism TEXT, run_dir TEXT,
        fingerprints TEXT);
    CREATE INDEX IF NOT EXISTS runs_seed ON runs(seed);
    CREATE TABLE IF NOT EXISTS soaks (
        id TEXT PRIMARY KEY, started TEXT, finished TEXT, commit_sha TEXT, device TEXT,
        budget_s REAL, shard TEXT, seed_start INTEGER, runs INTEGER, exit_code INTEGER,
        folder TEXT);
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(path)
            self.db.executescript(self.SCHEMA)
        except sqlite3.DatabaseError as e:
            raise ValueError(f"--ledger {path}: not a usable SQLite ledger: {e}") from None

    def next_seed(self, n: int) -> int:
        top = self.db.execute("SELECT MAX(seed) FROM runs").fetchone()[0]
        return (
            0 if top is None else -(-(top + 1) // n) * n
        )  # a multiple of N keeps the shards apart

    def add_run(self, **row) -> int:
        cols = ", ".join(row)
        cur = self.db.execute(
            f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' * len(row))})", tuple(row.values())
        )
        self.db.commit()
        return cur.lastrowid

    def set_determinism(self, row_id: int, value: str) -> None:
        self.db.execute("UPDATE runs SET determinism = ? WHERE id = ?", (value, row_id))
        self.db.commit()

    def soak(self, **row) -> None:
        self.db.execute(
            f"INSERT OR REPLACE INTO soaks ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
        self.db.commit()

    def close(self) -> None:
        self.db.close()
