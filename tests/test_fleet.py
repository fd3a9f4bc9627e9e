"""The fleet soak without Ray: shards merged into one ledger summarise as one soak over the union
of their seeds; an old ledger migrates; --resume fills the gaps a killed driver left, each seed
once; the mix fits a user's manager; progress lines off a terminal; --executor ray without Ray is
one line; a manager failing the check before any run ends the soak with that FAIL. (Ray itself:
tests/test_fleet_ray.py, the fleet lane.)"""

from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import sys
from pathlib import Path

import pytest

from kvchaos.faults.leak_variants import REFERENCE_ONLY
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.tools import replay, soak_progress
from kvchaos.harness.tools.ledger import Ledger
from kvchaos.harness.tools.soak import Soak, add_arguments
from kvchaos.harness.tools.soak_fleet import WHERE, fleet_summary, merge, render_fleet_md
from kvchaos.harness.tools.soak_space import SPACE, Fit, generate_scenario

TESTS = Path(__file__).resolve().parent
STARVED = ["FAIL", "-", "liveness", "starvation"]


def _args(folder: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--budget", "10m", "--device", "cpu", "--report-dir", str(folder), "--quiet"]
    return p.parse_args([*base, *extra])


def _seeded_runs(soak: Soak, monkeypatch, ran: list) -> None:
    """Stands in for the isolated runs: what a run finds is its seed's alone (every 5th a FAIL
    at step seed % 4 + 1, every 7th INCONCLUSIVE) and its digest its scenario's."""

    def run(job, timeout_s, tick):
        seed = job["seed"]
        ran.append(seed)
        d = Path(soak.ctx.runs_dir) / f"soak-{seed}-s{seed}"
        d.mkdir()
        (d / "report.html").write_text("r")
        verdict = "FAIL" if seed % 5 == 0 else "INCONCLUSIVE" if seed % 7 == 0 else "PASS"
        fps = [{"fp": STARVED, "step": seed % 4 + 1}] if verdict == "FAIL" else []
        text = json.dumps(job["scenario"], sort_keys=True).encode()
        summary = "bug found" if fps else "planted defect never fired: x" if seed % 7 == 0 else ""
        return {
            "run_dir": str(d),
            "verdict": verdict,
            "summary": summary,
            "steps": 9,
            "digest": hashlib.sha256(text).hexdigest(),
            "command": f"kvchaos run {d}/scenario.toml --seed {seed} --device cpu",
            "fingerprints": fps,
            "ended": None,
        }

    soak._run = run
    monkeypatch.setattr(replay, "replay", lambda *a: {"identical": True, "replay_worker": None})


def _soak(folder: Path, monkeypatch, *extra: str, ran: list | None = None) -> Soak:
    soak = Soak(_args(folder, *extra))
    _seeded_runs(soak, monkeypatch, [] if ran is None else ran)
    soak.run()
    return soak


def test_merged_shards_summarise_as_one_soak_over_their_seeds(tmp_path, monkeypatch, capsys):
    one = _soak(tmp_path / "one", monkeypatch, "--seed-start", "0", "--max-runs", "12")
    for i in (1, 2, 3):
        shard = ("--shard", f"{i}/3", "--seed-start", "0", "--max-runs", "4")  # its 4 seeds
        _soak(tmp_path / f"shard{i}", monkeypatch, *shard)
    shards = [tmp_path / f"shard{i}" / "ledger.sqlite" for i in (1, 2, 3)]
    fleet = tmp_path / "fleet.db"
    assert cli_main(["ledger", "merge", *map(str, shards), "-o", str(fleet)]) == 0
    assert "12 runs from 3 ledgers (0 already there skipped)" in capsys.readouterr().out
    single, merged = fleet_summary(one.ledger_file), fleet_summary(fleet)
    assert [s["seed"] for s in merged["result"]["per_seed"]] == list(range(12))
    assert merged["result"] == single["result"]
    assert merged["result"]["verdicts"] == {"FAIL": 3, "INCONCLUSIVE": 1, "PASS": 8}
    (inc,) = merged["result"]["incidents"]
    assert (inc["count"], inc["first_seed"], inc["fastest_seed"], inc["fastest_step"]) == (
        3,
        0,
        0,
        1,
    )
    md = render_fleet_md(merged)
    assert md.split(WHERE)[0] == render_fleet_md(single).split(WHERE)[0]
    assert len(merged["where"]["soaks"]) == 3 and "shard 2/3" in md.split(WHERE)[1]
    # merging again adds nothing; the fleet's summary through the command, beside the ledger
    assert merge(shards, fleet) == {"runs": 0, "duplicates": 12, "soaks": 0}
    assert cli_main(["soak", "--summary", str(fleet)]) == 11  # a FAIL among them
    assert Path(f"{fleet}.summary.md").read_text().startswith("# kvchaos fleet summary")


def test_an_old_ledger_gets_the_new_columns_with_their_defaults(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE runs (id INTEGER PRIMARY KEY, soak TEXT NOT NULL, time TEXT NOT NULL, "
        "commit_sha TEXT, scenario TEXT, scenario_json TEXT, seed INTEGER, device TEXT, "
        "verdict TEXT, duration_s REAL, steps INTEGER, command TEXT, history_digest TEXT, "
        "determinism TEXT, run_dir TEXT, fingerprints TEXT);"
        "CREATE TABLE soaks (id TEXT PRIMARY KEY, started TEXT, finished TEXT, commit_sha TEXT, "
        "device TEXT, budget_s REAL, shard TEXT, seed_start INTEGER, runs INTEGER, "
        "exit_code INTEGER, folder TEXT);"
        "INSERT INTO runs (soak, time, seed, verdict) VALUES ('s', 't', 7, 'PASS');"
    )
    db.commit()
    db.close()
    (row,) = fleet_summary(path)["result"]["per_seed"]  # read only: the defaults, unwritten
    assert row["block_manager"] == "reference"
    (got,) = Ledger(path).rows()
    assert (got["seed"], got["block_manager"], got["attempts"], got["k"]) == (
        7,
        "reference",
        1,
        None,
    )


def test_resume_runs_the_seeds_a_killed_driver_left_and_no_other(tmp_path, monkeypatch):
    first = Soak(_args(tmp_path, "--seed-start", "100", "--max-runs", "6"))
    _seeded_runs(first, monkeypatch, [])
    first._soak_row(None)  # as run() writes it first; then runs 0, 1 and 3 came back ...
    for k in (0, 1, 3):
        job = first._job(k)
        first._settle(job, {**first._run(job, 1, None), "cut": False})
    # ... and the driver was killed (no end written)
    ran: list[int] = []
    again = _soak(tmp_path, monkeypatch, "--resume", "--max-runs", "3", ran=ran)
    assert again.id == first.id and ran == [102, 104, 105]
    rows = Ledger(first.ledger_file).rows()
    assert sorted(r["k"] for r in rows) == list(range(6))
    assert sorted(r["seed"] for r in rows) == list(range(100, 106))
    assert again.runs == 6 and again.counts["FAIL"] == 2  # seeds 100 and 105, once each
    s = json.loads((again.dir / "soak.json").read_text())
    assert s["runs"] == 6 and not s["in_progress"]


def test_progress_lines_off_a_terminal_and_a_summary_as_it_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(soak_progress, "LOG_EVERY_S", 0.0)
    args = _args(tmp_path, "--seed-start", "0", "--max-runs", "3")
    args.quiet = False
    soak = Soak(args)
    _seeded_runs(soak, monkeypatch, [])
    seen = []
    real = soak.write_summary

    def write(final):
        got = real(final)
        seen.append((final, (soak.dir / "soak-summary.md").read_text()))
        return got

    soak.write_summary = write
    soak.run()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvchaos soak ")]
    assert lines and "3 runs (FAIL 1, PASS 2), " in lines[-1] and "ETA" in lines[-1]
    assert "1 new incidents (1 fingerprints)" in "".join(lines)
    partial = [md for final, md in seen if not final]
    assert partial and "**in progress**" in partial[0] and "in progress" not in seen[-1][1]


def test_the_mix_leaves_out_what_a_manager_cannot_do():
    fit = Fit(spec="m:M", block_sizes=(4, 16), capabilities=frozenset({"seq_tokens"}))
    drawn = set()
    for seed in range(40):
        ref, got = generate_scenario(seed), generate_scenario(seed, fit)
        if "offload" in ref["engine"]:  # a host-tier seed: under another manager, the mix
            ref = generate_scenario(seed, Fit(spec="ref", capabilities=frozenset({"fork"})))
        assert "prefix_cache" not in {f["name"] for f in got.get("faults", [])}
        assert got["engine"]["cache"]["block_size"] == 4
        assert got["workload"].get("fork_groups", 0) == 0
        same = {f["name"] for f in ref.get("faults", [])} - {"prefix_cache"}
        assert {f["name"] for f in got.get("faults", [])} == same  # the other draws as they were
        for f in got.get("faults", []):  # the leak classes planted on the reference's own seams
            if f["name"] == "refcount_leak":
                drawn.add(f["params"].get("variant", "any"))
    assert drawn and not drawn & set(REFERENCE_ONLY)
    assert (
        Fit(spec="m:M", capabilities=frozenset({"fork"})).block_size_choices()
        == (SPACE["engine"]["block_size"])
    )
    said = fit.left_out()
    assert any("prefix_cache" in x for x in said) and any("fork" in x for x in said)
    assert any("block sizes other than 4" in x for x in said)
    assert any("refcount_leak variants preempted, retry, partial" in x for x in said)


def test_the_ray_executor_without_ray_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    argv = ["soak", "--budget", "1m", "--executor", "ray", "--report-dir", str(tmp_path / "r")]
    assert cli_main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "pip install 'kvchaos[ray]'" in line and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_manager_failing_the_check_ends_the_soak_with_that_fail(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)  # the check imports the manager from where the soak runs
    monkeypatch.syspath_prepend(str(TESTS))
    spec = "door_managers:DoubleFreeOnAbort"
    argv = ["soak", "--budget", "5m", "--device", "cpu", "--report-dir", str(tmp_path), "-q"]
    assert cli_main([*argv, "--block-manager", spec]) == 11
    (row,) = Ledger(tmp_path / "ledger.sqlite").rows()
    assert (row["verdict"], row["block_manager"], row["seed"]) == ("FAIL", spec, None)
    assert "double free" in row["summary"] and Path(row["run_dir"], "results.json").is_file()
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    md = (folder / "soak-summary.md").read_text()
    assert f"block manager: {spec}" in md and "nothing else ran" in md
    assert "| FAIL / - / manager_calls / exception | 1 | [door check]" in md
