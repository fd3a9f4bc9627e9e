"""Replay and shrink: a stored CPU run replays identically (from scenario.toml or scenario.json), a
perturbed history is reported as different at the perturbed event, and shrinking the planted
table-overflow run gives a far smaller scenario whose emitted pytest file passes. Plus the TOML
writer that both depend on."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario
from kvchaos.harness.scenario.toml_writer import dumps
from kvchaos.harness.tools.fingerprint import fingerprints
from kvchaos.harness.tools.replay import replay
from kvchaos.harness.tools.shrink import add_arguments as shrink_arguments
from kvchaos.harness.tools.shrink import main as shrink_main
from kvchaos.harness.tools.soak_space import generate_scenario

ROOT = Path(__file__).resolve().parent.parent
V1_ERA = ROOT / "tests" / "v1_era_run"  # recorded under protocol v1, before its removal


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory):
    """A stored CPU run of the planted table overflow (its folder is copied per test)."""
    d = tmp_path_factory.mktemp("runs")
    r = run_scenario(load_scenario("table-overflow-detect"), 0, "cpu", d)
    assert r.verdict == "PASS", r.summary
    return r.run_dir


@pytest.fixture
def run_dir(stored_run, tmp_path):
    import shutil

    return Path(shutil.copytree(stored_run, tmp_path / stored_run.name, symlinks=True))


def test_toml_writer_round_trips_every_builtin_scenario_and_soak_scenarios():
    for p in sorted(BUILTIN_DIR.glob("*.toml")):
        data = tomllib.loads(p.read_text())
        assert tomllib.loads(dumps(data)) == data, p
    for seed in range(50):
        data = generate_scenario(seed)
        assert tomllib.loads(dumps(data)) == data
    odd = {
        "a": 1.5e-7,
        "s": 'q"\\\n\x7f\u00e9\U0001f600',
        "k y": {"n": [1, 2.5, True], "t": {"u": False}},
        "big": {str(i): i for i in range(6)},
        "list": [{"x": 1}, {"x": 2}],
    }
    assert tomllib.loads(dumps(odd)) == odd
    with pytest.raises(ValueError, match="workload.cancel.storm_step: TOML has no null"):
        dumps({"workload": {"cancel": {"storm_step": None}}})


def test_replay_of_a_stored_cpu_run_is_identical(run_dir, capsys):
    out = replay(run_dir)
    assert out["identical"] and out["history_compared"]
    assert (
        out["replay_digest"] == json.loads((run_dir / "results.json").read_text())["history_digest"]
    )
    assert cli_main(["replay", str(run_dir)]) == 0
    assert capsys.readouterr().out.startswith("identical: table-overflow-detect seed 0 on cpu")


def test_replay_reads_scenario_json_when_there_is_no_toml(run_dir):
    data = tomllib.loads((run_dir / "scenario.toml").read_text())
    (run_dir / "scenario.toml").unlink()
    (run_dir / "scenario.json").write_text(json.dumps(data))
    assert replay(run_dir)["identical"]


def test_a_perturbed_history_is_reported_as_different(run_dir, capsys):
    lines = (run_dir / "history.jsonl").read_text().splitlines()
    at = next(
        i
        for i, line in enumerate(lines)
        if json.loads(line)["e"] == "step" and json.loads(line)["tokens"]
    )
    ev = json.loads(lines[at])
    req = sorted(ev["tokens"])[0]
    ev["tokens"][req] = (ev["tokens"][req] + 1) % 256
    ev["latency_s"] = 99.0  # a timing field: not part of the comparison
    lines[at] = json.dumps(ev)
    (run_dir / "history.jsonl").write_text("\n".join(lines) + "\n")
    out = replay(run_dir)
    assert not out["identical"]
    d = out["first_difference"]
    assert d["index"] == at and d["event"] == "step" and d["keys"] == ["tokens"]
    assert d["recorded"]["tokens"][req] != d["replayed"]["tokens"][req]
    assert cli_main(["replay", str(run_dir)]) == 1
    text = capsys.readouterr().out
    assert (
        text.startswith("DIFFERENT")
        and f"first differing event: #{at} (step at step {ev['step']})" in text
    )


def test_a_different_recorded_digest_without_history_is_different(run_dir):
    (run_dir / "history.jsonl").unlink()
    res = json.loads((run_dir / "results.json").read_text())
    res["history_digest"] = "0" * 64
    (run_dir / "results.json").write_text(json.dumps(res))
    out = replay(run_dir)
    assert not out["identical"] and not out["history_compared"] and out["first_difference"] is None


def test_replay_and_shrink_refuse_what_is_not_a_run_folder(tmp_path, capsys):
    assert cli_main(["replay", str(tmp_path / "nope")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"kvchaos: error: {tmp_path / 'nope'}: no such run folder"
    )
    (tmp_path / "results.json").write_text(json.dumps({"seed": 0, "device": "cpu"}))
    assert cli_main(["shrink", str(tmp_path)]) == 2
    assert "neither scenario.toml nor scenario.json" in capsys.readouterr().err


def _shrink(run_dir: Path, *extra: str) -> int:
    p = argparse.ArgumentParser()
    shrink_arguments(p)
    return shrink_main(p.parse_args([str(run_dir), *extra]))


def test_shrink_refuses_a_run_that_does_not_reproduce(run_dir, capsys):
    res = json.loads((run_dir / "results.json").read_text())
    res["verdict"] = "MISSED"
    (run_dir / "results.json").write_text(json.dumps(res))
    assert _shrink(run_dir) == 1
    assert "does not reproduce: recorded MISSED" in capsys.readouterr().out
    assert not (run_dir / "minimal").exists()


def test_shrinking_the_planted_table_overflow_keeps_the_detection(run_dir, capsys):
    original = json.loads((run_dir / "results.json").read_text())
    target = fingerprints(
        original, tomllib.loads((run_dir / "scenario.toml").read_text())["faults"]
    )[0]["fp"]
    assert _shrink(run_dir, "--max-runs", "120") == 0
    printed = capsys.readouterr().out
    assert (
        f"before: {original['metrics']['requests']} requests, {original['steps']} steps" in printed
    )
    res = json.loads((run_dir / "results.json").read_text())
    m = res["minimal_reproducer"]
    before, after = m["before"], m["after"]
    assert after["requests"] * 4 <= before["requests"] and after["steps"] * 3 <= before["steps"], m
    scenario_path, test_path = Path(m["scenario_path"]), Path(m["test_path"])
    assert scenario_path.parent == test_path.parent == run_dir / "minimal"
    # the minimal scenario, run on its own, still shows the same verdict and primary fingerprint
    sc = load_scenario(scenario_path)
    assert sc.scenario.seeds == [0] and sc.expect.outcome == "detect"
    r = run_scenario(sc, 0, "cpu", None)
    assert r.verdict == "PASS"
    assert (r.results["steps"], r.results["metrics"]["requests"]) == (
        after["steps"],
        after["requests"],
    )
    assert (
        fingerprints(r.results, tomllib.loads(scenario_path.read_text())["faults"])[0]["fp"]
        == target
    )
    # the incident report points at the reproducer
    if res.get("incidents"):
        assert str(scenario_path) in (run_dir / res["incidents"][0]["file"]).read_text()
    # and the emitted regression test passes under pytest, asserting the detection
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
    assert "table_integrity" in test_path.read_text()


class SpareBM:
    """A user's block manager, named by spec: the reference under another name."""

    def __new__(cls, *a):
        from kvchaos.engine.block_manager import BlockManager

        return BlockManager(*a)


