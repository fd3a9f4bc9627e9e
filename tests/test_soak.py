"""Soak: budget and shard parsing, the random scenario space, a CPU soak of 30 runs under a
12 MB disk cap that kills an injected hang and goes on (ledger, summary with its links,
INCONCLUSIVE causes, plot and rerun command, determinism replays, passing runs beyond --keep
deleted), the cap's stages, nondeterminism reported as such; timing: a 30 s soak keeps its budget
and samples its memory, and (with KVCHAOS_LONG=1) the 5-minute soak with its memory check."""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import io
import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvchaos.engine.errors import KVChaosError
from kvchaos.faults import REGISTRY
from kvchaos.harness.check.verdict import EXIT_CODES
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.run import isolate
from kvchaos.harness.scenario.spec import parse_scenario
from kvchaos.harness.tools.fingerprint import fingerprints
from kvchaos.harness.tools.ledger import main as ledger_main
from kvchaos.harness.tools.ledger import parse_keep, parse_size
from kvchaos.harness.tools.soak import Soak, add_arguments, parse_budget
from kvchaos.harness.tools.soak_space import SPACE, generate_scenario, parse_shard, shard_seed
from kvchaos.harness.tools.soak_summary import EXIT_DISK_CAP, EXIT_NONDETERMINISM

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


def test_thousands_of_draws_each_load_as_a_valid_scenario():
    """The fits of several faults drawn together keep every fault's own needs (seed 1607 drew
    a leak retry beside an async preempt, whose small pool broke the retry's floor); the host
    tier's mixes among them, each of the modes it runs beside drawn."""
    bad, beside = [], set()
    for seed in range(4000):
        d = generate_scenario(seed)
        try:
            parse_scenario(d, f"<soak {seed}>").engine_config()
        except KVChaosError as e:
            bad.append(str(e))
        if "offload" in d["engine"]:
            beside |= {(seed, f["name"]) for f in d["faults"][1:] if f["name"] != "async_free"}
    assert bad == []
    assert {n for _, n in beside} == {
        "table_overflow",
        "refcount_leak",
        "ordering_race",
        "prefix_cache",
    }
    assert len({s for s, _ in beside}) > 150  # of ~600 tier seeds, about half mixed


def test_random_scenarios_are_valid_seeded_and_within_the_declared_ranges():
    seen_faults, planted = set(), 0
    for seed in range(300):
        d = generate_scenario(seed)
        assert d == generate_scenario(seed)
        if "offload" in d["engine"]:  # a host-tier seed: tests/test_soak_tier.py
            continue
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
            fit = SPACE["ordering_race_variants"].get(f.params.get("variant"), {})
            for k, v in f.params.items():
                if f.name == "ordering_race" and (k == "variant" or k in fit):  # its own stream
                    assert v == fit[k] if k in fit else v in SPACE["ordering_race_variants"]
                    continue
                # variant params drawn on a stream of their own: from their own declared range
                own = {
                    "refcount_leak": SPACE["leak_variant"],
                    "staging_stall": SPACE["staging_variant"],
                }
                own = own.get(f.name, {})
                spec = SPACE["faults"][f.name][k] if k in SPACE["faults"][f.name] else own[k]
                if (f.name, k) == ("table_overflow", "variant"):  # or its geometry stream's
                    spec = spec + SPACE["table_overflow_geometry"]["variant"]
                if isinstance(spec, list):
                    assert v in spec, (seed, f.name, k, v)
                if isinstance(spec, tuple):
                    assert spec[0] <= v <= spec[1], (seed, f.name, k, v)
        want = sorted(
            {d for f in sc.faults if f.defect for d in REGISTRY[f.name].detectors_for(f.params)}
        )
        assert sc.expect.outcome == ("detect" if want else "clean")
        assert sorted(sc.expect.checkers) == want
        planted += bool(want)
    assert seen_faults == set(REGISTRY) - {"offload"}  # the host tier's: not in the mix yet
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


def _soak_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--budget", "30s", "--device", "cpu", "--report-dir", str(tmp_path)]
    return p.parse_args([*base, "--seed-start", "0", "--quiet", *extra])


