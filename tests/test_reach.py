"""Reach (harness/check/reach.py) and scripts/reach-table.py: every variant of every fault names
the manager path its trigger needs, as counts results.json["exercised"] has, and has a clean
scenario that plants its trigger alone; the table's rows say reached, not reached, not
applicable and an engine seam from a results.json, without running anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvchaos.harness.check.exercised import exercised
from kvchaos.harness.check.reach import REACH, count, reached

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reach-table.py"


def _script():
    spec = importlib.util.spec_from_file_location("reach_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exercised() -> dict:
    """The counts of a run with a writer record, a cache and a host tier (every key, all zero)."""
    start = {"e": "run_start", "step": 0, "config": {"cache": {"block_size": 4, "num_blocks": 8}}}
    end = {"e": "run_end", "step": 0, "counters": {"offload_stores": 0}}
    return exercised([start, {"e": "kv_record", "step": 0, "ranks": 1}, end])


def test_every_variant_names_paths_that_exercised_counts():
    ex, script = _exercised(), _script()
    undeclared = [fv for fv in script.variants() if fv[1] not in REACH.get(fv[0], {})]
    assert undeclared == [], "a new variant declares its reach in harness/check/reach.py"
    for fault, variant in script.variants():
        paths = REACH[fault][variant]
        assert all(count(ex, p) == 0 for p in paths), (fault, variant, paths)
        assert reached(ex, paths) is (None if not paths else False)


def test_every_variant_has_a_clean_scenario_planting_its_trigger_alone():
    script = _script()
    have = script.clean_scenarios()
    assert [fv for fv in script.variants() if fv not in have] == []
    assert {sc.name for sc in have["ordering_race", "cow_lag"]} == {"ordering-race-cow-lag-clean"}


def test_alternatives_and_nested_paths_count():
    ex = {"resizes": 0, "overlong_rejections": 2, "leak_paths": {"cancels": 3}}
    assert count(ex, "overlong_rejections|resizes") == 2 and count(ex, "leak_paths.cancels") == 3
    assert count(ex, "no_such_path") is None and reached(ex, ("no_such_path",)) is False
    assert reached(ex, ("leak_paths.cancels", "resizes")) is False


def _results(verdict="PASS", **kw) -> dict:
    return {
        "verdict": verdict,
        "summary": kw.pop("summary", "clean: 9 checkers held"),
        "exercised": {"copy_on_write_copies": kw.pop("cow", 2), "leak_paths": {"cancels": 1}},
        "fault_verify": {kw.pop("fault", "ordering_race"): {"triggered": 2, **kw}},
    }


def test_a_row_says_the_path_its_count_and_the_verdict():
    row = _script().row
    assert row("ordering_race", "cow_lag", "c", [_results()]) == (
        "| ordering_race/cow_lag | c | copy_on_write_copies = 2 | yes | 2 | PASS |"
    )
    not_reached = row("ordering_race", "cow_lag", "c", [_results("INCONCLUSIVE", cow=0)])
    assert "| copy_on_write_copies = 0 | **no** |" in not_reached
    seeds = row("ordering_race", "cow_lag", "c", [_results(), _results(cow=0)])
    assert "copy_on_write_copies = 2/0 | **1/2** | 2/2 | PASS 2/2 |" in seeds


def test_a_reference_only_variant_says_not_applicable_and_a_seam_says_so():
    row = _script().row
    na = _results("INCONCLUSIVE", fault="refcount_leak", not_applicable="a reference seam")
    line = row("refcount_leak", "partial", "p", [na])
    assert "| not applicable |" in line
    assert line.endswith("| INCONCLUSIVE: not applicable (a reference seam) |")
    seam = row("staging_stall", "ramp", "s", [_results(fault="staging_stall")])
    assert "| none: an engine seam (the table upload's staging) | n/a |" in seam
    piped = row("ordering_race", "cow_lag", "c", [_results("FAIL", summary="a | b")])
    assert piped.endswith("| FAIL: a \\| b |")  # a cell's own bar is escaped, not a column
    ex = {"verdict": "PASS", "summary": "", "exercised": {"full_rows": 1, "resizes": 1}}
    alt = row("table_overflow", "unchecked", "t", [{**ex, "fault_verify": {}}])
    assert "| full_rows = 1, overlong_rejections\\|resizes = 1 | yes |" in alt
