"""Soak: run randomised scenarios until a time budget is spent.

Each seed picks a mix of triggers, planted defects and workload parameters within the ranges in
SPACE (harness/soak.py), writes the scenario as TOML and runs it in a worker process; a run that
hangs is killed at its timeout and recorded as ERROR, and the soak goes on. Every run goes into a
seed ledger (SQLite) that persists across nights. A sample of runs (5%, from the first run that is
not an ERROR) is replayed and its history digest compared: a mismatch is NONDETERMINISM, never
retried. At the end: soak-summary.md / .html in the soak's folder, incidents deduplicated by
fingerprint (label, failure mode, checker, finding kind) with the first and fastest seed of each.

Exit codes: 0 nothing unexpected (PASS / INCONCLUSIVE only), 10 MISSED, 11 FALSE_ALARM,
14 nondeterminism, 13 ERROR (in that order of precedence), 2 bad input.

  kvchaos soak --budget 30m --device cuda --shard 1/4 --per-run-timeout 120
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import sqlite3
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

from kvchaos.harness.judge.verdict import (
    ERROR,
    EXIT_CODES,
    FALSE_ALARM,
    INCONCLUSIVE,
    MEANING,
    MISSED,
    PASS,
)

NONDETERMINISM = "NONDETERMINISM"
EXIT_NONDETERMINISM = 14
REPLAY_EVERY = 20  # every 20th run (the first included; an ERROR passes it on) is replayed: 5%
KILL_GRACE_S = 5.0  # past the soft per-run timeout, the worker is killed
RSS_SAMPLE_EVERY_S = 5.0
RSS_BASELINE_S = 60.0  # "after the first minute"

# The declared ranges every soak scenario is drawn from: (lo, hi) is an inclusive range (ints
# stay ints), a list is a choice, {"subset": [...], "min": k} a random subset of at least k.
# The shapes follow what each failure mode needs to be provoked.
SPACE = {
    "engine": {
        "block_size": [2, 4, 8],
        "max_blocks_per_seq": (8, 24),
        "max_num_seqs": (4, 8),
        "pool_rows": (3, 8),  # num_blocks = pool_rows x max_blocks_per_seq
        "max_prefill_tokens": (16, 64),
        "tp_size": [1, 2],
    },
    "workload": {
        "num_requests": (2, 16),
        "arrival_rate": (0.5, 3.0),
        "prompt_max": (4, 40),
        "output_max": (4, 32),
        "fork_groups": (0, 3),
        "cancel_rate": (0.0, 0.2),
        "cancel_phases": {
            "subset": ["waiting", "prefill", "decode", "preempted", "shared"],
            "min": 0,
        },
    },
    # a stall needs a steady decode-only stretch to measure a trend against its own baseline
    "stall_workload": {"num_requests": (1, 4), "output_len": (70, 100), "prompt_max": (4, 12)},
    "fault_probability": 0.4,  # each failure mode's trigger is in the mix with this probability
    "defect_probability": 0.5,  # and, when it is, its defect is planted with this one
    "faults": {
        "table_overflow": {
            "at_step": (1, 6),
            "long_requests": (1, 2),
            "overshoot": (1.1, 2.0),
            "boundary": [True, False],
            "neighbours": (1, 4),
        },
        "refcount_leak": {
            "cancel_phases": {"subset": ["prefill", "decode", "shared"], "min": 1},
            "fraction": (0.5, 1.0),
            "storm_step": (4, 16),
            "storm_fraction": (0.2, 0.8),
        },  # phase cancels alone rarely land
        "staging_stall": {
            "at_step": (20, 30),
            "ramp_steps": (6, 16),
            "plateau_us": (2000.0, 5000.0),
        },
        "ordering_race": {"lag_steps": (1, 2), "probability": (0.2, 0.6), "from_step": (2, 5)},
    },
    # expect.within_steps per planted failure mode (the soak takes the largest of those planted)
    "within_steps": {
        "table_overflow": 2,
        "refcount_leak": 2,
        "staging_stall": 20,
        "ordering_race": 2,
    },
}


# -- input ------------------------------------------------------------------------------------
def parse_budget(text: str) -> float:
    """'90s', '5m', '1h30m', '2h15m30s' -> seconds."""
    m = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", text or "")
    if not m or not any(m.groups()):
        raise ValueError(f"--budget {text!r}: expected a duration such as 90s, 5m or 1h30m")
    h, mi, s = (int(g or 0) for g in m.groups())
    total = h * 3600 + mi * 60 + s
    if total <= 0:
        raise ValueError(f"--budget {text!r}: must be longer than zero")
    return float(total)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N): this machine takes the seeds s with s % N == I - 1."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return int(m.group(1)), int(m.group(2))


def shard_seed(seed_start: int, k: int, shard: tuple[int, int]) -> int:
    i, n = shard
    return seed_start + k * n + (i - 1)


# -- the random scenario --------------------------------------------------------------------
def _draw(rng: random.Random, spec):
    if isinstance(spec, dict):
        return rng.sample(spec["subset"], rng.randint(spec["min"], len(spec["subset"])))
    if isinstance(spec, list):
        return _draw(rng, rng.choice(spec))
    if isinstance(spec, tuple):
        lo, hi = spec
        return rng.randint(lo, hi) if isinstance(lo, int) else round(rng.uniform(lo, hi), 3)
    return spec


def generate_scenario(seed: int) -> dict:
    """The scenario dict (the TOML file's shape) that this seed stands for."""
    from kvchaos.faults import REGISTRY

    rng = random.Random(f"{seed}/soak")
    e, w = SPACE["engine"], SPACE["workload"]
    faults = []
    for name in REGISTRY:
        if rng.random() < SPACE["fault_probability"]:
            params = {k: _draw(rng, spec) for k, spec in SPACE["faults"][name].items()}
            faults.append(
                {
                    "name": name,
                    "defect": rng.random() < SPACE["defect_probability"],
                    "params": params,
                }
            )
    names = [f["name"] for f in faults]
    width = _draw(rng, e["max_blocks_per_seq"])
    engine = {
        "max_prefill_tokens": _draw(rng, e["max_prefill_tokens"]),
        "tp_size": 2 if "ordering_race" in names else _draw(rng, e["tp_size"]),
        "cache": {
            "block_size": _draw(rng, e["block_size"]),
            "max_blocks_per_seq": width,
            "max_num_seqs": _draw(rng, e["max_num_seqs"]),
            "num_blocks": width * _draw(rng, e["pool_rows"]),
        },
    }
    cache = engine["cache"]
    if "staging_stall" in names:
        sw = SPACE["stall_workload"]
        out, prompt = _draw(rng, sw["output_len"]), _draw(rng, sw["prompt_max"])
        # every request must fit a row, or nothing decodes long enough to show a trend
        cache["max_blocks_per_seq"] = max(width, -(-(out + prompt) // cache["block_size"]))
        cache["num_blocks"] = max(cache["num_blocks"], 2 * cache["max_blocks_per_seq"])
        workload = {
            "num_requests": _draw(rng, sw["num_requests"]),
            "arrival_rate": 4.0,
            "prompt_len": {"dist": "uniform", "min": 1, "max": prompt},
            "output_len": {"dist": "fixed", "value": out, "min": 1, "max": out},
        }
    else:
        # the workload's own requests fit a row: over-long ones are the table_overflow trigger's job
        cap = width * cache["block_size"]
        prompt = min(_draw(rng, w["prompt_max"]), cap // 2)
        out = min(_draw(rng, w["output_max"]), cap - prompt)
        workload = {
            "num_requests": _draw(rng, w["num_requests"]),
            "arrival_rate": _draw(rng, w["arrival_rate"]),
            "prompt_len": {"dist": "uniform", "min": 1, "max": prompt},
            "output_len": {"dist": "uniform", "min": 1, "max": out},
            "fork_groups": _draw(rng, w["fork_groups"]),
            "cancel": {
                "rate": _draw(rng, w["cancel_rate"]),
                "phases": _draw(rng, w["cancel_phases"]),
            },
        }
    planted = [f["name"] for f in faults if f["defect"]]
    if planted:
        detectors = sorted({d for n in planted for d in REGISTRY[n].detectors})
        expect = {
            "outcome": "detect",
            "checkers": detectors,
            "within_steps": max(SPACE["within_steps"][n] for n in planted),
        }
    else:
        expect = {"outcome": "clean"}
    mix = (
        ", ".join(f"{f['name']} ({'defect' if f['defect'] else 'trigger'})" for f in faults)
        or "no faults"
    )
    data = {
        "scenario": {
            "name": f"soak-{seed}",
            "description": f"soak seed {seed}: {mix}",
            "tags": ["soak"],
            "seeds": [seed],
        },
        "engine": engine,
        "workload": workload,
        "faults": faults,
        "expect": expect,
    }
    if not faults:
        del data["faults"]
    return data


# -- fingerprints -----------------------------------------------------------------------------
def fingerprints(results: dict, faults: list[dict]) -> list[dict]:
    """What a run showed, as {"fp": (label, failure mode, checker, kind), "step"}: one per distinct
    fingerprint, the run's primary (the one a reproducer must keep) first. label is the verdict,
    or DETECTED for a PASS that caught its planted defect. A finding's failure mode is the fault
    in the run (planted first) whose detectors include its checker, else "-"."""
    from kvchaos.faults import REGISTRY

    v = results["verdict"]
    planted = [f["name"] for f in faults if f.get("defect", True)]
    present = planted + [f["name"] for f in faults if not f.get("defect", True)]
    steps = results.get("steps", 0)
    if (
        v == ERROR
    ):  # a broken run is not attributed to a failure mode: the mix would split one cause many ways
        err = results.get("error") or {}
        unknown = [c["checker"] for c in results.get("checkers", []) if c.get("valid") is None]
        if err or not unknown:
            return [{"fp": (ERROR, "-", "runner", err.get("error", "error")), "step": steps}]
        return [{"fp": (ERROR, "-", c, "unknown"), "step": steps} for c in unknown]
    if v == INCONCLUSIVE:
        return []
    head, out = [], {}
    if v == MISSED:
        verify = results.get("fault_verify", {})
        caught = set(results.get("time_to_detect_steps") or {})
        head = [
            {
                "fp": (MISSED, n, "-", "not_caught"),
                "step": (verify.get(n) or {}).get("first_step") or steps,
            }
            for n in planted
            if n not in caught
        ]
    label = "DETECTED" if v == PASS else v
    for c in results.get("checkers", []):
        for f in c.get("findings", []):
            mode = next((n for n in present if f["checker"] in REGISTRY[n].detectors), "-")
            fp = (label, mode, f["checker"], f.get("kind") or "-")
            if fp not in out or f["step"] < out[fp]:
                out[fp] = f["step"]
    tail = sorted(
        ({"fp": fp, "step": s} for fp, s in out.items()), key=lambda x: (x["step"], x["fp"])
    )
    if (
        v == PASS
    ):  # the primary is the earliest finding of a checker the scenario expected (ties: in its order)
        want = results.get("expectation", {}).get("checkers", [])
        tail.sort(
            key=lambda x: (
                x["fp"][2] not in want,
                x["step"],
                want.index(x["fp"][2]) if x["fp"][2] in want else 0,
            )
        )
    return head + tail


def fp_text(fp) -> str:
    return " / ".join(fp)


# -- the seed ledger --------------------------------------------------------------------------
class Ledger:
    """One row per run, kept across nights: commit, scenario (name + JSON), seed, verdict,
    duration, the command that reproduces it, its history digest."""

    SCHEMA = """
    CREATE TABLE IF NOT EXISTS runs (
        id INTEGER PRIMARY KEY, soak TEXT NOT NULL, time TEXT NOT NULL, commit_sha TEXT, scenario TEXT,
        scenario_json TEXT, seed INTEGER, device TEXT, verdict TEXT, duration_s REAL, steps INTEGER,
        command TEXT, history_digest TEXT, determinism TEXT, run_dir TEXT, fingerprints TEXT);
    CREATE INDEX IF NOT EXISTS runs_seed ON runs(seed);
    CREATE TABLE IF NOT EXISTS soaks (
        id TEXT PRIMARY KEY, started TEXT, finished TEXT, commit_sha TEXT, device TEXT, budget_s REAL,
        shard TEXT, seed_start INTEGER, runs INTEGER, exit_code INTEGER, folder TEXT);
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


# -- the worker process -----------------------------------------------------------------------
def _worker_main(conn) -> None:
    """Runs jobs until told to stop. Lives in a spawned process, so the parent can kill a hang."""
    from kvchaos.harness.judge.runner import run_scenario
    from kvchaos.harness.judge.scenario import load_scenario
    from kvchaos.harness.report.render import publish  # noqa: F401  imported before ready

    conn.send({"ready": True})  # imports done: run deadlines start counting from here
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        if job.get("hang"):
            while True:  # the injected hang: only the parent's kill ends it
                time.sleep(3600)
        try:
            conn.send(_execute(job, run_scenario, load_scenario))
        except Exception:  # the harness's own bug: the parent records it as this run's ERROR
            conn.send({"worker_error": traceback.format_exc()})


def _execute(job: dict, run_scenario, load_scenario) -> dict:
    from kvchaos.harness.report.render import publish

    sc = load_scenario(job["scenario_path"])
    if job["op"] == "replay":
        r = run_scenario(sc, job["seed"], job["device"], None, timeout_s=job["timeout_s"])
        return {"digest": r.results["history_digest"], "verdict": r.verdict}
    r = publish(
        run_scenario(sc, job["seed"], job["device"], job["runs_dir"], timeout_s=job["timeout_s"]),
        index=False,
    )
    (r.run_dir / "scenario.json").write_text(json.dumps(job["scenario"], indent=1))
    res = r.results
    return {
        "run_dir": str(r.run_dir),
        "verdict": r.verdict,
        "summary": r.summary,
        "steps": res["steps"],
        "wall_s": res["wall_s"],
        "digest": res["history_digest"],
        "command": res["replay"],
        "fingerprints": fingerprints(res, job["scenario"].get("faults", [])),
    }


class Worker:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None

    def ready(self, deadline: float, tick) -> bool:
        """Start the worker if there is none, and wait until its imports are done (a fresh worker
        must not spend a run's time limit importing torch). False if the deadline came first."""
        if self.proc is not None and self.proc.is_alive():
            return True
        self.kill()
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_worker_main, args=(child,), daemon=True, name="kvchaos-soak-worker"
        )
        self.proc.start()
        child.close()
        self.conn = parent
        while time.monotonic() < deadline:
            try:
                if self.conn.poll(0.25):
                    return self.conn.recv().get("ready", False)
            except (EOFError, OSError):
                break
            if not self.proc.is_alive():
                break
            tick()
        self.kill()
        if time.monotonic() < deadline:
            raise RuntimeError("the soak's worker process could not start (see the error above)")
        return False

    def call(self, job: dict, deadline: float, tick) -> tuple[str, dict | None]:
        """('ok', result) | ('worker_error', {traceback}) | ('timeout', None) | ('died', None);
        tick() runs while it waits."""
        self.conn.send(job)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return "timeout", None
            try:
                if self.conn.poll(min(0.25, left)):
                    got = self.conn.recv()
                    return ("worker_error", got) if "worker_error" in got else ("ok", got)
            except (EOFError, OSError):
                self.kill()
                return "died", None
            if not self.proc.is_alive():
                self.kill()
                return "died", None
            tick()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.conn.close()
        self.proc = self.conn = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except OSError:
                pass
        self.kill()

    def rss(self) -> int:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss if self.proc is not None else 0
        except psutil.Error:
            return 0


# -- the soak ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args) -> None:
        import psutil

        from kvchaos.harness.judge.runner import git_commit, resolve_device

        self.budget = parse_budget(args.budget)
        self.shard = parse_shard(args.shard)
        if args.per_run_timeout <= 0:
            raise ValueError(f"--per-run-timeout {args.per_run_timeout}: must be > 0")
        if args.inject_hang_every is not None and args.inject_hang_every < 1:
            raise ValueError(f"--inject-hang-every {args.inject_hang_every}: must be >= 1")
        self.args = args
        # the worker inherits this: a matplotlib figure per incident run would triple a soak's cost
        os.environ["KVCHAOS_PLOTS"] = args.plots
        self.device = resolve_device(args.device)
        self.commit = git_commit()
        report_dir = Path(args.report_dir)
        self.ledger = Ledger(Path(args.ledger) if args.ledger else report_dir / "ledger.sqlite")
        self.seed_start = (
            args.seed_start if args.seed_start is not None else self.ledger.next_seed(self.shard[1])
        )
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.id = f"soak-{stamp}" + (
            f"-shard{self.shard[0]}of{self.shard[1]}" if self.shard[1] > 1 else ""
        )
        self.dir = report_dir / self.id
        n = 1
        while self.dir.exists():
            n += 1
            self.dir = report_dir / f"{self.id}-{n}"
        (self.dir / "runs").mkdir(parents=True)
        (self.dir / "scenarios").mkdir()
        self.worker = Worker()
        self.proc = psutil.Process()
        self.counts: Counter = Counter()
        self.incidents: dict[tuple, dict] = {}
        self.unexpected: list[dict] = []  # capped: the ledger has them all
        self.nondet: list[dict] = []
        self.runs = self.steps = self.replays = self.cut = 0
        self.first_seed = self.last_seed = None
        self.rss: dict = {}
        self._last_rss = 0.0

    # -- one run ----------------------------------------------------------------------------
    def _job(self, k: int) -> dict:
        from kvchaos.harness.judge.scenario import parse_scenario
        from kvchaos.harness.judge.toml_writer import dumps

        seed = shard_seed(self.seed_start, k, self.shard)
        data = generate_scenario(seed)
        path = self.dir / "scenarios" / f"soak-{seed}.toml"
        parse_scenario(data, str(path))  # the generator's output must be a valid scenario
        path.write_text(dumps(data), encoding="utf-8")
        hang = (
            self.args.inject_hang_every is not None and (k + 1) % self.args.inject_hang_every == 0
        )
        return {
            "op": "run",
            "seed": seed,
            "scenario": data,
            "scenario_path": str(path),
            "device": self.device,
            "runs_dir": str(self.dir / "runs"),
            "timeout_s": self.args.per_run_timeout,
            "hang": hang,
        }

    def _deadline(self, end: float) -> tuple[float, bool]:
        own = time.monotonic() + self.args.per_run_timeout + KILL_GRACE_S
        return min(own, end), own <= end

    def _killed_run(self, job: dict, why: str, detail: str = "") -> dict:
        """Record a run the worker gave no result for: in its own folder if it made one."""
        from kvchaos.harness.judge.runner import new_run_dir

        seed = job["seed"]
        found = sorted((self.dir / "runs").glob(f"*-soak-{seed}-s{seed}"))
        run_dir = found[0] if found else new_run_dir(self.dir / "runs", f"soak-{seed}", seed)
        shutil.copyfile(job["scenario_path"], run_dir / "scenario.toml")
        (run_dir / "scenario.json").write_text(json.dumps(job["scenario"], indent=1))
        last_line = (detail.strip().splitlines() or [""])[-1]
        name, message = {
            "timeout": (
                "Timeout",
                f"no result within {self.args.per_run_timeout + KILL_GRACE_S:g} s: "
                "the run was killed",
            ),
            "died": ("WorkerDied", "the worker process died during the run"),
            "worker_error": ("WorkerError", f"the soak's worker failed: {last_line}"),
        }[why]
        error = {
            "error": name,
            "message": message,
            "traceback": detail,
            "injected_hang": job["hang"],
        }
        cmd = f"kvchaos run {job['scenario_path']} --seed {seed} --device {self.device}"
        results = {
            "scenario": f"soak-{seed}",
            "seed": seed,
            "verdict": ERROR,
            "summary": f"run error: {message}",
            "exit_code": EXIT_CODES[ERROR],
            "commit": self.commit,
            "device": self.device,
            "steps": 0,
            "reason": why,
            "error": error,
            "expectation": job["scenario"]["expect"],
            "history_digest": None,
            "replay": cmd,
            "checkers": [],
        }
        (run_dir / "results.json").write_text(json.dumps(results, indent=1))
        return {
            "run_dir": str(run_dir),
            "verdict": ERROR,
            "summary": results["summary"],
            "steps": 0,
            "wall_s": None,
            "digest": None,
            "command": cmd,
            "fingerprints": fingerprints(results, job["scenario"].get("faults", [])),
        }

    def _record(self, job: dict, r: dict, duration: float) -> int:
        seed = job["seed"]
        self.runs += 1
        self.steps += r["steps"]
        self.counts[r["verdict"]] += 1
        self.first_seed = seed if self.first_seed is None else self.first_seed
        self.last_seed = seed
        cited = False  # first or fastest of a fingerprint: the summary points at this run
        for x in r["fingerprints"]:
            fp = tuple(x["fp"])
            inc = self.incidents.get(fp)
            if inc is None:
                cited = True
                self.incidents[fp] = {
                    "count": 1,
                    "first_seed": seed,
                    "first_run": r["run_dir"],
                    "fastest_seed": seed,
                    "fastest_step": x["step"],
                    "fastest_run": r["run_dir"],
                }
            else:
                inc["count"] += 1
                if x["step"] < inc["fastest_step"]:
                    cited = True
                    inc.update(fastest_seed=seed, fastest_step=x["step"], fastest_run=r["run_dir"])
        if r["verdict"] in (MISSED, FALSE_ALARM, ERROR) and len(self.unexpected) < 200:
            self.unexpected.append(
                {
                    "seed": seed,
                    "verdict": r["verdict"],
                    "summary": r["summary"],
                    "run_dir": r["run_dir"],
                    "mix": job["scenario"]["scenario"]["description"],
                }
            )
        if self.args.keep == "incidents" and r["verdict"] == PASS and not cited:
            (Path(r["run_dir"]) / "history.jsonl").unlink(
                missing_ok=True
            )  # disk, not memory: nights are long
        return self.ledger.add_run(
            soak=self.id,
            time=dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            scenario=job["scenario"]["scenario"]["name"],
            scenario_json=json.dumps(job["scenario"], sort_keys=True),
            seed=seed,
            device=self.device,
            verdict=r["verdict"],
            duration_s=round(duration, 3),
            steps=r["steps"],
            command=r["command"],
            history_digest=r["digest"],
            run_dir=r["run_dir"],
            fingerprints=json.dumps([x["fp"] for x in r["fingerprints"]]),
        )

    def _replay(self, job: dict, r: dict, row: int, end: float, tick) -> None:
        if not self.worker.ready(end, tick):
            self.ledger.set_determinism(row, "cut")
            return
        deadline, own = self._deadline(end)
        status, got = self.worker.call({**job, "op": "replay", "hang": False}, deadline, tick)
        if status == "timeout" and not own:
            self.ledger.set_determinism(row, "cut")
            return
        self.replays += 1
        got = got if status == "ok" else None
        same = got is not None and got["digest"] == r["digest"]
        self.ledger.set_determinism(row, "identical" if same else "mismatch")
        if not same:
            self.nondet.append(
                {
                    "seed": job["seed"],
                    "run_dir": r["run_dir"],
                    "digest": r["digest"],
                    "replay_digest": got["digest"] if got else f"replay {status}",
                    "replay_verdict": got["verdict"] if got else ERROR,
                    "verdict": r["verdict"],
                }
            )
            self.counts[NONDETERMINISM] += 1
            mix = "+".join(sorted(f["name"] for f in job["scenario"].get("faults", []))) or "-"
            fp = (NONDETERMINISM, mix, "replay", "digest_mismatch")
            inc = self.incidents.setdefault(
                fp,
                {
                    "count": 0,
                    "first_seed": job["seed"],
                    "first_run": r["run_dir"],
                    "fastest_seed": job["seed"],
                    "fastest_step": r["steps"],
                    "fastest_run": r["run_dir"],
                },
            )
            inc["count"] += 1

    # -- the loop ---------------------------------------------------------------------------
    def _sample_rss(self, t: float) -> None:
        if t - self._last_rss < RSS_SAMPLE_EVERY_S and self.rss:
            return
        self._last_rss = t
        soak, worker = self.proc.memory_info().rss, self.worker.rss()
        self.rss.setdefault("start_mb", soak / 2**20)
        self.rss["peak_mb"] = max(self.rss.get("peak_mb", 0), soak / 2**20)
        self.rss["worker_peak_mb"] = max(self.rss.get("worker_peak_mb", 0), worker / 2**20)
        # the baseline is the first sample after the first minute (or a fifth of a shorter budget)
        if "baseline_mb" not in self.rss and t >= min(RSS_BASELINE_S, self.budget / 5):
            self.rss.update(
                baseline_mb=soak / 2**20,
                baseline_at_s=round(t, 1),
                worker_baseline_mb=worker / 2**20,
            )
        self.rss.update(end_mb=soak / 2**20, worker_end_mb=worker / 2**20)

    def run(self) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        t0 = time.monotonic()
        end = t0 + self.budget
        started = dt.datetime.now().isoformat(timespec="seconds")
        live = (
            Live(
                self._panel(0.0),
                console=console,
                refresh_per_second=2,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            if not self.args.quiet
            else None
        )

        def tick() -> None:
            t = time.monotonic() - t0
            self._sample_rss(t)
            if live is not None:
                live.update(self._panel(t))

        if live is not None:
            live.start()
        try:
            k, replay_due = 0, True
            while time.monotonic() < end:
                if not self.worker.ready(end, tick):
                    break
                job = self._job(k)
                k += 1
                t_run = time.monotonic()
                deadline, own = self._deadline(end)
                status, r = self.worker.call(job, deadline, tick)
                if (
                    status == "timeout" and not own
                ):  # the budget ran out mid-run: not the run's fault
                    self.cut += 1
                    for d in (self.dir / "runs").glob(f"*-soak-{job['seed']}-s{job['seed']}"):
                        shutil.rmtree(d, ignore_errors=True)
                    break
                if status != "ok":
                    r = self._killed_run(job, status, (r or {}).get("worker_error", ""))
                row = self._record(job, r, time.monotonic() - t_run)
                replay_due = replay_due or (k - 1) % REPLAY_EVERY == 0
                # an ERROR run may have stopped on a clock (its timeout): its history is not the seed's alone
                if replay_due and r["verdict"] != ERROR and time.monotonic() < end:
                    self._replay(job, r, row, end, tick)
                    replay_due = False
                tick()
        finally:
            self.worker.stop()
            tick()
            if live is not None:
                live.stop()
        elapsed = time.monotonic() - t0
        code = self.exit_code()
        self.ledger.soak(
            id=self.id,
            started=started,
            finished=dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            device=self.device,
            budget_s=self.budget,
            shard=f"{self.shard[0]}/{self.shard[1]}",
            seed_start=self.seed_start,
            runs=self.runs,
            exit_code=code,
            folder=str(self.dir),
        )
        self.ledger.close()
        summary = self.summary(elapsed, code)
        (self.dir / "soak.json").write_text(json.dumps(summary, indent=1, default=str))
        (self.dir / "soak-summary.md").write_text(render_md(summary), encoding="utf-8")
        (self.dir / "soak-summary.html").write_text(render_html(summary), encoding="utf-8")
        if (
            self.dir / "runs"
        ).is_dir():  # the kept runs' index, once (not after every run of the night)
            from kvchaos.harness.report.index import update_index

            try:
                update_index(self.dir / "runs")
            except (
                Exception
            ) as e:  # the summary and the runs are written; only their listing is missing
                print(
                    f"could not write {self.dir / 'runs' / 'index.html'}: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )
        print(render_md(summary, brief=True))
        print(f"summary: {self.dir / 'soak-summary.md'}  ({self.dir / 'soak-summary.html'})")
        return code

    def exit_code(self) -> int:
        for v in (MISSED, FALSE_ALARM):
            if self.counts[v]:
                return EXIT_CODES[v]
        if self.nondet:
            return EXIT_NONDETERMINISM
        return EXIT_CODES[ERROR] if self.counts[ERROR] else 0

    def _panel(self, t: float):
        from rich.table import Table

        tab = Table.grid(padding=(0, 2))
        tab.add_column(style="bold")
        tab.add_column()
        colour = {PASS: "green", INCONCLUSIVE: "yellow"}
        tab.add_row(
            "elapsed", f"{_dur(t)} / {_dur(self.budget)}  ({min(100, 100 * t / self.budget):.0f}%)"
        )
        tab.add_row(
            "runs",
            f"{self.runs}  (determinism replays {self.replays}, mismatches {len(self.nondet)})",
        )
        tab.add_row(
            "verdicts",
            "  ".join(f"[{colour.get(v, 'red')}]{v} {n}[/]" for v, n in sorted(self.counts.items()))
            or "-",
        )
        unexpected = sum(1 for fp in self.incidents if fp[0] != "DETECTED")
        tab.add_row("incidents", f"{len(self.incidents)} fingerprints ({unexpected} unexpected)")
        tab.add_row("steps/s", f"{self.steps / t:.0f}" if t > 0 else "-")
        tab.add_row(
            "RSS",
            f"soak {self.rss.get('end_mb', 0):.0f} MiB, "
            f"worker {self.rss.get('worker_end_mb', 0):.0f} MiB",
        )
        return tab

    def summary(self, elapsed: float, code: int) -> dict:
        rss = dict(self.rss)
        if "baseline_mb" in rss:
            rss["growth_pct"] = round(
                100 * (rss["end_mb"] - rss["baseline_mb"]) / rss["baseline_mb"], 2
            )
            if rss.get("worker_baseline_mb"):
                rss["worker_growth_pct"] = round(
                    100
                    * (rss["worker_end_mb"] - rss["worker_baseline_mb"])
                    / rss["worker_baseline_mb"],
                    2,
                )
        incidents = [
            {"fingerprint": list(fp), **v}
            for fp, v in sorted(
                self.incidents.items(), key=lambda kv: (kv[0][0] == "DETECTED", -kv[1]["count"])
            )
        ]
        argv = [
            "kvchaos",
            "soak",
            "--budget",
            self.args.budget,
            "--device",
            self.device,
            "--shard",
            f"{self.shard[0]}/{self.shard[1]}",
            "--seed-start",
            str(self.seed_start),
            "--per-run-timeout",
            f"{self.args.per_run_timeout:g}",
        ]
        return {
            "soak": self.id,
            "folder": str(self.dir),
            "commit": self.commit,
            "device": self.device,
            "budget_s": self.budget,
            "elapsed_s": round(elapsed, 1),
            "shard": list(self.shard),
            "seed_start": self.seed_start,
            "first_seed": self.first_seed,
            "last_seed": self.last_seed,
            "runs": self.runs,
            "cut_at_budget_end": self.cut,
            "steps": self.steps,
            "steps_per_s": round(self.steps / elapsed, 1) if elapsed else 0,
            "verdicts": dict(self.counts),
            "determinism": {"replayed": self.replays, "mismatches": self.nondet},
            "incidents": incidents,
            "unexpected": self.unexpected,
            "rss": rss,
            "exit_code": code,
            "exit_meaning": _exit_meaning(code),
            "command": " ".join(argv),
            "ledger": str(self.ledger_path()),
            "injected_hang_every": self.args.inject_hang_every,
        }

    def ledger_path(self) -> Path:
        return (
            Path(self.args.ledger)
            if self.args.ledger
            else Path(self.args.report_dir) / "ledger.sqlite"
        )


def _exit_meaning(code: int) -> str:
    if code == 0:
        return "nothing unexpected"
    if code == EXIT_NONDETERMINISM:
        return "nondeterminism: a replayed run's history differed from the original"
    return next(f"{v}: {MEANING[v]}" for v, c in EXIT_CODES.items() if c == code)


def _dur(s: float) -> str:
    s = int(s)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
    )


# -- the summary ------------------------------------------------------------------------------
def _rss_line(rss: dict) -> str:
    if "growth_pct" not in rss:
        return "not measured (the soak ended before the baseline sample)"
    return (
        f"soak process {rss['baseline_mb']:.1f} MiB at {rss['baseline_at_s']:g} s -> {rss['end_mb']:.1f} MiB at "
        f"the end ({rss['growth_pct']:+.2f}%), peak {rss['peak_mb']:.1f} MiB; worker "
        f"{rss['worker_baseline_mb']:.1f} -> {rss['worker_end_mb']:.1f} MiB "
        f"({rss.get('worker_growth_pct', 0):+.2f}%), peak {rss['worker_peak_mb']:.1f} MiB"
    )


def render_md(s: dict, brief: bool = False) -> str:
    out = [
        f"# kvchaos soak {s['soak']}",
        "",
        f"- result: **exit {s['exit_code']}** ({s['exit_meaning']})",
        f"- {s['runs']} runs in {_dur(s['elapsed_s'])} of a {_dur(s['budget_s'])} budget on {s['device']}, "
        f"commit {s['commit']}, shard {s['shard'][0]}/{s['shard'][1]}, seeds {s['first_seed']}..{s['last_seed']}"
        + (
            f" ({s['cut_at_budget_end']} run stopped at the budget's end, not counted)"
            if s["cut_at_budget_end"]
            else ""
        ),
        "- verdicts: "
        + (", ".join(f"{v} {n}" for v, n in sorted(s["verdicts"].items())) or "none"),
        f"- {s['steps']} engine steps, {s['steps_per_s']} steps/s",
        f"- determinism: {s['determinism']['replayed']} runs replayed, "
        f"{len(s['determinism']['mismatches'])} mismatches",
        f"- memory (RSS): {_rss_line(s['rss'])}",
        f"- rerun this soak: `{s['command']}`; ledger: `{s['ledger']}`",
    ]
    if brief:
        return "\n".join(out)
    if s["determinism"]["mismatches"]:
        out += [
            "",
            "## Nondeterminism",
            "",
            "| seed | verdict | replayed verdict | digest | replay digest | run |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {m['seed']} | {m['verdict']} | {m['replay_verdict']} | `{(m['digest'] or '')[:12]}` | "
            f"`{m['replay_digest'][:12]}` | `{m['run_dir']}` |"
            for m in s["determinism"]["mismatches"]
        ]
    out += [
        "",
        "## Incidents by fingerprint",
        "",
        "Fingerprint: label (verdict, or DETECTED for a planted defect caught as expected) / failure mode / "
        "checker / finding kind. Fastest: the seed where it showed at the earliest step.",
        "",
        "| fingerprint | runs | first seed | fastest seed (step) | reproduce |",
        "|---|---|---|---|---|",
    ]
    for inc in s["incidents"]:
        out.append(
            f"| {fp_text(inc['fingerprint'])} | {inc['count']} | {inc['first_seed']} | "
            f"{inc['fastest_seed']} ({inc['fastest_step']}) | `kvchaos replay {inc['fastest_run']}`; "
            f"`kvchaos shrink {inc['fastest_run']}` |"
        )
    if not s["incidents"]:
        out.append("| none | | | | |")
    out += ["", "## Unexpected runs", ""]
    if s["unexpected"]:
        out += ["| verdict | seed | mix | summary | run |", "|---|---|---|---|---|"]
        out += [
            f"| {u['verdict']} | {u['seed']} | {u['mix'].split(': ', 1)[-1]} | {u['summary'].replace('|', '/')} | "
            f"`{u['run_dir']}` |"
            for u in s["unexpected"]
        ]
    else:
        out.append("none")
    return "\n".join(out) + "\n"


def _table(headers: tuple, rows: str) -> str:
    if not rows:
        return "<p>none</p>"
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in headers) + f"</tr>{rows}</table>"


def render_html(s: dict) -> str:
    e = html.escape
    bad = s["exit_code"] != 0
    rows = "".join(
        f"<tr><td>{e(fp_text(i['fingerprint']))}</td><td>{i['count']}</td><td>{i['first_seed']}</td>"
        f"<td>{i['fastest_seed']} (step {i['fastest_step']})</td><td><code>kvchaos replay "
        f"{e(i['fastest_run'])}</code></td></tr>"
        for i in s["incidents"]
    )
    unexp = "".join(
        f"<tr><td>{e(u['verdict'])}</td><td>{u['seed']}</td><td>{e(u['mix'])}</td>"
        f"<td>{e(u['summary'])}</td><td><code>{e(u['run_dir'])}</code></td></tr>"
        for u in s["unexpected"]
    )
    nondet = "".join(
        f"<tr><td>{m['seed']}</td><td>{e(m['verdict'])}</td><td>{e(m['replay_verdict'])}</td>"
        f"<td><code>{e(str(m['digest'])[:12])}</code></td><td><code>{e(m['replay_digest'][:12])}</code>"
        f"</td><td><code>{e(m['run_dir'])}</code></td></tr>"
        for m in s["determinism"]["mismatches"]
    )
    verdicts = "".join(f"<li>{e(v)}: {n}</li>" for v, n in sorted(s["verdicts"].items()))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kvchaos soak {e(s["soak"])}</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:80em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}}th{{background:#f3f3f3}}
.bad{{color:#b00020}}.ok{{color:#1b7f3b}}code{{font-size:90%}}</style></head><body>
<h1>kvchaos soak {e(s["soak"])}</h1>
<p class="{"bad" if bad else "ok"}"><b>exit {s["exit_code"]}</b>: {e(s["exit_meaning"])}</p>
<p>{s["runs"]} runs in {_dur(s["elapsed_s"])} of a {_dur(s["budget_s"])} budget on {e(s["device"])}, commit
{e(s["commit"])}, shard {s["shard"][0]}/{s["shard"][1]}, seeds {s["first_seed"]}..{s["last_seed"]};
{s["steps"]} engine steps ({s["steps_per_s"]} steps/s); {s["determinism"]["replayed"]} determinism replays,
{len(s["determinism"]["mismatches"])} mismatches.</p>
<ul>{verdicts}</ul>
<p>Memory (RSS): {e(_rss_line(s["rss"]))}</p>
<p>Rerun: <code>{e(s["command"])}</code>; ledger: <code>{e(s["ledger"])}</code></p>
<h2>Nondeterminism</h2>{_table(("seed", "verdict", "replayed", "digest", "replay digest", "run"), nondet)}
<h2>Incidents by fingerprint</h2>
<p>label (verdict, or DETECTED for a planted defect caught as expected) / failure mode / checker / finding kind</p>
{_table(("fingerprint", "runs", "first seed", "fastest seed", "reproduce"), rows)}
<h2>Unexpected runs</h2>{_table(("verdict", "seed", "mix", "summary", "run"), unexp)}
</body></html>
"""


# -- the command ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--budget", required=True, help="how long to soak: 90s, 5m, 1h30m")
    p.add_argument(
        "--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N"
    )
    p.add_argument(
        "--shard",
        default="1/1",
        metavar="I/N",
        help="take every N-th seed, offset I-1 (default 1/1)",
    )
    p.add_argument(
        "--per-run-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help=f"a run still going after S s is stopped, and killed {KILL_GRACE_S:g} s later (default 120)",
    )
    p.add_argument(
        "--report-dir", default="reports", help="the soak's folder goes here (default: reports)"
    )
    p.add_argument(
        "--seed-start",
        type=int,
        default=None,
        metavar="N",
        help="first seed (default: after the highest seed in the ledger)",
    )
    p.add_argument(
        "--ledger",
        default=None,
        metavar="PATH",
        help="SQLite seed ledger (default: REPORT_DIR/ledger.sqlite)",
    )
    p.add_argument(
        "--keep",
        choices=("incidents", "all"),
        default="incidents",
        help="keep every run's history.jsonl (all), or only those of runs that are not PASS or are "
        "the first or fastest of a fingerprint (incidents, the default)",
    )
    p.add_argument(
        "--plots",
        choices=("none", "incidents", "all"),
        default=os.environ.get("KVCHAOS_PLOTS", "none"),
        help="plots in each run's report.html (default: none, or $KVCHAOS_PLOTS; "
        "`kvchaos analyze RUN_DIR` draws them later)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no live display, only the summary")
    p.add_argument(
        "--inject-hang-every", type=int, default=None, help=argparse.SUPPRESS
    )  # tests the hang kill


def main(args) -> int:
    return Soak(args).run()


if __name__ == "__main__":
    from kvchaos.harness.cli import main as cli_main

    sys.exit(cli_main(["soak", *sys.argv[1:]]))