def _du(path: Path) -> int:
    """Bytes allocated under path, as `du` counts them (the test's own count, not the soak's)."""
    total = path.lstat().st_blocks * 512
    for d, dirs, files in os.walk(path):
        total += sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for n in dirs + files)
    return total


CAP = 12_000_000  # --max-disk 12MB: runs with prefix-cache findings carry their evidence
HANG_EVERY, RUNS = 20, 30


class HangClock:
    """The runs' clock for their time limit (isolate.clock): it runs only while a run with an
    injected hang is in progress, so the hang is stopped at its limit and no other run, however
    slow on a busy machine, ever meets it."""

    def __init__(self) -> None:
        self.spent, self.since = 0.0, None

    def __call__(self) -> float:
        now = time.monotonic()
        return self.spent + (now - self.since if self.since is not None else 0.0)

    def watch(self, run_isolated):
        def run(*args, inject_hang: bool = False, **kw):
            self.since = time.monotonic() if inject_hang else None
            try:
                return run_isolated(*args, inject_hang=inject_hang, **kw)
            finally:
                self.spent, self.since = self(), None

        return run


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """One CPU soak of 30 runs (a number, not a time: `--max-runs`, the budget far off) under a
    12 MB cap that keeps 3 passing runs, with an injected hang every 20 runs, stopped at its
    2 s limit on the clock above; the tests below read what it left."""
    root = tmp_path_factory.mktemp("soak")
    argv = ["soak", "--budget", "1h", "--max-runs", str(RUNS), "--device", "cpu"]
    argv += ["--per-run-timeout", "2", "--report-dir", str(root), "--seed-start", "0"]
    argv += ["--inject-hang-every", str(HANG_EVERY), "--quiet", "--keep", "3", "--max-disk", "12MB"]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        clock = HangClock()
        mp.setattr(isolate, "clock", clock)
        mp.setattr(isolate, "run_isolated", clock.watch(isolate.run_isolated))
        mp.setenv("KVCHAOS_PLOTS", "none")  # the soak sets it for its workers: not for the tests
        rc = cli_main(argv)
    (folder,) = [d for d in root.iterdir() if d.name.startswith("soak-")]
    db = sqlite3.connect(root / "ledger.sqlite")
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute("SELECT * FROM runs ORDER BY id")]
    soaks = [tuple(r) for r in db.execute("SELECT runs, exit_code FROM soaks")]
    db.close()
    s = json.loads((folder / "soak.json").read_text())
    proc = SimpleNamespace(returncode=rc, stdout=out.getvalue())
    return SimpleNamespace(root=root, folder=folder, s=s, rows=rows, soaks=soaks, proc=proc)


def test_a_capped_soak_stays_under_its_disk_cap(capped):
    s, used = capped.s, _du(capped.root)  # the soak's folder and the ledger: all it wrote
    assert s["runs"] > HANG_EVERY, capped.proc.stdout + capped.proc.stderr
    assert used < CAP, f"{used} bytes on disk, cap {CAP}"
    assert s["disk"]["cap_bytes"] == CAP and abs(s["disk"]["used_bytes"] - used) < 16 * 1024
    assert not (capped.folder / "scenarios").exists()
    for d in (capped.folder / "runs").iterdir():  # the scenario once per run
        if d.is_dir() and not d.is_symlink():
            assert (d / "scenario.toml").is_file() and not (d / "scenario.json").exists()


