"""The SGLang adapter (`--block-manager sglang`) with sglang 0.5.5.x installed (its own venv:
docs/adapters.md; the lane `.ci/adapter-lane sglang`): SGLang's real RadixCache and paged
allocator pass the door, conformance v2 on what the adapter declares, and a clean prefix scenario
with hits, never handing out page 0. Without sglang these tests skip (marker `sglang`); the
version checks are tests/test_adapter_versions.py's."""

from __future__ import annotations

import pytest
from real_engines import load_adapter

from kvchaos.harness.run.user_code import validate_manager


@pytest.mark.sglang
def test_sglangs_cache_passes_the_door_and_conformance_on_what_it_declares():
    from kvchaos.harness.conformance.suite import run_conformance

    sglang = load_adapter("sglang")
    assert validate_manager("sglang") is sglang.SGLangManager
    results = {r.name: r.status for r in run_conformance(sglang.SGLangManager, examples=60)}
    declared = ("hit_over_cap", "cache_consistent", "seq_tokens", "reserved_never_handed_out")
    assert all(results[p] == "passed" for p in declared), results
    assert "failed" not in results.values() and results["fork"] == "not applicable", results


@pytest.mark.sglang
def test_sglangs_cache_runs_a_prefix_scenario_with_hits_and_no_padding_page():
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

    sglang = load_adapter("sglang")
    sc = load_scenario(BUILTIN_DIR / "prefix-samples-clean.toml", "cpu")
    r = run_scenario(sc, 0, "cpu", None, block_manager=sglang.SGLangManager)
    assert r.verdict == "PASS", r.summary
    assert r.results["metrics"]["prefix_cache"]["hit_tokens"] > 0
    snaps = [e for e in r.events if e["e"] == "snapshot"]
    assert all(e["reserved"] == [0] and 0 not in e["free"] for e in snaps)
    assert not any(0 in bs for e in snaps for bs in e["seq_blocks"].values())
    added = [c for e in snaps for c in e.get("cache_added", ())]  # cache state, as deltas
    assert added and all(len(c["tokens"]) == 4 for c in added)


@pytest.mark.sglang
def test_a_failed_step_leaves_no_key_over_slots_it_never_wrote():
    m = load_adapter("sglang").SGLangManager(16, 2)
    assert m.admit("a", [1, 2, 3, 4, 5], 5, 4) == 0
    m.end_step({"a": 5})  # prefill done: its full pages go in the tree (cache_unfinished_req)
    m.append("a", [6, 7, 8])
    assert m.release("a", "error")  # the step that reserved 6, 7, 8 did not run
    assert sorted(c["tokens"] for c in m.snapshot().cache) == [[1, 2], [3, 4]]
    assert m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9, 8) == 4
    assert m.num_free_blocks == 15 - 5  # b holds the 2 cached pages and 3 new ones


@pytest.mark.sglang
def test_a_prefix_another_request_cached_first_keeps_its_pages_until_release():
    m = load_adapter("sglang").SGLangManager(16, 2)
    for s in ("a", "b"):  # the same prompt in one step: both miss
        assert m.admit(s, [1, 2, 3, 4, 5], 5, 4) == 0
    a, b = list(m.block_ids("a")), list(m.block_ids("b"))
    m.end_step({"a": 5, "b": 5})  # a's pages go in the tree; SGLang would move b onto them
    assert m.block_ids("b") == b  # the protocol: entries change only by growth or a copy
    assert sorted(c["block"] for c in m.snapshot().cache) == sorted(a[:2])
    assert m.release("b", "finished")  # cache_finished_req: b's duplicates are freed
    snap = m.snapshot()
    assert sorted(c["block"] for c in snap.cache) == sorted(a[:2])
    assert set(b) <= set(snap.free) and not set(a) & set(snap.free)
    assert m.num_free_blocks == 15 - 3
