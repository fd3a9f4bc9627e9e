"""harness/run/cache_state.py: the manager's cache state against the writer record. Each problem
of a cached block (partial, tokens, chain, parent) and of a hit (not_cached, tokens, parent) on a
hand-built record; an entry judged once until its block is written again; the prefix_cache
checker's findings; and a canary that keeps stale cache entries caught by it in a run."""

from __future__ import annotations

from kvchaos.harness.check.cache_checks import check_prefix_cache
from kvchaos.harness.run.cache_state import CacheWatch
from kvchaos.harness.run.kv_record import Identities, KVRecord

BS = 2


def written(seqs: dict[str, tuple[list[int], list[int]]]) -> KVRecord:
    """A record where each seq (tokens, blocks) wrote all its tokens into its blocks."""
    rec, ids = KVRecord(8, BS), Identities()
    for seq, (tokens, blocks) in seqs.items():
        d = ids.upto(seq, tokens, len(tokens))
        for p, t in enumerate(tokens):
            rec.write(seq, p, t, d[p], blocks[p // BS] * BS + p % BS, 1)
    return rec


def entry(block, key, parent, tokens):
    return {"block": block, "key": key, "parent": parent, "tokens": tokens}


A = [5, 6, 7, 8]  # request a: blocks 0 (5, 6) and 1 (7, 8)


def test_a_true_cache_has_no_problem_and_is_judged_once():
    rec, w = written({"a": (A, [0, 1])}), CacheWatch(BS)
    cache = [entry(0, "k0", None, [5, 6]), entry(1, "k1", "k0", [7, 8])]
    assert w.check(rec, cache, 1) == []
    rec.write("b", 0, 9, b"x" * 8, 0, 2)  # block 0 overwritten while still cached
    (ev,) = w.check(rec, cache, 2)
    assert (ev["e"], ev["block"], ev["problem"]) == ("cache_mismatch", 0, "tokens")
    assert w.check(rec, cache, 3) == []  # told once


def test_an_unchanged_cache_is_judged_again_only_where_a_cached_block_was_written():
    """With the judge's state object unchanged, the watch looks again only at cached blocks
    whose version moved: a write into one is caught, a write elsewhere costs nothing."""
    from kvchaos.harness.history.cache import cache_delta

    rec, w = written({"a": (A, [0, 1])}), CacheWatch(BS)
    cache = [entry(0, "k0", None, [5, 6]), entry(1, "k1", "k0", [7, 8])]
    _, state, _ = cache_delta({}, cache)
    assert w.check(rec, cache, 1, state) == []
    rec.write("b", 0, 9, b"x" * 8, 6, 2)  # block 3: not cached
    assert w.check(rec, cache, 2, state) == [] and not rec.bumped
    rec.write("b", 0, 9, b"x" * 8, 2, 3)  # block 1: cached, its first slot now b's
    (ev,) = w.check(rec, cache, 3, state)
    assert (ev["block"], ev["problem"]) == (1, "tokens")
    dup = [*cache, entry(1, "k9", None, [7, 8])]  # a block under two keys: always looked at
    _, state2, _ = cache_delta(state, dup)
    w.check(rec, dup, 4, state2)
    assert w.blocks is None


def test_each_content_problem_is_named():
    rec = written({"a": (A, [0, 1]), "b": ([1, 2], [2]), "c": ([3, 7, 8], [4, 5])})
    cases = {
        "partial": entry(3, "k", None, [1, 2]),  # never written
        "tokens": entry(0, "k", None, [5, 9]),
        "parent": entry(1, "k1", "kb", [7, 8]),  # a's block 1 does not continue b's block
        "chain": None,
    }
    # chain: slot 0 of a's block 1 overwritten by c's KV of the same token (7, at position 1)
    rec2 = written({"a": (A, [0, 1]), "c": ([3, 7, 8], [4, 5])})
    rec2.write("c", 1, 7, rec2.ident[4 * BS + 1], 1 * BS, 2)
    for problem, e in cases.items():
        r = rec2 if problem == "chain" else rec
        e = e or entry(1, "k1", None, [7, 8])
        cache = [e, entry(2, "kb", None, [1, 2])] if problem == "parent" else [e]
        evs = CacheWatch(BS).check(r, cache, 1)
        assert [x["problem"] for x in evs if x["block"] == e["block"]] == [problem], problem


def test_a_hit_on_blocks_its_keys_do_not_name_is_named():
    rec = written({"a": (A, [0, 1])})
    cache = [entry(0, "k0", None, [5, 6]), entry(1, "k1", "k0", [7, 8])]
    for blocks, tokens, problem in (
        ([0, 3], A, "not_cached"),
        ([0, 1], [5, 6, 7, 9], "tokens"),
        ([1], [7, 8], "parent"),  # served as block 0, but cached after k0
    ):
        w = CacheWatch(BS)
        w.check(rec, cache, 1)
        w.hit(2, "r", tokens, blocks)
        (ev,) = w.check(rec, cache, 2)
        assert (ev["e"], ev["req"], ev["problem"]) == ("hit_mismatch", "r", problem)
    w = CacheWatch(BS)
    w.hit(2, "r", A, [0, 1])
    assert w.check(rec, cache, 2) == []


def test_the_checker_turns_events_into_findings_and_is_not_judged_without_cache_state():
    evs = [
        {"e": "kv_record", "step": 0},
        {"e": "snapshot", "step": 1, "cache": []},
        {"e": "hit_mismatch", "step": 1, "req": "r3", "index": 0, "block": 4,
         "problem": "not_cached"},
    ]  # fmt: skip
    res = check_prefix_cache(evs)
    assert res.valid is False and res.findings[0].kind == "hit_blocks"
    assert "request r3" in res.findings[0].message
    assert check_prefix_cache([{"e": "kv_record", "step": 0}]).valid is None


def test_a_cache_that_keeps_entries_of_evicted_blocks_is_caught_by_their_content():
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario
    from kvchaos.harness.tools.canaries import EvictKeepsEntry

    r = run_scenario(load_scenario("prefix-shared-clean"), 0, "cpu", None, EvictKeepsEntry)
    kinds = {(f.checker, f.kind) for f in r.findings}
    assert r.verdict == "FAIL" and ("prefix_cache", "cache_content") in kinds, r.summary


def test_a_cache_state_out_of_shape_is_a_finding_against_the_manager_not_a_harness_error():
    from kvchaos.engine.prefix_manager import PrefixCachingManager
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    class CacheOutOfPool(PrefixCachingManager):
        def snapshot(self):
            snap = super().snapshot()
            snap.cache = [*snap.cache, {"block": 10**6, "key": "k", "parent": None, "tokens": None}]
            return snap

    r = run_scenario(load_scenario("prefix-shared-clean"), 0, "cpu", None, CacheOutOfPool)
    assert r.verdict == "FAIL", r.summary
    bad = [f for f in r.findings if f.kind == "bad_snapshot"]
    assert bad and "cache (optional)" in bad[0].message


def test_a_cache_entry_is_rechecked_when_it_differs_from_the_one_that_passed():
    from kvchaos.harness.history.cache import cache_delta

    good = {"block": 3, "key": "k", "parent": None, "tokens": [1, 2]}
    _, known, wrong = cache_delta({}, [good], 8)
    assert wrong is None
    assert cache_delta(known, [dict(good)], 8)[2] is None
    changed = {**good, "tokens": [1, -2]}  # same (block, key), now out of shape
    assert "cache (optional)" in cache_delta(known, [changed], 8)[2]
    assert "cache (optional)" in cache_delta(known, [None], 8)[2]
    assert "cache (optional)" in cache_delta(known, [{**good, "block": 8}], 8)[2]  # past the pool
    assert "twice" in cache_delta(known, [good, dict(good)], 8)[2]
    assert cache_delta(known, [good, dict(good)], 8)[:2] == (None, None)


def test_the_cache_delta_keeps_its_own_copy_and_records_a_change_under_one_key():
    from kvchaos.harness.history.cache import apply_cache, cache_delta

    entry = {"block": 3, "key": "k", "parent": None, "tokens": [1, 2]}
    first, known, _ = cache_delta({}, [entry])
    entry["tokens"][1] = 9  # the manager rewrites its entry in place
    second, known, _ = cache_delta(known, [entry])
    assert first["cache_added"][0]["tokens"] == [1, 2]
    assert second["cache_added"] == [entry] and second["cache_removed"] == []
    state = apply_cache(apply_cache({}, first), second)
    assert state[(3, "k")]["tokens"] == [1, 9]
    third, _, _ = cache_delta(known, [dict(entry, tokens=[1, 9])])
    assert third["cache_added"] == [] and third["cache_n"] == 1


def test_a_broken_parent_link_names_the_parent_block_and_a_spill_into_it_explains_it():
    from kvchaos.faults.table_overflow import TableOverflow

    rec = written({"a": (A, [0, 1]), "b": ([1, 2], [2])})
    cache = [entry(1, "k1", "kb", [7, 8]), entry(2, "kb", None, [1, 2])]
    (ev,) = [x for x in CacheWatch(BS).check(rec, cache, 1) if x["block"] == 1]
    assert ev["problem"] == "parent" and ev["parent_block"] == 2
    finding = next(
        f for f in check_prefix_cache([{"e": "run_start", "step": 0}, ev]).findings
    ).__dict__
    assert finding["evidence"]["parent_block"] == 2
    truth = {"first_step": 1, "touched": {"requests": ["long0"], "rows": [], "blocks": [2]}}
    assert TableOverflow.explains(finding, truth) == "cause"  # it spilled into the parent
    truth["touched"]["blocks"] = [5]
    assert TableOverflow.explains(finding, truth) is None


def test_the_told_cap_is_a_step_s_so_a_flood_does_not_silence_a_later_step(monkeypatch):
    """An earlier step's flood of wrong entries (another fault's) leaves a later step's own wrong
    entry told (soak seed 1020: async_free's 64 by step 12 hid every stale_revive entry)."""
    import kvchaos.harness.run.cache_state as cs

    monkeypatch.setattr(cs, "MAX_TOLD", 2)
    rec, w = KVRecord(8, BS), CacheWatch(BS)
    flood = [entry(b, f"k{b}", None, [1, 2]) for b in range(4)]  # never written: partial
    assert len(w.check(rec, flood, 1)) == 2 and w.untold == 2
    rec.write("a", 0, 5, b"x" * 8, 10, 2)  # block 5, keyed later over other tokens
    rec.write("a", 1, 6, b"y" * 8, 11, 2)
    (ev,) = w.check(rec, [*flood, entry(5, "k5", None, [7, 8])], 2)
    assert (ev["block"], ev["problem"]) == (5, "tokens")
