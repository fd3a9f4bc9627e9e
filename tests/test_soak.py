"""Soak: budget and shard parsing, the random scenario space, a short CPU soak that kills an
injected hang and goes on (ledger, summary, determinism replays), nondeterminism reported as such,
and (with KVCHAOS_LONG=1) the 5-minute soak with its memory check."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchaos.faults import REGISTRY
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.judge.scenario import parse_scenario
from kvchaos.harness.judge.verdict import EXIT_CODES
from kvchaos.harness.tools.fingerprint import fingerprints
from kvchaos.harness.tools.soak import Soak, add_arguments, parse_budget, parse_shard, shard_seed
from kvchaos.harness.tools.soak_space import SPACE, generate_scenario
from kvchaos.harness.tools.soak_summary import EXIT_NONDETERMINISM

ROOT = Path(__file__).resolve().parent.parent


def test_budget_parsing():
    assert parse_budget("90s") == 90
    assert parse_budget("5m") == 300
    assert parse_budget("1h30m") == 5400
    assert parse_budget("2h15m30s") == 8130
    for bad in ("", "90", "5x", "m", "1.5h", "0s", "-5m", "5m1h"):
        with pytest.raises(ValueError, match="--budget"):
            parse_budget(bad)


def test_bad_budget_is_one_clear_error(capsys, tmp_path):
    assert cli_main(["soak", "--budget", "ten minutes", "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvchaos: error: --budget 'ten minutes': expected a duration such as 90s, 5m or 1h30m"
    ]
    assert (
        cli_main(["soak", "--budget", "1m", "--shard", "3/2", "--report-dir", str(tmp_path)]) == 2
    )
    assert "--shard '3/2'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started
    (tmp_path / "ledger.sqlite").write_text("not a database")
    assert cli_main(["soak", "--budget", "1m", "--report-dir", str(tmp_path)]) == 2
    assert "not a usable SQLite ledger" in capsys.readouterr().err


def test_shards_split_the_seed_space():
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "a/b", "2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    shards = [{shard_seed(100, k, (i, 4)) for k in range(50)} for i in range(1, 5)]
    assert set().union(*shards) == set(range(100, 300))
    assert sum(len(s) for s in shards) == 200  # disjoint


def test_random_scenarios_are_valid_seeded_and_within_the_declared_ranges():
    seen_faults, planted = set(), 0
    for seed in range(300):
        d = generate_scenario(seed)
        assert d == generate_scenario(seed)
        sc = parse_scenario(d, f"<soak {seed}>")
        cache = sc.engine_config().cache
        assert cache.block_size in SPACE["engine"]["block_size"]
        assert (
            1
            <= sc.workload.num_requests
            <= max(SPACE["workload"]["num_requests"][1], SPACE["stall_workload"]["num_requests"][1])
        )
        names = [f.name for f in sc.faults]
        seen_faults |= set(names)
        if "ordering_race" in names:
            assert sc.engine_config().tp_size == 2
        if "staging_stall" not in names:  # the workload's own requests fit a row
            assert (
                sc.workload.prompt_len.max + sc.workload.output_len.max <= cache.max_tokens_per_seq
            )
        for f in sc.faults:
            for k, v in f.params.items():
                spec = SPACE["faults"][f.name][k]
                if isinstance(spec, tuple):
                    assert spec[0] <= v <= spec[1], (seed, f.name, k, v)
        want = sorted({d for f in sc.faults if f.defect for d in REGISTRY[f.name].detectors})
        assert sc.expect.outcome == ("detect" if want else "clean")
        assert sorted(sc.expect.checkers) == want
        planted += bool(want)
    assert seen_faults == set(REGISTRY)
    assert 60 < planted < 240  # a real mix of detect and clean runs
    assert generate_scenario(1) != generate_scenario(2)


def test_fingerprints_name_the_failure_mode_checker_and_kind():
    faults = [
        {"name": "table_overflow", "defect": True},
        {"name": "refcount_leak", "defect": False},
    ]
    results = {
        "verdict": "PASS",
        "steps": 30,
        "expectation": {"checkers": ["table_integrity"]},
        "checkers": [
            {
                "checker": "oracle_divergence",
                "valid": False,
                "findings": [{"checker": "oracle_divergence", "step": 3, "kind": "divergence"}],
            },
            {
                "checker": "table_integrity",
                "valid": False,
                "findings": [
                    {"checker": "table_integrity", "step": 5, "kind": "foreign_block"},
                    {"checker": "table_integrity", "step": 9, "kind": "foreign_block"},
                ],
            },
            {
                "checker": "block_accounting",
                "valid": False,
                "findings": [{"checker": "block_accounting", "step": 7, "kind": "leak"}],
            },
        ],
    }
    fps = fingerprints(results, faults)
    assert fps[0] == {
        "fp": ("DETECTED", "table_overflow", "table_integrity", "foreign_block"),
        "step": 5,
    }
    assert {"fp": ("DETECTED", "refcount_leak", "block_accounting", "leak"), "step": 7} in fps
    assert len(fps) == 3
    err = fingerprints({"verdict": "ERROR", "steps": 0, "error": {"error": "Timeout"}}, faults)
    assert err == [{"fp": ("ERROR", "-", "runner", "Timeout"), "step": 0}]
    missed = fingerprints(
        {
            "verdict": "MISSED",
            "steps": 9,
            "fault_verify": {"table_overflow": {"first_step": 4}},
            "time_to_detect_steps": {},
            "checkers": [],
        },
        faults,
    )
    assert missed == [{"fp": ("MISSED", "table_overflow", "-", "not_caught"), "step": 4}]


def _soak_args(tmp_path: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(
        [
            "--budget",
            "30s",
            "--device",
            "cpu",
            "--report-dir",
            str(tmp_path),
            "--seed-start",
            "0",
            "--quiet",
        ]
    )


def test_short_soak_kills_an_injected_hang_and_goes_on(tmp_path):
    budget, slack = 40, 20
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvchaos.harness.cli",
            "soak",
            "--budget",
            f"{budget}s",
            "--device",
            "cpu",
            "--per-run-timeout",
            "2",
            "--report-dir",
            str(tmp_path),
            "--seed-start",
            "0",
            "--inject-hang-every",
            "6",
            "--keep",
            "all",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=budget + 120,
    )
    wall = time.monotonic() - t0
    assert wall < budget + slack, f"took {wall:.0f} s for a {budget} s budget"
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    s = json.loads((folder / "soak.json").read_text())
    assert (folder / "soak-summary.md").read_text().startswith(f"# kvchaos soak {s['soak']}")
    assert "<h1>kvchaos soak" in (folder / "soak-summary.html").read_text()
    assert s["elapsed_s"] <= budget + 3
    # the 6th run hangs, is killed after 2 + 5 s and recorded as ERROR; the soak goes on after it
    assert s["runs"] > 6, p.stdout + p.stderr
    assert s["verdicts"].get("ERROR", 0) >= 1
    assert p.returncode == s["exit_code"] != 0
    db = sqlite3.connect(folder.parent / "ledger.sqlite")
    rows = db.execute(
        "SELECT seed, verdict, run_dir, scenario_json, command, history_digest, determinism "
        "FROM runs ORDER BY id"
    ).fetchall()
    assert len(rows) == s["runs"]
    assert [r[0] for r in rows] == list(range(s["runs"]))
    hung = rows[5]
    assert hung[1] == "ERROR" and hung[5] is None
    res = json.loads((Path(hung[2]) / "results.json").read_text())
    assert res["error"]["error"] == "Timeout" and res["error"]["injected_hang"] is True
    assert json.loads(hung[3]) == generate_scenario(5)
    assert rows[6][5] is not None  # the run after the hang really ran
    for seed, verdict, run_dir, _, command, digest, _ in rows:
        assert (Path(run_dir) / "scenario.toml").is_file() and (
            Path(run_dir) / "scenario.json"
        ).is_file()
        assert command.startswith("kvchaos run ") and f"--seed {seed}" in command
    # determinism: the first run that is not an ERROR (and every 20th) was replayed and matched
    assert s["determinism"]["replayed"] >= 1 and s["determinism"]["mismatches"] == []
    checked = [r[6] for r in rows if r[6]]
    assert "identical" in checked and set(checked) <= {"identical", "cut"}
    assert db.execute("SELECT runs, exit_code FROM soaks").fetchall() == [
        (s["runs"], s["exit_code"])
    ]
    # the kept runs' index is built once at the end and lists every one of them
    assert sorted(json.loads((folder / "runs" / "index.json").read_text())) == sorted(
        Path(r[2]).name for r in rows
    )
    inc = {tuple(i["fingerprint"][:3]): i for i in s["incidents"]}
    timeout = [i for fp, i in inc.items() if fp[0] == "ERROR" and fp[2] == "runner"]
    assert timeout and timeout[0]["first_seed"] == 5
    assert {"baseline_mb", "end_mb", "growth_pct", "worker_end_mb"} <= set(s["rss"])


def test_a_new_soak_continues_after_the_ledgers_seeds(tmp_path):
    args = _soak_args(tmp_path)
    args.seed_start = None
    soak = Soak(args)
    soak.ledger.add_run(soak="x", time="t", seed=41, verdict="PASS")
    soak.ledger.close()
    args.shard = "2/4"
    nxt = Soak(args)
    assert nxt.seed_start == 44 and shard_seed(nxt.seed_start, 0, nxt.shard) == 45
    nxt.ledger.close()


class _FakeWorker:
    """Stands in for the worker process: the replay comes back with another digest."""

    def ready(self, deadline, tick):
        return True

    def call(self, job, deadline, tick):
        return "ok", {"digest": "f" * 64, "verdict": "PASS"}

    def rss(self):
        return 0


def test_a_replay_mismatch_is_nondeterminism_not_a_retry(tmp_path):
    soak = Soak(_soak_args(tmp_path))
    soak.worker = _FakeWorker()
    data = generate_scenario(3)
    job = {"seed": 3, "scenario": data, "scenario_path": "x.toml", "hang": False}
    r = {
        "run_dir": str(tmp_path / "run"),
        "verdict": "PASS",
        "summary": "clean",
        "steps": 12,
        "digest": "a" * 64,
        "command": "kvchaos run x.toml --seed 3",
        "fingerprints": [],
    }
    row = soak._record(job, r, 0.5)
    soak._replay(job, r, row, time.monotonic() + 60, lambda: None)
    assert soak.counts["PASS"] == 1 and soak.counts["NONDETERMINISM"] == 1
    assert soak.nondet[0]["digest"] == "a" * 64 and soak.nondet[0]["replay_digest"] == "f" * 64
    assert soak.exit_code() == EXIT_NONDETERMINISM
    assert soak.ledger.db.execute("SELECT determinism FROM runs").fetchall() == [("mismatch",)]
    soak.counts["MISSED"] += 1  # a harness miss outranks it
    assert soak.exit_code() == EXIT_CODES["MISSED"]


@pytest.mark.soak
@pytest.mark.skipif(
    os.environ.get("KVCHAOS_LONG") != "1", reason="the 5-minute soak runs with KVCHAOS_LONG=1"
)
def test_five_minute_soak_stays_in_budget_and_does_not_leak(tmp_path):
    budget = 300
    t0 = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvchaos.harness.cli",
            "soak",
            "--budget",
            "5m",
            "--device",
            "cpu",
            "--per-run-timeout",
            "10",
            "--report-dir",
            str(tmp_path),
            "--seed-start",
            "0",
            "--inject-hang-every",
            "25",
            "--quiet",
        ],
        cwd=ROOT,
        timeout=budget + 180,
    )
    assert time.monotonic() - t0 < budget + 30
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    s = json.loads((folder / "soak.json").read_text())
    assert s["runs"] > 25 and s["verdicts"]["ERROR"] >= 1
    assert s["rss"]["baseline_at_s"] >= 60
    assert s["rss"]["growth_pct"] < 10, s["rss"]


def test_histories_are_pruned_unless_a_run_is_cited(tmp_path):
    soak = Soak(_soak_args(tmp_path))

    def run(seed: int, verdict: str, fps: list) -> Path:
        d = tmp_path / f"run{seed}"
        d.mkdir()
        (d / "history.jsonl").write_text("{}\n")
        job = {
            "seed": seed,
            "scenario": generate_scenario(seed),
            "scenario_path": "x.toml",
            "hang": False,
        }
        soak._record(
            job,
            {
                "run_dir": str(d),
                "verdict": verdict,
                "summary": "",
                "steps": 9,
                "digest": "d",
                "command": "c",
                "fingerprints": [{"fp": fp, "step": step} for fp, step in fps],
            },
            0.1,
        )
        return d / "history.jsonl"

    fp = ("DETECTED", "table_overflow", "table_integrity", "overlong")
    first = run(0, "PASS", [(fp, 5)])
    again = run(1, "PASS", [(fp, 5)])
    faster = run(2, "PASS", [(fp, 3)])
    clean = run(3, "PASS", [])
    alarm = run(4, "FAIL", [(("FAIL", "-", "liveness", "starvation"), 4)])
    assert [p.exists() for p in (first, again, faster, clean, alarm)] == [
        True,
        False,
        True,
        False,
        True,
    ]
    assert soak.incidents[fp]["count"] == 3 and soak.incidents[fp]["fastest_run"] == str(
        faster.parent
    )
    assert soak.ledger.db.execute("SELECT COUNT(*) FROM runs").fetchone() == (5,)