def test_short_soak_kills_an_injected_hang_and_goes_on(capped):
    s, rows, p = capped.s, capped.rows, capped.proc
    assert (capped.folder / "soak-summary.md").read_text().startswith(f"# kvchaos soak {s['soak']}")
    # the 20th run hangs (outside any call into the manager): stopped at 2 s, as `kvchaos run`
    # stops one, and recorded from its history as ERROR; the soak goes on after it
    assert s["verdicts"].get("ERROR", 0) >= 1
    assert p.returncode == s["exit_code"] != 0
    assert s["runs"] == RUNS and s["stopped"] is None  # it ran every run asked for
    assert len(rows) == s["runs"] and [r["seed"] for r in rows] == list(range(s["runs"]))
    hung = rows[HANG_EVERY - 1]
    assert hung["verdict"] == "ERROR" and hung["history_digest"] is None
    res = json.loads((Path(hung["run_dir"]) / "results.json").read_text())
    assert res["error"]["error"] == "Timeout" and "timed out after 2 s" in res["summary"]
    assert res["worker"] == {"ended": "timeout", "status": None}
    assert res["python_hash_seed"] == "0"  # the fork server's, as every run's and replay's
    # a report for the summary to link to (unless the report itself broke: then it says so)
    assert (Path(hung["run_dir"]) / "report.html").is_file() or "report_error" in res
    assert json.loads(hung["scenario_json"]) == generate_scenario(HANG_EVERY - 1)
    assert rows[HANG_EVERY]["history_digest"] is not None  # the run after the hang really ran
    for r in rows:
        assert f"--seed {r['seed']}" in r["command"]
    # determinism: the first run that is not an ERROR (and every 20th) was replayed and matched
    assert s["determinism"]["replayed"] >= 1 and s["determinism"]["mismatches"] == []
    checked = [r["determinism"] for r in rows if r["determinism"]]
    assert "identical" in checked and set(checked) <= {"identical", "cut"}
    assert capped.soaks == [(s["runs"], s["exit_code"])]
    inc = {tuple(i["fingerprint"]): i for i in s["incidents"]}
    assert inc[("ERROR", "-", "runner", "Timeout")]["first_seed"] == HANG_EVERY - 1
    hangs = list(range(HANG_EVERY - 1, RUNS, HANG_EVERY))
    assert [k for k, r in enumerate(rows) if r["verdict"] == "ERROR"] == hangs  # no other run


def test_passing_runs_beyond_keep_are_deleted_and_findings_kept(capped, tmp_path):
    s, rows = capped.s, capped.rows
    for r in rows:
        if r["verdict"] not in ("PASS", "INCONCLUSIVE"):  # every finding keeps its folder
            assert r["run_dir"] and (Path(r["run_dir"]) / "results.json").is_file(), r
    for cause in s["inconclusive"]:  # INCONCLUSIVE is no finding: its cause's examples stay
        assert cause["links"], cause
    kept = {k["run_dir"]: k for k in s["kept"]}
    # INCONCLUSIVE runs beyond their cause's examples are sampled like passing ones
    passing = [r for r in rows if r["verdict"] in ("PASS", "INCONCLUSIVE")]
    sampled = [r for r in passing if r["run_dir"] and kept[r["run_dir"]]["why"] == "passing"]
    cited = {i[k] for i in s["incidents"] for k in ("first_run", "fastest_run")}
    assert len(sampled) == s["disk"]["kept_passing"] <= 3
    examples = {d for c in s["inconclusive"] for d in c["links"]}
    assert all(
        r["run_dir"] in cited or r["verdict"] == "INCONCLUSIVE"
        for r in passing
        if r["run_dir"] and r not in sampled
    )
    assert examples or not any(r["verdict"] == "INCONCLUSIVE" for r in rows)
    gone = [r for r in passing if r["run_dir"] is None]
    # all but the sample, the cited and the examples (how many are cited is the runs' mix: a
    # stall's detection is measured time, so a busy machine cites others)
    least = len(passing) - 3 - len(cited) - len(examples)
    assert len(gone) == s["disk"]["deleted_runs"] >= least > 0
    on_disk = {
        d.name for d in (capped.folder / "runs").iterdir() if not d.is_symlink() and d.is_dir()
    }
    assert on_disk == {Path(r["run_dir"]).name for r in rows if r["run_dir"]}
    assert sorted(json.loads((capped.folder / "runs" / "index.json").read_text())) == sorted(
        on_disk
    )
    # a deleted run's ledger row still replays it: its scenario comes out of the ledger
    row = gone[0]
    rebuild, run = row["command"].split(" && ")
    argv = shlex.split(rebuild)
    assert argv[:3] == ["python", "-m", "kvchaos.harness.tools.ledger"]
    toml = tmp_path / argv[argv.index("--out") + 1]
    assert ledger_main([*argv[3:-1], str(toml)]) == 0
    run = shlex.split(run)
    run[2] = str(toml)
    assert cli_main([*run[1:], "--report-dir", str(tmp_path / "r"), "--quiet"]) == 0
    res = json.loads((tmp_path / "r" / "latest" / "results.json").read_text())
    assert res["history_digest"] == row["history_digest"]


