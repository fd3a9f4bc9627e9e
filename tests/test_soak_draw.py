"""A seed whose own draw is invalid is the soak's ERROR, recorded with its seed, param and message,
and the soak goes on to the next seed; the user's bad input is still exit 2 at once."""

from __future__ import annotations

import argparse
import json
import shlex
import sqlite3

from kvchaos.harness.check.verdict import EXIT_CODES
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.tools import replay, soak_exec
from kvchaos.harness.tools.ledger import main as ledger_main
from kvchaos.harness.tools.soak import Soak, add_arguments
from kvchaos.harness.tools.soak_space import generate_scenario

BAD_SEED = 2


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--budget", "1h", "--device", "cpu", "--report-dir", str(tmp_path), "--quiet"]
    return p.parse_args([*base, "--seed-start", "0", *extra])


def _bad_draw(seed: int, fit=None) -> dict:
    """The real draw, but seed 2's gets a variant no fault has (as a draw bug would make it)."""
    d = generate_scenario(seed, fit)
    if seed == BAD_SEED:
        d["faults"] = [{"name": "async_free", "defect": False, "params": {"variant": "nope"}}]
        d["expect"] = {"outcome": "clean"}
    return d


def _stub_runs(soak: Soak, monkeypatch) -> list[int]:
    """Each run a folder with a PASS; the seeds run, in order."""
    ran: list[int] = []

    def run(job, timeout_s, tick):
        seed = job["seed"]
        ran.append(seed)
        d = soak.dir / "runs" / f"x-soak-{seed}"
        d.mkdir()
        (d / "report.html").write_text("<html></html>")
        cmd = f"kvchaos run {d}/scenario.toml --seed {seed} --device cpu"
        return {"run_dir": str(d), "verdict": "PASS", "summary": "clean", "steps": 5} | {
            "digest": f"d{seed}", "command": cmd, "fingerprints": [], "ended": None,
        }  # fmt: skip

    soak._run = run
    monkeypatch.setattr(replay, "replay", lambda *a: {"identical": True, "replay_worker": None})
    return ran


def test_an_invalid_draw_is_that_seeds_error_and_the_soak_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(soak_exec, "generate_scenario", _bad_draw)
    soak = Soak(_args(tmp_path, "--max-runs", "6"))
    ran = _stub_runs(soak, monkeypatch)
    assert soak.run() == EXIT_CODES["ERROR"]
    assert ran == [0, 1, 3, 4, 5]  # every other seed ran; the bad one never reached a worker
    s = json.loads((soak.dir / "soak.json").read_text())
    assert s["runs"] == 6 and s["verdicts"] == {"PASS": 5, "ERROR": 1}
    assert s["exit_code"] == EXIT_CODES["ERROR"] and s["stopped"] is None
    (u,) = s["unexpected"]
    assert u["seed"] == BAD_SEED and u["verdict"] == "ERROR"
    assert f"seed {BAD_SEED}" in u["summary"] and "faults.0.params.variant" in u["summary"]
    assert "'nope'" in u["summary"]  # the validator's message, as `kvchaos run` would say it
    assert s["incidents"] == []  # no run, no folder: nothing to replay
    md = (soak.dir / "soak-summary.md").read_text()
    assert "faults.0.params.variant" in md
    db = sqlite3.connect(soak.ledger_file)
    db.row_factory = sqlite3.Row
    rows = {r["seed"]: dict(r) for r in db.execute("SELECT * FROM runs")}
    assert sorted(rows) == list(range(6)) and rows[BAD_SEED]["verdict"] == "ERROR"
    bad = rows[BAD_SEED]
    assert json.loads(bad["scenario_json"]) == _bad_draw(BAD_SEED)  # what it drew, to rebuild
    assert bad["run_dir"] is None and bad["command"].startswith("python -m kvchaos.harness")
    assert [tuple(r) for r in db.execute("SELECT exit_code FROM soaks")] == [(13,)]
    assert rows[0]["determinism"] == "identical"  # the first seed took the replay
    # its row rebuilds the drawn scenario, which `kvchaos run` refuses as bad input, naming it
    rebuild, run = bad["command"].split(" && ")
    argv = shlex.split(rebuild)
    toml = tmp_path / argv[argv.index("--out") + 1]
    assert ledger_main([*argv[3:-1], str(toml)]) == 0
    capsys.readouterr()
    run = shlex.split(run)
    assert run[:3] == ["kvchaos", "run", toml.name] and f"--seed {BAD_SEED}" in " ".join(run)
    assert cli_main(["run", str(toml), *run[3:], "--report-dir", str(tmp_path / "r")]) == 2
    assert "faults.0.params.variant" in capsys.readouterr().err


def test_the_first_seeds_replay_passes_on_past_an_invalid_draw(tmp_path, monkeypatch):
    monkeypatch.setattr(soak_exec, "generate_scenario", _bad_draw)
    soak = Soak(_args(tmp_path, "--max-runs", "4", "--seed-start", str(BAD_SEED)))
    _stub_runs(soak, monkeypatch)
    assert soak.run() == EXIT_CODES["ERROR"]
    got = soak.ledger_file
    db = sqlite3.connect(got)
    det = dict(db.execute("SELECT seed, determinism FROM runs").fetchall())
    assert det[BAD_SEED] is None and det[BAD_SEED + 1] == "identical"


def test_the_users_bad_input_is_still_exit_2_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(soak_exec, "generate_scenario", _bad_draw)
    argv = ["soak", "--budget", "1m", "--device", "cpu", "--report-dir", str(tmp_path)]
    assert cli_main([*argv, "--workers", "0"]) == 2
    assert "--workers 0: must be >= 1" in capsys.readouterr().err
    assert cli_main([*argv, "--block-manager", "no_such_kvchaos_module:Manager"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no_such_kvchaos_module" in line
    assert not list(tmp_path.glob("soak-*"))  # nothing ran
