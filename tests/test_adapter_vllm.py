"""The vLLM adapter (`--block-manager vllm`) with vllm 0.33.x installed (its own venv:
docs/adapters.md; the lane `.ci/adapter-lane vllm`): vLLM's real KVCacheManager passes the door,
conformance v2 on what the adapter declares, and a clean prefix scenario with its cache serving
hits, never handing out its null block. Without vllm these tests skip (marker `vllm`); the version
checks are tests/test_adapter_versions.py's."""

from __future__ import annotations

import pytest
from real_engines import load_adapter

from kvchaos.harness.run.user_code import validate_manager


@pytest.mark.vllm
def test_vllms_manager_passes_the_door_and_conformance_on_what_it_declares():
    from kvchaos.harness.conformance.suite import run_conformance

    vllm = load_adapter("vllm")
    assert validate_manager("vllm") is vllm.VLLMManager
    results = {r.name: r.status for r in run_conformance(vllm.VLLMManager, examples=60)}
    declared = ("hit_over_cap", "cache_consistent", "seq_tokens", "reserved_never_handed_out")
    assert all(results[p] == "passed" for p in declared), results
    assert "failed" not in results.values() and results["fork"] == "not applicable", results


@pytest.mark.vllm
def test_vllms_manager_runs_a_prefix_scenario_with_hits_and_no_null_block():
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

    vllm = load_adapter("vllm")
    sc = load_scenario(BUILTIN_DIR / "prefix-samples-clean.toml", "cpu")
    r = run_scenario(sc, 0, "cpu", None, block_manager=vllm.VLLMManager)
    assert r.verdict == "PASS", r.summary
    assert r.results["metrics"]["prefix_cache"]["hit_tokens"] > 0
    snaps = [e for e in r.events if e["e"] == "snapshot"]
    assert all(e["reserved"] == [0] and 0 not in e["free"] for e in snaps)
    assert not any(0 in bs for e in snaps for bs in e["seq_blocks"].values())
    added = [c for e in snaps for c in e.get("cache_added", ())]  # cache state, as deltas
    assert added and all(len(c["tokens"]) == 4 and len(c["key"]) == 64 for c in added)


@pytest.mark.vllm
def test_a_failed_step_leaves_no_key_over_slots_it_never_wrote():
    vllm = load_adapter("vllm")
    m = vllm.VLLMManager(16, 2)
    assert m.admit("a", [1, 2, 3, 4, 5], 5, 4) == 0
    m.end_step({"a": 5})
    m.append("a", [6, 7, 8])  # keyed as allocated (vLLM): blocks 2 and 3 of "a"
    keyed = {c["block"] for c in m.snapshot().cache}
    assert set(m.block_ids("a")[2:4]) <= keyed
    assert m.release("a", "error")  # the step that reserved 6, 7, 8 did not run
    left = {c["block"]: c["tokens"] for c in m.snapshot().cache}
    assert sorted(left.values()) == [[1, 2], [3, 4]]  # only what was computed stays served
    assert m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9, 8) == 4
