"""The history's schema (harness/history/events.py) holds for what runs write: every event of
recorded runs is of a known kind, has the keys its type requires and none it does not declare."""

from __future__ import annotations

import pytest

from kvchaos.harness.history.events import KINDS
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario


def schema_problems(events: list[dict]) -> list[str]:
    out = []
    for i, e in enumerate(events):
        t = KINDS.get(e.get("e"))
        if t is None:
            out.append(f"event {i}: unknown kind {e.get('e')!r}")
            continue
        missing = t.__required_keys__ - set(e)
        extra = set(e) - t.__required_keys__ - t.__optional_keys__
        if missing or extra:
            out.append(
                f"event {i} ({e['e']}): missing {sorted(missing)}, undeclared {sorted(extra)}"
            )
    return out


# between them every kind a run writes when nothing breaks: rejects and cancels, foreign writes,
# wrong reads, hit and cache mismatches, faults, the oracle and the reference
SCENARIOS = [
    "mixed-clean",
    "table-overflow-detect",
    "ordering-race-detect",
    "prefix-cache-stale-revive-detect",
    "prefix-cache-partial-key-detect",
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_recorded_events_are_as_their_types_say(name):
    r = run_scenario(load_scenario(name), 0, report_dir=None)
    assert schema_problems(r.events) == []


def test_every_kind_is_seen_by_the_schema_test():
    seen = set()
    for name in SCENARIOS[1:3]:
        seen |= {e["e"] for e in run_scenario(load_scenario(name), 0, report_dir=None).events}
    assert {"foreign_write", "kv_read", "fault", "oracle", "reference", "run_end"} <= seen


def test_a_schema_problem_is_named():
    events = [
        {"e": "submit", "step": 0, "req": "r0", "prompt_len": 3, "max_new": 2, "origin": "plan"},
        {"e": "nonsense", "step": 0},
        {"e": "kv_record", "step": 0, "ranks": 1, "extra": True},
    ]
    assert schema_problems(events) == [
        "event 0 (submit): missing ['parent'], undeclared []",
        "event 1: unknown kind 'nonsense'",
        "event 2 (kv_record): missing [], undeclared ['extra']",
    ]


def test_the_kinds_a_broken_manager_brings_are_as_their_types_say(tmp_path, monkeypatch):
    """calls (here the check before any run's FAIL run) and unslotted_write (a position written
    with no slot reserved) come only from managers with bugs."""
    from pathlib import Path

    from kvchaos.harness.run.door import door_run
    from kvchaos.harness.run.user_code import SmokeFailure, validate_manager

    tests = Path(__file__).parent
    monkeypatch.chdir(tests)
    monkeypatch.syspath_prepend(str(tests))
    import door_managers

    with pytest.raises(SmokeFailure) as failed:
        validate_manager("door_managers:DoubleFreeOnAbort")
    door = door_run(failed.value, None).events
    sc = load_scenario("baseline-clean")
    slots = run_scenario(sc, 0, report_dir=None, block_manager=door_managers.SkipsLastSlot).events
    assert {"calls", "sut_error"} <= {e["e"] for e in door} and "unslotted_write" in {
        e["e"] for e in slots
    }
    assert schema_problems(door) == schema_problems(slots) == []
