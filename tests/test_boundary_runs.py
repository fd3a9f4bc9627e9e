"""What a manager hands the harness is judged as it was at the call: a snapshot of its live
state is copied (no false conservation or write finding), and a wrong one is still caught. A
position written with no slot reserved is a finding naming the request and the position, on
every rank; an admit answer over max_computed is a FAIL naming the call."""

from __future__ import annotations

import sys
from pathlib import Path

from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

sys.path.insert(0, str(Path(__file__).parent))

import door_managers  # noqa: E402


def run(name: str, manager, seed: int = 0, **tp):
    return run_scenario(load_scenario(name), seed, "cpu", None, block_manager=manager, **tp)


def test_a_snapshot_of_live_state_is_judged_as_it_was_at_the_call():
    r = run("baseline-clean", door_managers.LiveSnapshot)
    assert r.verdict == "PASS", r.summary
    assert not [e for e in r.events if e["e"] in ("foreign_write", "snapshot_invalid")]
    snaps = [e for e in r.events if e["e"] == "snapshot"]
    assert len({id(e["free"]) for e in snaps}) > 1  # not one list changing under the checkers


def test_a_live_snapshot_that_is_wrong_is_still_caught():
    r = run("baseline-clean", door_managers.LiveSnapshotLeaks)
    assert r.verdict == "FAIL", r.summary
    kinds = {f.kind for f in r.findings if f.checker == "block_accounting"}
    assert "leak" in kinds or "end_leak" in kinds, kinds
    assert not [f for f in r.findings if f.kind == "foreign_write"]  # it wrote where it held
    first = min(f.step for f in r.findings)
    assert first > 1  # nothing before its first release


def test_a_position_with_no_slot_is_named_with_its_request_on_every_rank():
    for tp in ({}, {"tp_mode": "simulated", "world_size": 2}):
        r = run("baseline-clean", door_managers.SkipsLastSlot, **tp)
        assert r.verdict == "FAIL", r.summary
        found = [f for f in r.findings if f.kind == "unslotted_write"]
        assert found, r.summary
        f = found[0]
        req, pos = f.evidence["req"], f.evidence["positions"][0]
        assert pos % 4 == 0 and f.evidence["slots_held"] == pos  # the first slot of a block
        assert f.message.startswith(f"request {req} wrote position {pos} with no slot reserved")
        assert f.evidence["ranks"] == ([0, 1] if tp else [0]), f.evidence


def test_an_admit_answer_over_max_computed_fails_the_run_naming_the_call():
    r = run("prefix-shared-clean", door_managers.HitsOverTheCap)
    assert r.verdict == "FAIL", r.summary
    (f,) = [f for f in r.findings if f.checker == "manager_calls"]
    assert f.message.startswith("admit(") and "more computed tokens than max_computed" in f.message
    assert r.results["reason"] == "sut_error" and "admit(" in r.summary


def test_conformance_judges_a_live_snapshot_as_it_was_at_the_call():
    from kvchaos.harness.conformance.suite import run_conformance

    ok = run_conformance(door_managers.LiveSnapshot, examples=30)
    assert not [r for r in ok if r.status == "failed"], [(r.name, r.message) for r in ok]
    bad = {r.name: r for r in run_conformance(door_managers.LiveSnapshotLeaks, examples=30)}
    assert bad["snapshot"].status == "failed", bad["snapshot"]
