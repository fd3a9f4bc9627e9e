"""A manager is judged as what it is. One that fails the check before any run (a smoke call
raises or answers what the protocol does not allow) gets a FAIL run, exit 11: a run folder with
its smoke calls in history.jsonl, results.json and an incident, through `kvchaos run`,
`kvchaos conformance` and the pytest plugin; what is not a manager stays bad input
(tests/test_manager_validation.py). The check's limit is a flag and leaves the import out; a
manager's declared block_sizes are what the check and conformance build it with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.history.log import read_history
from kvchaos.harness.run.door import validate_isolated
from kvchaos.harness.run.user_code import SmokeFailure, validate_manager

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

pytest_plugins = ["pytester"]

FAILS = [
    ("DoubleFreeOnAbort", "release('smoke-b', 'aborted') raised RuntimeError: decref of free"),
    ("IdsOutsideThePool", "block_ids('smoke-a') answered [9, 10, 11]: a block id outside the pool"),
    ("HitsOverTheCap", "admit('smoke-c', [1, 2, 3, 4, 5, 8, 9], 7, 6) answered 7: more computed"),
]


def door_folder(report: Path) -> Path:
    (run,) = [p for p in report.iterdir() if p.is_dir() and not p.is_symlink()]
    assert run.name.endswith("-door-check-s0"), run
    return run


def assert_fail_run(run: Path, said: str) -> None:
    """A run folder like any FAIL run's: the history of the smoke calls, ending in the failing
    call, results.json with the verdict, an incident naming the call."""
    events = read_history(run / "history.jsonl")
    kinds = [e["e"] for e in events]
    assert kinds == ["run_start", "calls", "sut_error", "run_end"], kinds
    calls = events[1]["calls"]  # the smoke calls, as a run's call log keeps them
    assert len(calls) >= 2 and said.startswith(calls[-1][0] + "("), calls[-1]
    assert all(len(c) == 3 and isinstance(c[1], list) for c in calls)
    results = json.loads((run / "results.json").read_text())
    assert results["verdict"] == "FAIL" and results["exit_code"] == 11, results["summary"]
    assert said in results["summary"]
    assert "--block-manager door_managers:" in results["replay"]
    incident = (run / "incident-001.md").read_text()
    assert said in incident and "**Severity:** SEV2" in incident
    timeline = incident.split("## Timeline", 1)[1]
    assert f"call {calls[0][0]}(" in timeline  # the smoke calls, as a run's calls are shown


@pytest.mark.parametrize("name, said", FAILS, ids=[n for n, _ in FAILS])
def test_a_manager_failing_the_check_is_a_fail_run_exit_11(
    tmp_path, monkeypatch, capsys, name, said
):
    monkeypatch.chdir(TESTS)
    argv = ["run", "baseline-clean", "--seed", "0", "--report-dir", str(tmp_path)]
    rc = main([*argv, "--block-manager", f"door_managers:{name}", "--format", "json", "-q"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 11 and doc["verdict"] == "FAIL" and len(doc["runs"]) == 1, doc
    assert_fail_run(door_folder(tmp_path), said)


def test_in_process_too_and_its_replay_checks_again(tmp_path, monkeypatch, capsys):
    from kvchaos.harness.tools.replay import replay

    monkeypatch.chdir(TESTS)
    argv = ["run", "baseline-clean", "--seed", "0", "--report-dir", str(tmp_path), "--in-process"]
    assert main([*argv, "--block-manager", "door_managers:DoubleFreeOnAbort"]) == 11
    run = door_folder(tmp_path)
    assert_fail_run(run, FAILS[0][1])
    assert "FAIL" in capsys.readouterr().out
    again = replay(run, isolated=False)
    assert again["identical"] and again["replay_verdict"] == "FAIL", again


def test_the_failure_crosses_from_the_checking_worker_whole(monkeypatch):
    monkeypatch.chdir(TESTS)
    with pytest.raises(SmokeFailure) as there:
        validate_isolated("door_managers:DoubleFreeOnAbort")
    with pytest.raises(SmokeFailure) as here:
        validate_manager("door_managers:DoubleFreeOnAbort")
    a, b = there.value.to_dict(), here.value.to_dict()
    assert a.pop("traceback") == b.pop("traceback")  # the call's own, raised in the manager
    assert a == b and str(there.value) == str(here.value) and "\n" not in str(here.value)


def test_conformance_records_the_fail_run_and_exits_11(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    rc = main(["conformance", "--block-manager", "door_managers:IdsOutsideThePool"]
              + ["--report-dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 11 and out.startswith("FAIL: the check before any run: bug found"), out
    run = door_folder(tmp_path)
    assert f"run folder: {run}" in out
    assert_fail_run(run, FAILS[1][1])


def test_the_pytest_plugin_fails_one_item_with_the_run_and_skips_the_rest(pytester):
    (pytester.path / "door_managers.py").write_text((TESTS / "door_managers.py").read_text())
    (pytester.path / "managers.py").write_text((TESTS / "managers.py").read_text())
    pytester.syspathinsert()
    d = pytester.mkdir("my_scenarios")
    (d / "b.toml").write_text((TESTS.parent / "scenarios" / "baseline-clean.toml").read_text())
    report = pytester.path / "reports"
    res = pytester.runpytest(
        "my_scenarios",
        "--kvchaos-block-manager",
        "door_managers:DoubleFreeOnAbort",
        "--kvchaos-report-dir",
        str(report),
        "--kvchaos-seeds",
        "1",
    )
    res.assert_outcomes(failed=1, skipped=1)  # the check's run; the scenario does not run
    out = res.stdout.str()
    assert "kvchaos-door::check" in out and "FAIL: the check before any run: bug found" in out
    assert_fail_run(door_folder(report), FAILS[0][1])


# -- the check's limit -------------------------------------------------------------------------
def test_the_limit_leaves_the_import_out(monkeypatch):
    monkeypatch.chdir(TESTS)
    # the worker imports it afresh; the import takes longer than the check's whole limit, which
    # the smoke sequence (milliseconds) keeps well inside on a loaded machine
    monkeypatch.setenv("KVCHAOS_TEST_SLOW_IMPORT", "6")
    assert validate_isolated("door_managers:OnlySixteen", timeout_s=5) == (16,)
    with pytest.raises(ValueError, match=r"importing it did not finish within 1 s"):
        validate_isolated("door_managers:OnlySixteen", timeout_s=5, import_timeout_s=1)


def test_the_limit_is_a_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    argv = ["run", "baseline-clean", "--seed", "0", "--report-dir", str(tmp_path)]
    assert main([*argv, "--block-manager", "door_managers:SlowCheck", "--check-timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within 1 s (--check-timeout)" in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


# -- block sizes a manager declares ------------------------------------------------------------
def test_the_check_and_conformance_build_a_manager_at_a_block_size_it_supports(monkeypatch):
    from kvchaos.harness.conformance.suite import run_conformance

    monkeypatch.chdir(TESTS)
    import door_managers

    assert validate_manager("door_managers:OnlySixteen") is door_managers.OnlySixteen
    results = {r.name: r for r in run_conformance(door_managers.OnlySixteen, examples=20)}
    assert not [r for r in results.values() if r.status == "failed"], results
    assert results["data"].status == "passed"


def test_a_scenario_of_another_block_size_is_bad_input_or_left_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    argv = ["run", "baseline-clean", "--seed", "0", "--report-dir", str(tmp_path)]
    assert main([*argv, "--block-manager", "door_managers:OnlySixteen"]) == 2
    err = capsys.readouterr().err
    assert "scenario baseline-clean: block_size 4, but 'door_managers:OnlySixteen' supports " \
        "block sizes 16 (its block_sizes)" in err, err  # fmt: skip
    assert not list(tmp_path.iterdir())


def test_a_declaration_that_is_not_block_sizes_is_bad_input(tmp_path, monkeypatch):
    (tmp_path / "bm_sizes.py").write_text(
        "from managers import PlainV2\n\nclass Sizes(PlainV2):\n    block_sizes = '16'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="block_sizes is '16', not a tuple of positive ints"):
        validate_manager("bm_sizes:Sizes")


def test_conformance_judges_an_answer_over_max_computed_as_hit_over_cap():
    import door_managers

    from kvchaos.harness.conformance.suite import run_conformance

    results = {r.name: r for r in run_conformance(door_managers.HitsOverTheCap, examples=30)}
    over = results["hit_over_cap"]
    assert over.status == "failed" and "more computed tokens than max_computed" in over.message
    assert results["answers"].status == "passed"  # named by the property it breaks
