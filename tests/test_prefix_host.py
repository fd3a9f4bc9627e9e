"""The prefix-caching reference's host tier (engine/prefix_host.py): stores key their host
slots, a prefix hit past the device cache finds them and is copied in before the request runs
(offload_hits), and the harness judges it (checker offload, the writer record)."""

from __future__ import annotations

import pytest

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import HostTierPrefixCachingManager, PrefixCachingManager
from kvchaos.harness.check.offload_checks import check_offload
from kvchaos.harness.check.verdict import attribute
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

BS = 4
PROMPT = list(range(10))  # two full blocks and a partial one


def _stored(m: PrefixCachingManager, seq: str = "a") -> list[tuple[int, int]]:
    """seq admitted with PROMPT, computed, stored out; its device blocks then evicted."""
    m.admit(seq, PROMPT, len(PROMPT), len(PROMPT) - 1)
    m.end_step({seq: len(PROMPT)})
    pairs = m.offload_store(seq, len(PROMPT))
    m.offload_done(seq)
    for i in range(m.num_free_blocks):  # fill the pool: the device cache's keys are evicted
        m.admit(f"x{i}", [200 + i] * BS, BS, 0)
    for i in range(m.pool.num_blocks):
        m.release(f"x{i}", "finish")
    assert not m.pool.cache
    m.check_host()
    return pairs


def test_only_a_manager_built_with_host_blocks_offers_offload():
    assert "offload" not in PrefixCachingManager(8, BS).capabilities
    assert "offload" in PrefixCachingManager(8, BS, host_blocks=16).capabilities


def test_a_completed_store_keys_its_full_computed_blocks_on_the_host():
    m = PrefixCachingManager(8, BS, host_blocks=16)
    pairs = _stored(m)
    assert len(pairs) == 3 and len(m.host.cache) == 2  # the partial third block is not keyed
    assert m.snapshot().host_blocks == {"a": [s for _, s in pairs]}


def test_a_hit_past_the_device_cache_is_loaded_from_the_host_then_keyed():
    m = PrefixCachingManager(8, BS, host_blocks=16)
    pairs = _stored(m)
    h = m.admit("b", [*PROMPT[:9], 77], 10, 9)
    assert h == 2 * BS  # both keyed blocks, found on the host alone
    loads = m.offload_hits("b")
    assert [s for s, _ in loads] == [s for _, s in pairs[:2]]
    assert [b for _, b in loads] == m.blocks["b"][:2]
    assert m.host.ref[loads[0][0]] == 2  # the stored sequence's and the load's
    assert not m.pool.cache  # not keyed on the device before the copy landed (M3)
    m.check_host()
    m.offload_done("b")
    assert m.keyed["b"] == 2 and len(m.pool.cache) == 2 and "b" not in m.host_slots
    assert m.offload_hits("b") == []
    m.check_host()


def test_a_refused_admission_with_a_host_hit_changes_nothing():
    m = PrefixCachingManager(8, BS, host_blocks=16)
    _stored(m)
    for i in range(8):
        m.admit(f"y{i}", [300 + i] * BS, BS, 0)
    refs, free = list(m.host.ref), m.host.free_order()
    with pytest.raises(OutOfBlocks):
        m.admit("b", PROMPT, 10, 9)
    assert m.host.ref == refs and m.host.free_order() == free and "b" not in m.host_slots


def test_a_stored_release_keeps_its_host_keys_for_later_hits():
    m = PrefixCachingManager(8, BS, host_blocks=16)
    _stored(m)
    assert m.release("a", "cancel") and "a" not in m.tokens
    assert not m.host_slots and len(m.host.cache) == 2  # LRU, evicted only by a later store
    assert m.admit("b", PROMPT, 10, 9) == 2 * BS and len(m.offload_hits("b")) == 2
    assert m.release("b", "cancel") and not m.host_slots
    m.check_host()


def test_a_restore_takes_fresh_blocks_and_keys_them_once_computed():
    m = PrefixCachingManager(8, BS, host_blocks=16)
    pairs = _stored(m)
    back = m.offload_restore("a")
    assert [s for s, _ in back] == [s for _, s in pairs] and m.keyed["a"] == 0
    m.offload_done("a")
    assert "a" not in m.host_slots and len(m.host.cache) == 2
    m.end_step({"a": len(PROMPT)})
    assert m.keyed["a"] == 2
    m.check_host()


def test_the_prefix_reference_with_a_host_tier_passes_conformance():
    from kvchaos.harness.conformance.suite import run_conformance

    ok = {r.name: r for r in run_conformance(HostTierPrefixCachingManager, examples=60)}
    assert ok["offload"].status == "passed", ok["offload"]
    assert all(r.status != "failed" for r in ok.values()), [r for r in ok.values()]


