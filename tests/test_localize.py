"""The call log and call localization: a finding against a user's manager names the call that
made it true, the request that suffered leads the story, and the digest stays as it was."""

from __future__ import annotations

import json

import pytest

from kvchaos.harness.check.findings import Finding
from kvchaos.harness.check.story import root_first, story
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.history.log import deterministic_digest, read_history
from kvchaos.harness.history.results import read_results
from kvchaos.harness.report.analyze import analyze
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario
from tests.bug_managers import MissingSlot, PreemptLeak
from tests.managers import RefusalBumpsRef


@pytest.fixture(scope="module")
def leak_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("leak")
    return run_scenario(load_scenario("baseline-clean"), 0, "cpu", d, block_manager=PreemptLeak)


def _findings(results: dict) -> list[dict]:
    return [f for c in results["checkers"] for f in c["findings"]]


def test_the_history_logs_every_call_outside_its_digest(leak_run):
    events = read_history(leak_run.run_dir / "history.jsonl")
    calls = [c for e in events if e["e"] == "calls" for c in e["calls"]]
    names = {c[0] for c in calls}
    assert {"admit", "release", "append_decode"} <= names
    assert "snapshot" not in names  # the harness's own reads are not calls of the run
    admit = next(c for c in calls if c[0] == "admit")
    assert admit[1][1].endswith(" tokens>")  # token lists by length
    assert any(c[0] == "release" and c[1][1] == "preempted" for c in calls)
    digest = leak_run.results["history_digest"]
    assert deterministic_digest(events) == digest
    assert deterministic_digest([e for e in events if e["e"] != "calls"]) == digest


def test_a_leak_on_the_preemption_path_names_the_release(leak_run):
    r = leak_run
    assert r.verdict == "FAIL"
    first = next(f for f in _findings(r.results) if f["kind"] == "refcount")
    call = first["call"]
    assert call["call"] == "release" and call["args"][1] == "preempted"
    assert call["step"] <= first["step"] and "no holder" in call["why"]
    loc = r.results["localization"]
    assert loc["note"] is None and any("release(" in line for line in loc["lines"])


def test_the_incident_leads_with_the_call(leak_run, tmp_path):
    out = analyze(leak_run.run_dir, plots=False, index=False)
    text = (leak_run.run_dir / "incident-001.md").read_text()
    summary = text.split("## Summary", 1)[1].split("##", 1)[0]
    assert "The call that broke it: release(" in summary and "'preempted'" in summary
    root = text.split("## Root cause", 1)[1].split("##", 1)[0]
    assert "`release`" in root and "planted" not in root
    timeline = text.split("## Timeline", 1)[1]
    step = next(f for f in _findings(out) if f.get("call"))["call"]["step"]
    assert f"| {step} |" in timeline and "preempted:" in timeline
    assert "call release(" in timeline
    # analyze keeps the named calls
    assert any(f.get("call") for f in _findings(read_results(leak_run.run_dir)))


def test_a_refusal_that_changed_state_names_the_refusing_call():
    r = run_scenario(load_scenario("baseline-clean"), 0, "cpu", None, block_manager=RefusalBumpsRef)
    assert r.verdict == "FAIL"
    f = next(f for f in _findings(r.results) if f["kind"] == "refusal_changed_state")
    assert f["call"]["call"] in ("admit", "append", "append_decode")
    assert "refused" in f["call"]["why"]


def test_a_missing_slot_names_append_decode():
    r = run_scenario(load_scenario("baseline-clean"), 0, "cpu", None, block_manager=MissingSlot)
    assert r.verdict == "FAIL"
    first = next(f for f in root_first(_findings(r.results)) if f.get("call"))
    assert first["call"]["call"] == "append_decode"
    # the root says which position went without a slot, and the summary leads with it
    assert first["kind"] == "unslotted_write" and "reserved no slot" in first["call"]["why"]
    assert "with no slot reserved" in r.summary


def test_explain_on_demand_and_its_budget(leak_run, capsys):
    d = leak_run.run_dir
    res = json.loads((d / "results.json").read_text())
    for f in _findings(res):
        f.pop("call", None)
    res["localization"] = None
    (d / "results.json").write_text(json.dumps(res))
    assert cli_main(["explain", str(d), "--budget-steps", "5"]) == 1
    assert "past the replay budget of 5" in capsys.readouterr().out
    assert cli_main(["explain", str(d)]) == 0
    assert "release('r" in capsys.readouterr().out
    assert any(f.get("call", {}).get("call") == "release" for f in _findings(read_results(d)))


def _f(checker, kind, step, **ev):
    return Finding(checker=checker, step=step, message=kind, evidence=ev, kind=kind)


def test_the_reader_outranks_the_blocks_holder():
    holder = _f("block_accounting", "shared_write", 7, req="r1", block=5, refs=2)
    reader = _f("kv_reads", "foreign", 7, req="r2", block=5, via_hit=True)
    diverged = _f("oracle_divergence", "divergence", 9, req="r2")
    other = _f("oracle_divergence", "divergence", 9, req="r3")
    roots = story([holder, diverged, reader, other])
    assert roots[0][0] is reader and set(map(id, roots[0][1])) == {id(holder), id(diverged)}
    assert [r for r, _ in roots] == [reader, other]
    assert root_first([other, holder, reader, diverged])[0] is reader


def test_the_commands_budget_is_the_replays():
    from kvchaos.harness.run import explain as replayed
    from kvchaos.harness.tools import explain as command

    assert command.DEFAULT_BUDGET_STEPS == replayed.DEFAULT_BUDGET_STEPS
