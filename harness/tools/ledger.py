"""The soak's records: the SQLite seed ledger of every run and every soak, kept across nights, and
the Keeper that decides which run folders stay on disk.

A run whose folder was not kept has run_dir NULL in the ledger and a command that rebuilds its
scenario from the ledger first:

  python -m kvchaos.harness.tools.ledger reports/ledger.sqlite --row 812 --out soak-812.toml
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sqlite3
import sys
from pathlib import Path

from kvchaos.harness.scenario.options import PATH

REFERENCE_NAME = "reference"  # a run under the reference manager (no --block-manager)


class Ledger:
    """One row per run, kept across nights: commit, scenario (name + JSON), seed, verdict,
    duration, the command that reproduces it, its history digest, its folder (NULL: not kept)."""

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

    # Columns added since the first ledgers: a ledger without them gets them, with these defaults
    ADDED = {
        "runs": {
            "block_manager": f"TEXT NOT NULL DEFAULT '{REFERENCE_NAME}'",  # the spec it ran under
            "summary": "TEXT",  # the verdict's summary line
            "fp_steps": "TEXT",  # JSON: the step each of `fingerprints` showed at
            "k": "INTEGER",  # the run's index in its soak (--resume fills the gaps)
            "node": "TEXT",  # the machine it ran on
            "attempts": "INTEGER NOT NULL DEFAULT 1",  # 2: its first worker or node was lost
            "resubmitted": "TEXT",  # why
        },
        "soaks": {
            "block_manager": f"TEXT NOT NULL DEFAULT '{REFERENCE_NAME}'",
            "executor": "TEXT NOT NULL DEFAULT 'local'",
            "workers": "INTEGER NOT NULL DEFAULT 1",
            "args_json": "TEXT",  # what --resume continues with
        },
    }

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(path)
            self.db.executescript(self.SCHEMA)
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise ValueError(f"--ledger {path}: not a usable SQLite ledger: {e}") from None

    def _migrate(self) -> None:
        for table, cols in self.ADDED.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, decl in cols.items():
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        self.db.commit()

    def rows(self, where: str = "", args: tuple = ()) -> list[dict]:
        """Runs as dicts, in id order."""
        cur = self.db.execute(f"SELECT * FROM runs {where} ORDER BY id", args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur]

    def soak_row(self, soak_id: str | None = None) -> dict | None:
        """A soak's row (None: the one started last), or None."""
        if soak_id:
            cur = self.db.execute("SELECT * FROM soaks WHERE id = ?", (soak_id,))
        else:
            cur = self.db.execute("SELECT * FROM soaks ORDER BY started DESC, rowid DESC LIMIT 1")
        got = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], got)) if got else None

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

    def folder_deleted(self, row_id: int, command: str) -> None:
        self.db.execute(
            "UPDATE runs SET run_dir = NULL, command = ? WHERE id = ?", (command, row_id)
        )
        self.db.commit()

    def soak(self, **row) -> None:
        self.db.execute(
            f"INSERT OR REPLACE INTO soaks ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
        self.db.commit()

    def close(self) -> None:
        self.db.close()


def rebuild_command(ledger: Path | str, row: int, seed: int, command: str) -> str:
    """The replay command of a run whose folder is gone: its scenario comes from the ledger."""
    out = f"soak-{seed}.toml"
    parts = command.split(" ", 3)  # kvchaos run TARGET --seed N --device D ...
    tail = parts[3] if command.startswith("kvchaos run ") and len(parts) == 4 else f"--seed {seed}"
    return (
        f"python -m kvchaos.harness.tools.ledger {ledger} --row {row} --out {out} && "
        f"kvchaos run {out} {tail}"
    )


# -- disk -------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_UNITS |= {"gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_UNITS |= {"tib": 2**40}
MIN_CAP = 10**6  # below this the summary and the ledger's growth alone could not fit


def parse_size(text: str) -> int:
    """'500MB', '2GB', '750MiB', '1.5G', '123456' (bytes) -> bytes; MB = 10**6, MiB = 2**20."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text or "")
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ValueError(f"--max-disk {text!r}: expected a size such as 500MB, 2GB or 750MiB")
    size = int(float(m.group(1)) * unit)
    if size < MIN_CAP:
        raise ValueError(f"--max-disk {text!r}: must be at least 1MB (the summary needs room)")
    return size


def parse_keep(text: str) -> int | None:
    """'20' -> 20 passing runs kept; 'all' -> None (every passing run, within --max-disk)."""
    if str(text).strip().lower() == "all":
        return None
    if not re.fullmatch(r"\s*\d+\s*", str(text)):
        raise ValueError(
            f"--keep {text!r}: expected how many passing runs to keep (e.g. 20, 0), or all"
        )
    return int(text)


def size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 999.5 else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def blocks(path) -> int:
    """Bytes allocated to one file or folder entry, as du counts them (not its length)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def du_bytes(path) -> int:
    total = blocks(path)
    try:
        entries = list(os.scandir(path))
    except (NotADirectoryError, FileNotFoundError):
        return total
    for e in entries:
        total += du_bytes(e.path) if e.is_dir(follow_symlinks=False) else blocks(e.path)
    return total


def ledger_bytes(path: Path) -> int:
    return sum(blocks(f"{path}{tail}") for tail in ("", "-journal", "-wal"))


class Keeper:
    """Which run folders stay: every finding (a verdict other than PASS, a cited incident, a
    nondeterministic replay), a reservoir sample of `keep` passing runs (None: all), and all of
    it within `cap` bytes of what the soak writes (its folder and the ledger's growth). Past
    PASSING_SHARE of the cap no new passing run is kept; when the next run might not fit, full()
    says stop. A kept run that would break the cap loses the passing sample first, then its
    history.jsonl, then its folder: the ledger row stays."""

    PASSING_SHARE = 0.8
    MIN_RUN = 64 * 1024  # what the next run is assumed to need before one has been measured
    END_BASE, END_PER_RUN = 320 * 1024, 2 * 1024  # summary, plot, runs/index.html and .json

    def __init__(self, folder: Path, ledger, ledger_file: Path, ledger_base: int, keep, cap, seed):
        self.folder, self.ledger, self.ledger_file = folder, ledger, ledger_file
        self.ledger_base, self.keep, self.cap = ledger_base, keep, cap
        self.rng = random.Random(f"{seed}/keep")  # the same sample on every rerun
        self.kept: dict[str, dict] = {}  # run folder -> {size, row, seed, command, why, ...}
        self.sample: list[str] = []
        self.runs_bytes = self.largest = self.seen_passing = 0
        self.deleted = self.trimmed = 0
        self.passing_closed_at: int | None = None  # the run after which passing runs went
        self.runs = 0

    def used(self) -> int:
        own = blocks(self.folder) + blocks(self.folder / "runs") + self.runs_bytes
        return own + max(0, ledger_bytes(self.ledger_file) - self.ledger_base)

    def end_reserve(self) -> int:
        return self.END_BASE + self.END_PER_RUN * len(self.kept)

    def full(self) -> bool:
        """The next run might not fit under the cap: stop the soak."""
        return self._margin() > self.cap

    def _margin(self) -> int:
        return self.used() + self.end_reserve() + max(self.largest, self.MIN_RUN)

    def settle(self, run_dir: str, row: int, why: str, info: dict) -> str:
        """Keep or delete a recorded run; why: finding | cited | passing. Returns what became of
        it: kept | sampled | deleted | trimmed (kept without history.jsonl)."""
        self.runs += 1
        size = du_bytes(run_dir)
        self.largest = max(self.largest, size)
        entry = {"size": size, "row": row, "why": why, **info}
        if why == "passing" and not self._sampled(run_dir):
            self._delete(run_dir, entry)
            return "deleted"
        self.kept[run_dir] = entry
        self.runs_bytes += size
        fate = "sampled" if why == "passing" else "kept"
        while self.used() + self.end_reserve() > self.cap and run_dir in self.kept:
            others = [d for d in self.sample if d != run_dir]
            hist = Path(run_dir) / "history.jsonl"
            if others:  # the passing sample makes room for findings
                self.release(others[0])
            elif why != "passing" and hist.exists():
                hist.unlink()
                self.trimmed += 1
                self._resize(run_dir)
                fate = "trimmed"
            else:
                self.release(run_dir)
                fate = "deleted"
        if self.passing_closed_at is None and self._margin() > self.PASSING_SHARE * self.cap:
            self.passing_closed_at = self.runs
        return fate

    def adopt(self, run_dir: str, row: int, why: str, info: dict) -> None:
        """A folder the soak this one resumes kept: kept still (a passing one in the sample)."""
        size = du_bytes(run_dir)
        self.kept[run_dir] = {"size": size, "row": row, "why": why, **info}
        self.runs_bytes += size
        self.largest = max(self.largest, size)
        self.runs += 1
        if why == "passing":
            self.sample.append(run_dir)
            self.seen_passing += 1

    def release(self, run_dir: str, only_cited: bool = False) -> None:
        """Delete a kept run (only_cited: only if it was kept for being cited, a passing run)."""
        entry = self.kept.get(run_dir)
        if entry is None or (only_cited and entry["why"] != "cited"):
            return
        del self.kept[run_dir]
        self.runs_bytes -= entry["size"]
        if run_dir in self.sample:
            self.sample.remove(run_dir)
        self._delete(run_dir, entry)

    def _sampled(self, run_dir: str) -> bool:
        """Reservoir sampling: every passing run so far had the same chance to be kept."""
        if self.passing_closed_at is not None:
            return False
        i, self.seen_passing = self.seen_passing, self.seen_passing + 1
        if self.keep is None or len(self.sample) < self.keep:
            self.sample.append(run_dir)
            return True
        j = self.rng.randrange(i + 1)
        if j >= self.keep:
            return False
        self.release(self.sample[j])
        self.sample.append(run_dir)
        return True

    def _resize(self, run_dir: str) -> None:
        entry = self.kept[run_dir]
        size = du_bytes(run_dir)
        self.runs_bytes += size - entry["size"]
        entry["size"] = size

    def _delete(self, run_dir: str, entry: dict) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        self.deleted += 1
        cmd = rebuild_command(self.ledger_file, entry["row"], entry["seed"], entry["command"])
        self.ledger.folder_deleted(entry["row"], cmd)


# -- python -m kvchaos.harness.tools.ledger LEDGER --row N ------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvchaos.harness.tools.ledger",
        description="Write a ledger row's scenario as TOML (to re-run a soak run that kept no "
        "folder).",
    )
    p.add_argument("ledger", type=PATH)
    p.add_argument("--row", type=int, required=True, help="the run's id in the ledger")
    p.add_argument("--out", type=PATH, default="-", help="the TOML file to write (default: stdout)")
    a = p.parse_args(argv)
    from kvchaos.harness.scenario.toml_writer import dumps

    try:
        db = sqlite3.connect(f"file:{a.ledger}?mode=ro", uri=True)
        got = db.execute("SELECT scenario_json FROM runs WHERE id = ?", (a.row,)).fetchone()
    except sqlite3.Error as e:
        print(f"{a.ledger}: not a readable ledger: {e}", file=sys.stderr)
        return 2
    if not got or not got[0]:
        print(f"{a.ledger}: no run {a.row} with a recorded scenario", file=sys.stderr)
        return 2
    text = dumps(json.loads(got[0]))
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