# -- runs ------------------------------------------------------------------------------------
def _hit_loads(r) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in r.events:
        if e.get("e") == "engine" and e["kind"] == "offload_restore" and e["data"].get("hit"):
            out.setdefault(e["data"]["req"], []).append(e["step"])
    return out


def test_the_clean_run_loads_prefix_hits_from_the_host_and_every_checker_holds():
    r = run_scenario(load_scenario("offload-prefix-hit-clean"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    loads = _hit_loads(r)
    assert r.results["exercised"]["offload"]["hit_loads"] == sum(map(len, loads.values())) > 5
    assert not [e for e in r.events if e.get("e") == "tier_read"]  # none ran before it landed
    reads = [e for e in r.events if e.get("e") == "kv_read"]
    assert not reads and r.results["metrics"]  # the writer record judged every read: all right


def test_restore_race_on_hit_loads_is_caught_naming_the_loaded_request():
    r = run_scenario(load_scenario("offload-prefix-hit-restore-race-detect"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    loads = _hit_loads(r)
    raced = {x["req"] for x in r.results["fault_verify"]["offload"]["raced"]}
    named = {f.evidence.get("req") for f in r.findings if f.kind == "read_in_flight"}
    assert loads and set(loads) & raced & named
    wrong = {f.evidence.get("req") for f in r.findings if f.kind == "wrong_read"}
    assert set(loads) & wrong  # the writer record names the reader, not a bystander


def test_the_checker_allows_a_shared_host_slot_only_as_its_ref_count_says():
    snap = {"e": "snapshot", "step": 3, "seq_blocks": {"b": [5]}, "host_free": [2]}
    shared = {**snap, "host_blocks": {"a": [0, 1], "b": [0]}, "host_ref_counts": [2, 1, 0]}
    assert check_offload([shared]).findings == []
    once = {**shared, "host_ref_counts": [1, 1, 0]}
    found = check_offload([once]).findings
    assert found and found[0].kind == "tier_map" and "held by a too" in found[0].message


def test_a_poisoned_read_is_its_origins_faults_consequence(monkeypatch):
    from types import SimpleNamespace

    from kvchaos.faults import REGISTRY

    class F:
        name = "offload"
        defect = True

    truth = {"offload": {"fired": True}}
    monkeypatch.setitem(
        REGISTRY,
        "offload",
        SimpleNamespace(explains=lambda d, t: "cause" if d["evidence"]["req"] == "r0" else None),
    )

    def read(step, req, origin=None):
        ev = {"req": req, "origin": origin}
        return SimpleNamespace(checker="kv_reads", step=step, kind="poisoned_read", evidence=ev)

    sc = SimpleNamespace(faults=[F()])
    chain = [read(5, "r0"), read(7, "r1", "r0"), read(9, "r2", "r1"), read(6, "r3", "r2")]
    got = attribute(sc, chain, truth)
    assert got[0] == [("offload", "cause")]
    assert got[1] == got[2] == [("offload", "consequence")]
    assert got[3] == []  # its origin read wrongly only after it: not its consequence


def test_host_hits_save_prefill_the_run_without_the_tier_computes():
    from kvchaos.harness.bench.offload_step import hit_saving

    out = hit_saving(seed=1)
    assert out["with_tier_verdict"] == out["without_tier_verdict"] == "PASS"
    assert out["hit_loaded_blocks"] > 0
    assert out["with_tier_prefill_tokens"] < out["without_tier_prefill_tokens"]


def test_a_raced_restores_blocks_explain_what_a_prefix_cache_served_of_them_and_no_more():
    from kvchaos.faults.offload import Offload

    truth = {"variant": "restore_race", "raced": [{"step": 5, "req": "r1", "blocks": [7, 8]}]}

    def f(checker, kind, step=9, **ev):
        return {"checker": checker, "kind": kind, "step": step, "evidence": ev}

    assert Offload.explains(f("kv_reads", "wrong_read", req="r1", block=3), truth) == "cause"
    served = f("kv_reads", "unwritten_read", req="r2", block=8)
    assert Offload.explains(served, truth) == "consequence"
    assert Offload.explains(f("prefix_cache", "cache_content", block=7), truth) == "consequence"
    after = f("prefix_cache", "cache_content", block=9, parent_block=8)
    assert Offload.explains(after, truth) == "consequence"
    assert Offload.explains(f("prefix_cache", "cache_content", block=9), truth) is None
    assert Offload.explains(f("kv_reads", "wrong_read", req="r2", block=3), truth) is None
    early = f("kv_reads", "unwritten_read", step=4, req="r2", block=8)  # before the race
    assert Offload.explains(early, truth) is None