def test_a_user_block_manager_run_replays_identically_under_that_manager(tmp_path):
    spec = f"{__name__}:SpareBM"
    r = run_scenario(
        load_scenario("refcount-leak-clean"), 0, "cpu", tmp_path, block_manager_spec=spec
    )
    res = json.loads((r.run_dir / "results.json").read_text())
    assert res["block_manager"] == spec and res["tp_mode"] == "simulated" and res["world_size"] == 1
    out = replay(r.run_dir)
    assert out["identical"], out["first_difference"]
    assert out["block_manager_spec"] == spec


def test_a_run_recorded_before_one_import_name_still_replays_and_analyzes(run_dir, capsys):
    """Runs recorded with top-level engine.* names: the same reference manager, the same run."""
    hist = run_dir / "history.jsonl"
    events = [json.loads(line) for line in hist.read_text().splitlines()]
    assert events[0]["e"] == "run_start"
    events[0]["block_manager"] = events[0]["block_manager"].removeprefix("kvchaos.")
    hist.write_text("".join(json.dumps(e) + "\n" for e in events))
    res = json.loads((run_dir / "results.json").read_text())
    res.pop("block_manager", None)
    (run_dir / "results.json").write_text(json.dumps(res))
    out = replay(run_dir)
    assert out["identical"], out["first_difference"]
    assert out["block_manager_spec"] is None  # the reference: no --block-manager needed
    assert cli_main(["analyze", str(run_dir), "--no-plots"]) == 0
    assert "suspected" not in (run_dir / "incident-001.md").read_text()


def test_a_run_recorded_under_protocol_v1_still_analyzes(tmp_path, capsys):
    """A folder from a v1 manager (a leaky one, run through the shim kvchaos 0.1 had): its calls
    were append and free. analyze reads the history as data and finds the same leak."""
    run = tmp_path / "v1-era-s0"
    shutil.copytree(V1_ERA, run)
    stored = json.loads((run / "results.json").read_text())
    end = json.loads((run / "history.jsonl").read_text().splitlines()[-1])
    assert stored["block_manager_protocol"] == 1 and end["e"] == "run_end"
    assert end["manager_calls"]["free"] == 6 and "release" not in end["manager_calls"]
    assert cli_main(["analyze", str(run), "--no-plots"]) == stored["exit_code"] == 11
    assert f"{run}: FAIL (same as stored)" in capsys.readouterr().out
    again = json.loads((run / "results.json").read_text())
    for key in ("verdict", "history_digest", "time_to_detect_steps"):
        assert again[key] == stored[key], key
    fired = [c["checker"] for c in again["checkers"] if c["valid"] is False]
    assert fired == ["block_accounting"]
    assert again["exercised"]["frees"] == 6  # v1's free calls count as releases
    assert "4 blocks leaked in v1era:LeakyV1" in (run / "incident-001.md").read_text()