def test_the_summary_links_each_kept_run_and_shows_causes_plot_and_rerun(capped):
    s, folder = capped.s, capped.folder
    page = (folder / "soak-summary.html").read_text()
    md = (folder / "soak-summary.md").read_text()
    hrefs = re.findall(r'href="([^"]+)"', page) + re.findall(r"\]\((runs/[^)]+)\)", md)
    assert all(not h.startswith(("/", "http")) and (folder / h).is_file() for h in hrefs), hrefs
    linked = {Path(h).parent.name for h in hrefs if h.endswith(("/report.html", "/results.json"))}
    assert linked == {Path(r["run_dir"]).name for r in capped.rows if r["run_dir"]}
    for h in hrefs:  # results.json only where the report could not be written
        if h.endswith("/results.json"):
            assert "report_error" in json.loads((folder / h).read_text()), h
    # INCONCLUSIVE by cause: every such run counted under at least one cause
    n = s["verdicts"].get("INCONCLUSIVE", 0)
    assert n > 0, s["verdicts"]  # seeds 0.. of the soak space always have some
    assert n <= sum(c["count"] for c in s["inconclusive"])
    assert "INCONCLUSIVE runs by cause" in page and "INCONCLUSIVE runs by cause" in md
    for c in s["inconclusive"]:
        assert f"<td>{html.escape(c['cause'])}</td><td>{c['count']}</td>" in page
    assert any(c["cause"].endswith(" never fired") for c in s["inconclusive"])
    # the plot, embedded: the page needs nothing beside it
    png = re.search(r'<img class="plot" [^>]*src="data:image/png;base64,([^"]+)"', page)
    assert png and base64.b64decode(png.group(1)).startswith(b"\x89PNG")
    assert s["timeline"]["runs"][-1] == s["runs"]
    assert not re.search(r'src="(?!data:)', page)
    # the rerun command, with its report dir
    argv = shlex.split(s["command"])
    assert argv[argv.index("--report-dir") + 1] == str(capped.root)
    assert argv[argv.index("--max-disk") + 1] == "12MB" and argv[argv.index("--keep") + 1] == "3"
    assert html.escape(s["command"]) in page and s["command"] in md
    assert "--report-dir" in capped.proc.stdout  # the printed summary too


@pytest.mark.timing
def test_a_soak_keeps_to_its_budget_and_samples_its_memory(tmp_path):
    """What the clock decides: a 30 s budget is kept (a run still going when it is spent is cut)
    and memory is sampled from a fifth of it on."""
    budget = 30
    cmd = [sys.executable, "-m", "kvchaos.harness.cli", "soak", "--budget", f"{budget}s"]
    cmd += ["--device", "cpu", "--report-dir", str(tmp_path), "--seed-start", "0", "--quiet"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=budget + 120)
    wall = time.monotonic() - t0
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    s = json.loads((folder / "soak.json").read_text())
    assert p.returncode == s["exit_code"] and s["runs"] >= 1, p.stdout + p.stderr
    assert wall < budget + 20, f"took {wall:.0f} s for a {budget} s budget"
    assert s["elapsed_s"] <= budget + 3
    assert {"baseline_mb", "end_mb", "growth_pct", "worker_end_mb"} <= set(s["rss"])


def test_disk_sizes_and_keep_counts_parse():
    assert parse_size("500MB") == 500 * 10**6 and parse_size("750MiB") == 750 * 2**20
    assert parse_size("1.5G") == 1.5e9 and parse_size("2gb") == 2 * 10**9
    assert parse_size("5 MB") == 5 * 10**6 and parse_size("2000000") == 2 * 10**6
    assert parse_keep("20") == 20 and parse_keep("0") == 0 and parse_keep("all") is None
    for bad in ("", "lots", "5XB", "-5MB", "MB", "1.2.3MB"):
        with pytest.raises(ValueError, match="--max-disk"):
            parse_size(bad)


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--max-disk", "lots", "--max-disk 'lots': expected a size such as 500MB, 2GB or 750MiB"),
        ("--max-disk", "10KB", "--max-disk '10KB': must be at least 1MB"),
        ("--keep", "-1", "--keep '-1': expected how many passing runs to keep"),
        ("--keep", "some", "--keep 'some': expected how many passing runs to keep"),
    ],
)
def test_bad_max_disk_or_keep_is_one_clear_error(capsys, tmp_path, flag, value, says):
    assert cli_main(["soak", "--budget", "1m", flag, value, "--report-dir", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvchaos: error: {says}")
    assert not list(tmp_path.iterdir())  # nothing started


def _disk_runs(soak: Soak, monkeypatch) -> None:
    """Stands in for the isolated runs: each run writes a folder of about 80 KB (history 60 KB);
    every third run is INCONCLUSIVE with a cause of its own (so kept as an example), the others
    PASS; every replay is identical."""
    from kvchaos.harness.tools import replay

    def run(job, timeout_s, tick):
        seed = job["seed"]
        d = soak.dir / "runs" / f"x-soak-{seed}-s{seed}"
        d.mkdir()
        verdict, summary = (
            ("PASS", "clean")
            if seed % 3
            else ("INCONCLUSIVE", f"planted defect never fired: f{seed}")
        )
        (d / "history.jsonl").write_bytes(b"{}\n" * 20_000)
        (d / "report.html").write_text("<html></html>")
        (d / "scenario.toml").write_text("")
        results = {"verdict": verdict, "seed": seed, "summary": summary, "scenario": "soak"}
        (d / "results.json").write_text(json.dumps(results))
        cmd = f"kvchaos run {d}/scenario.toml --seed {seed} --device cpu"
        return {**results, "run_dir": str(d), "steps": 5, "digest": f"d{seed}"} | {
            "command": cmd,
            "fingerprints": [],
            "ended": None,
        }

    soak._run = run
    monkeypatch.setattr(replay, "replay", lambda *a: {"identical": True, "replay_worker": None})


def test_at_the_cap_passing_runs_go_first_then_the_soak_stops(tmp_path, capsys, monkeypatch):
    soak = Soak(_soak_args(tmp_path, "--max-disk", "1MB", "--keep", "50"))
    _disk_runs(soak, monkeypatch)
    assert soak.run() == EXIT_DISK_CAP
    assert "stopped at the disk cap" in capsys.readouterr().err
    assert _du(tmp_path) < 10**6
    s = json.loads((soak.dir / "soak.json").read_text())
    assert "stopped at the disk cap" in s["stopped"]  # not at the budget's end
    assert (
        s["exit_code"] == EXIT_DISK_CAP
        and "stopped at the disk cap" in (soak.dir / "soak-summary.md").read_text()
    )
    closed = s["disk"]["passing_closed_at_run"]
    assert closed and closed < s["runs"]  # first the passing runs stopped being kept ...
    kept = {k["seed"]: k for k in s["kept"]}
    assert all(seed < closed for seed, k in kept.items() if k["verdict"] == "PASS")
    # ... and every finding stayed until the soak stopped
    assert [k for k in range(0, s["runs"], 3) if k not in kept] == []
    db = sqlite3.connect(soak.ledger_file)
    assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (s["runs"],)
    assert db.execute("SELECT exit_code FROM soaks").fetchall() == [(EXIT_DISK_CAP,)]


def test_a_finding_over_the_cap_gives_up_the_passing_sample_then_its_history(tmp_path):
    soak = Soak(_soak_args(tmp_path, "--max-disk", "1MB"))
    keeper = soak.keeper

    def run(seed: int, why: str, history: int) -> str:
        d = soak.dir / "runs" / f"r{seed}"
        d.mkdir()
        (d / "history.jsonl").write_bytes(b"x" * history)
        (d / "report.html").write_text("r")
        info = {"seed": seed, "command": f"kvchaos run {d}/scenario.toml --seed {seed}"}
        row = soak.ledger.add_run(soak="x", time="t", seed=seed, verdict="PASS", run_dir=str(d))
        return keeper.settle(str(d), row, why, info)

    assert [run(0, "passing", 100_000), run(1, "passing", 100_000)] == ["sampled", "sampled"]
    assert run(2, "finding", 700_000) == "trimmed"  # the sample went first, then its history
    assert keeper.sample == [] and keeper.deleted == 2
    assert (soak.dir / "runs" / "r2" / "report.html").is_file()
    assert keeper.used() + keeper.end_reserve() <= keeper.cap


def test_passing_runs_beyond_keep_are_deleted_unless_cited(tmp_path):
    def soak_with(n_passing: int, name: str) -> tuple[Soak, dict]:
        folder = tmp_path / name
        soak = Soak(_soak_args(folder, "--keep", "3"))
        dirs = {}

        def run(seed: int, verdict: str, fps: list) -> None:
            d = soak.dir / "runs" / f"run{seed}"
            d.mkdir()
            (d / "report.html").write_text("r")
            job = {"seed": seed, "scenario": generate_scenario(seed), "hang": False}
            fps = [{"fp": fp, "step": step} for fp, step in fps]
            r = {"run_dir": str(d), "verdict": verdict, "summary": "", "steps": 9, "digest": "d"}
            r |= {"command": f"kvchaos run {d}/scenario.toml --seed {seed}", "fingerprints": fps}
            soak._keep(job, r, soak._record(job, r, 0.1))
            dirs[seed] = d

        fp = ("DETECTED", "table_overflow", "table_integrity", "overlong")
        run(0, "PASS", [(fp, 5)])  # first: kept
        run(1, "PASS", [(fp, 3)])  # fastest: kept, until ...
        run(2, "PASS", [(fp, 1)])  # ... this one is faster
        run(3, "FAIL", [(("FAIL", "-", "liveness", "starvation"), 4)])
        run(4, "INCONCLUSIVE", [])
        for seed in range(5, 5 + n_passing):
            run(seed, "PASS", [])
        return soak, dirs

    soak, dirs = soak_with(30, "a")
    on_disk = sorted(seed for seed, d in dirs.items() if d.exists())
    sample = [seed for seed in on_disk if seed >= 5]
    assert on_disk[:4] == [0, 2, 3, 4] and len(sample) == 3  # 1 is no longer cited
    assert soak.incidents[("DETECTED", "table_overflow", "table_integrity", "overlong")][
        "fastest_run"
    ] == str(dirs[2])
    gone = soak.ledger.db.execute("SELECT seed, command FROM runs WHERE run_dir IS NULL").fetchall()
    assert sorted(seed for seed, _ in gone) == sorted(set(range(35)) - set(on_disk))
    assert all(c.startswith("python -m kvchaos.harness.tools.ledger ") for _, c in gone)
    again, dirs2 = soak_with(30, "b")  # the sample is seeded: the same on a rerun
    assert sorted(seed for seed, d in dirs2.items() if d.exists()) == on_disk


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


def test_a_replay_mismatch_is_nondeterminism_not_a_retry(tmp_path):
    """A real run and its replay, each in a fresh worker; the recorded history is then altered
    (as an engine that answers differently run to run would have made it): a mismatch."""
    soak = Soak(_soak_args(tmp_path, "--seed-start", "3"))
    job = soak._job(0)
    r = soak._run(job, 60, lambda: None)
    assert r["ended"] is None and r["digest"]
    row = soak._record(job, r, 0.5)
    with open(Path(r["run_dir"]) / "history.jsonl", "a") as f:
        f.write(json.dumps({"e": "note", "step": 0, "altered": True}) + "\n")
    soak._replay(job, r, row, time.monotonic() + 60)
    assert soak.counts[r["verdict"]] == 1 and soak.counts["NONDETERMINISM"] == 1
    (m,) = soak.nondet
    assert m["replay_digest"] == r["digest"] != m["digest"]  # the replay ran as the run did
    assert m["replay_verdict"] == r["verdict"] != "ERROR"
    assert soak.exit_code() == EXIT_NONDETERMINISM
    assert soak.ledger.db.execute("SELECT determinism FROM runs").fetchall() == [("mismatch",)]
    soak.counts["MISSED"] += 1  # a harness miss outranks it
    assert soak.exit_code() == EXIT_CODES["MISSED"]


@pytest.mark.soak
@pytest.mark.timing
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
