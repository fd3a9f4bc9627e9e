"""The prefix_cache fault (faults/prefix_cache.py): its params and their errors, a trigger drawn the
same way for a seed, ground truth per variant on a real run (fired with the defect; pulled and
remediated without), what it explains (the request that READ the wrong KV, never a bystander that
holds the block), the defect paths of the pool, and its eight scenarios on one seed each."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvchaos.engine import CacheConfig, EngineConfig
from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.faults import REGISTRY, make_fault
from kvchaos.faults.base import ParamError
from kvchaos.faults.plan import Plan
from kvchaos.faults.prefix_cache import BAD_ENTRIES, PrefixCache, weak_hash
from kvchaos.harness.report.incident import build_incidents
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import ScenarioError, load_scenario, parse_scenario
from kvchaos.harness.tools.fingerprint import fingerprints

VARIANTS = PrefixCache.variant_names()
CFG = EngineConfig(
    max_prefill_tokens=30,
    cache=CacheConfig(
        block_size=4, num_blocks=64, max_blocks_per_seq=24, max_num_seqs=8, prefix_caching=True
    ),
)


def scenario(variant: str, outcome: str):
    return load_scenario(f"prefix-cache-{variant.replace('_', '-')}-{outcome}")


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each variant's detect and clean scenario on seed 0, once for the module."""
    return {
        (v, o): run_scenario(scenario(v, o), 0, "cpu", None)
        for v in VARIANTS
        for o in ("detect", "clean")
    }


# -- params ------------------------------------------------------------------------------------
def test_params_default_and_are_checked_with_clear_errors():
    assert PrefixCache.check_params({}) == {
        "variant": "partial_key",
        "pairs": 1,
        "pressure_tokens": 0,
    }
    bad = {
        "variant": ("weak", "params.variant: expected one of ['partial_key', 'weak_key'"),
        "pairs": (0, "params.pairs: expected an int >= 1, got 0"),
        "pressure_tokens": (-1, "params.pressure_tokens: expected an int >= 0, got -1"),
        "fraction": (0.5, "params.fraction: unknown param of fault prefix_cache"),
    }
    for key, (value, said) in bad.items():
        with pytest.raises(ParamError, match=f"fault prefix_cache: {said}".replace("[", r"\[")):
            PrefixCache.check_params({key: value})


def test_the_engine_must_cache_prefixes_and_fit_the_trigger():
    off = replace(CFG, cache=replace(CFG.cache, prefix_caching=False))
    with pytest.raises(ParamError, match=r"prefix_caching = true"):
        PrefixCache.check_params({"variant": "weak_key"}, off)
    aligned = replace(CFG, max_prefill_tokens=32)  # no chunk ends inside a block
    with pytest.raises(ParamError, match=r"max_prefill_tokens 32 is a multiple of block_size 4"):
        PrefixCache.check_params({"variant": "partial_key"}, aligned)
    PrefixCache.check_params({"variant": "weak_key"}, aligned)  # the others do not need it
    short = replace(CFG, cache=replace(CFG.cache, max_blocks_per_seq=5))
    with pytest.raises(ParamError, match=r"need 46 tokens in a table row; .* holds 20"):
        PrefixCache.check_params({"variant": "partial_key"}, short)


def test_a_scenario_without_prefix_caching_is_refused_at_load_naming_the_key():
    data = {
        "scenario": {"name": "pc-no-cache"},
        "engine": {"cache": {"prefix_caching": False}},
        "faults": [{"name": "prefix_cache", "params": {"variant": "stale_revive"}}],
        "expect": {"outcome": "detect", "checkers": ["kv_reads"]},
    }
    with pytest.raises(ScenarioError, match=r"<x>: faults\.0\.params\.variant: .*prefix_caching"):
        parse_scenario(data, "<x>")


# -- the trigger ---------------------------------------------------------------------------------
def shaped(variant: str, seed: int, pairs: int = 1) -> tuple[PrefixCache, Plan]:
    fault = make_fault("prefix_cache", True, {"variant": variant, "pairs": pairs}, seed)
    plan = Plan(CFG.model.vocab_size, random.Random(seed))
    fault.shape(plan, CFG)
    return fault, plan


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_trigger_is_the_same_for_a_seed_and_its_source_comes_first(variant):
    def drawn(seed):
        return [(a.to_dict(), a.prompt) for a in shaped(variant, seed, pairs=2)[1].actions]

    assert drawn(3) == drawn(3) and drawn(3) != drawn(4)
    fault, plan = shaped(variant, 3, pairs=2)
    first = plan.actions[0]
    assert (first.req, first.op, first.step, first.after) == ("pc0a", "submit", 1, None)
    byreq = {a.req: a for a in plan.actions if a.op == "submit"}
    assert byreq["pc1a"].after == "pc0b" and byreq["pc1a"].when == "finished"  # one pair at a time
    assert all(a.origin == "prefix_cache" for a in plan.actions)
    reader, source = byreq["pc0b"].prompt, byreq["pc0a"].prompt
    shared = fault.readers["pc0b"]["blocks"] * 4
    if variant == "weak_key":  # block 0: same sum, other tokens; the rest equal
        assert reader[:2] != source[:2] and sum(reader[:4]) == sum(source[:4])
        assert weak_hash(None, tuple(reader[:4])) == weak_hash(None, tuple(source[:4]))
        assert reader[2:shared] == source[2:shared]
    else:
        assert reader[:shared] == source[:shared] and reader[shared:] != source[shared:]
    waits = {"partial_key": "pc0a", "weak_key": "pc0a", "evict_referenced": "pc0a"}
    assert byreq["pc0b"].after == waits.get(variant, "pc0f3")  # stale: after the last filler
    if variant == "partial_key":  # cancelled after a first chunk that ends inside block 7
        cancel = next(a for a in plan.actions if a.op == "cancel")
        assert (cancel.req, cancel.when, shared) == ("pc0a", "prefill", 32)
    if variant in ("evict_referenced", "stale_revive"):  # the pool's tokens, once round
        fill = [a for a in plan.actions if a.req.startswith("pc0f")]
        assert sum(len(a.prompt) for a in fill) >= CFG.cache.num_blocks * 4


# -- ground truth on a real run ------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_defect_fires_on_what_it_did_and_names_the_readers(runs, variant):
    truth = runs[variant, "detect"].results["fault_verify"]["prefix_cache"]
    assert truth["fired"] and truth["variant"] == variant and truth["triggered"] >= 1
    assert truth["remediated"] == 0
    assert "pc0b" in truth["victims"]  # the trigger's reader read the wrong KV
    assert truth["touched"]["requests"] == truth["victims"]
    assert "pc0a" not in truth["victims"]  # its source only holds (or held) the blocks
    if variant == "evict_referenced":
        handed = truth["evicted_held"][0]
        assert handed["holders"] == ["pc0b"] and handed["taker"].startswith("pc0f")
        assert handed["taker"] not in truth["victims"]  # it overwrote; it read its own KV
        assert handed["block"] in {x["block"] for x in truth["revived_queued"]}
    else:
        hit = next(x for x in truth["wrong_hits"] if x["req"] == "pc0b")
        assert hit["step"] >= truth["first_step"] and hit["blocks"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_without_the_defect_the_trigger_is_pulled_and_the_remediation_acts(runs, variant):
    truth = runs[variant, "clean"].results["fault_verify"]["prefix_cache"]
    assert truth["planted"] is False and not truth["fired"] and not truth["victims"]
    assert truth["triggered"] == 1 and truth["remediated"] >= 1


@pytest.mark.parametrize("outcome", ["detect", "clean"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_scenario_passes_on_one_seed(runs, variant, outcome):
    r = runs[variant, outcome]
    assert r.verdict == "PASS", r.summary
    if outcome == "detect":  # the request that read the wrong KV is named by kv_reads
        kv = next(c for c in r.results["checkers"] if c["checker"] == "kv_reads")
        assert any(f["evidence"]["req"] == "pc0b" for f in kv["findings"])
        assert r.results["time_to_detect_steps"]["prefix_cache"] <= 2


def test_incidents_and_fingerprints_name_the_variant(runs):
    r = runs["stale_revive", "detect"]
    incident = build_incidents(r.results, r.events)[0]
    assert incident["title"].startswith("prefix_cache/stale_revive caught by")
    assert incident["fingerprint"]["failure_mode"] == "prefix_cache/stale_revive"
    assert "vllm#4761" in incident["root_cause"]["text"]
    faults = [{"name": "prefix_cache", "defect": True, "params": {"variant": "stale_revive"}}]
    assert {fp["fp"][1] for fp in fingerprints(r.results, faults)} == {"prefix_cache/stale_revive"}


def test_a_manager_it_cannot_plant_in_makes_the_run_inconclusive_and_says_why():
    r = run_scenario(
        scenario("weak_key", "detect"),
        0,
        "cpu",
        None,
        block_manager_spec="kvchaos.engine.block_manager:BlockManager",
    )
    assert r.verdict == "INCONCLUSIVE"
    assert "prefix_cache (plants in the reference prefix cache" in r.summary


# -- what it explains ----------------------------------------------------------------------------
TRUTH = {
    "wrong_hits": [{"step": 5, "req": "b", "blocks": [3, 4], "why": "keyed over other tokens"}],
    "evicted_held": [{"step": 9, "block": 7, "holders": ["h"], "taker": "t"}],
    "revived_queued": [{"step": 6, "block": 7}],
    "bad_entries": [{"step": 2, "block": 11, "why": "keyed before its KV was computed"}],
    "tainted_blocks": [{"step": 6, "block": 12, "origin": "b"}],
    "poisoned": [{"step": 8, "req": "p", "origin": "b", "blocks": [12]}],
}


def finding(checker, step, kind, **ev):
    return {"checker": checker, "step": step, "kind": kind, "evidence": ev}


@pytest.mark.parametrize(
    "f, how",
    [
        (finding("kv_reads", 5, "wrong_read", req="b", block=3), "cause"),
        (finding("kv_reads", 5, "unwritten_read", req="b", block=4), "cause"),
        (finding("kv_reads", 4, "wrong_read", req="b", block=3), None),  # before its hit
        (finding("kv_reads", 5, "wrong_read", req="b", block=9), None),  # not a block served
        (finding("kv_reads", 5, "wrong_read", req="a", block=3), None),  # the holder A: bystander
        (finding("kv_reads", 9, "wrong_read", req="h", block=7), "cause"),  # its block re-handed
        (finding("kv_reads", 9, "wrong_read", req="t", block=7), None),  # the taker
        (finding("kv_reads", 8, "poisoned_read", req="p", block=12, origin="b"), "consequence"),
        (finding("kv_reads", 8, "poisoned_read", req="p", block=12, origin="a"), None),
        (finding("oracle_divergence", 6, "divergence", req="b"), "cause"),
        (finding("oracle_divergence", 6, "divergence", req="a"), None),  # a bystander holder
        (finding("oracle_divergence", 3, "divergence", req="b"), None),  # before the wrong read
        (finding("oracle_divergence", 8, "divergence", req="p"), "consequence"),
        (finding("prefix_cache", 2, "cache_content", block=11), "cause"),
        (finding("prefix_cache", 7, "cache_content", block=12), "consequence"),
        (finding("prefix_cache", 7, "cache_content", block=13), None),
        (finding("prefix_cache", 5, "hit_blocks", req="b", block=3), "cause"),
        (finding("block_accounting", 6, "free_referenced", blocks=[7]), "cause"),
        (finding("block_accounting", 6, "free_referenced", blocks=[7, 8]), None),
        (finding("block_accounting", 5, "free_referenced", blocks=[7]), None),  # not revived yet
        (finding("block_accounting", 9, "shared_write", req="t", block=7), "cause"),
        (finding("block_accounting", 6, "conservation", free=57, referenced=8, total=64), "cause"),
        (finding("block_accounting", 6, "conservation", free=58, referenced=8, total=64), None),
        (finding("block_accounting", 9, "leak", req="h", blocks=[7]), None),
        (finding("table_integrity", 9, "foreign_block", req="h", blocks=[7]), None),
    ],
)
def test_explains_credits_the_readers_never_a_bystander(f, how):
    assert PrefixCache.explains(f, TRUTH) == how


def test_a_read_two_planted_faults_explain_is_a_catch_for_each():
    """A kv_reads finding that table_overflow (its block once touched) and prefix_cache (the
    request it served wrong KV) both explain as their cause counts for both: neither is MISSED."""
    from kvchaos.harness.check.findings import CheckResult, Finding
    from kvchaos.harness.check.verdict import decide

    sc = parse_scenario(
        {
            "scenario": {"name": "two-planted"},
            "engine": {"max_prefill_tokens": 30, "cache": {"prefix_caching": True}},
            "faults": [
                {"name": "table_overflow"},
                {"name": "prefix_cache", "params": {"variant": "weak_key"}},
            ],
            "expect": {"outcome": "detect", "checkers": ["kv_reads"], "within_steps": 2},
        },
        "<x>",
    )
    read = Finding(
        checker="kv_reads",
        step=5,
        message="b read block 3",
        evidence={"req": "b", "block": 3},
        manifest=None,
        kind="wrong_read",
    )
    base = {"fired": True, "first_step": 5, "touched": {"requests": [], "blocks": [3], "rows": []}}
    verify = {"table_overflow": {**base, "overlong": []}, "prefix_cache": {**base, **TRUTH}}
    v = decide(sc, [CheckResult(checker="kv_reads", valid=False, findings=[read])], verify, None)
    assert v.verdict == "PASS" and v.time_to_detect == {"table_overflow": 0, "prefix_cache": 0}
    assert [r["fault"] for r in v.credit_rows()] == ["table_overflow", "prefix_cache"]


# -- the pool's defect paths ---------------------------------------------------------------------
def cached_blocks(pool: PrefixBlockPool, tokens: list[int]) -> list[int]:
    blocks, key, bs = [], None, pool.block_size
    for i in range(0, len(tokens), bs):
        b = pool.allocate()
        key = pool.cache_full_block(b, key, tokens[i : i + bs])
        blocks.append(b)
    return blocks


def test_the_pool_defect_paths_do_what_the_bug_did_and_never_raise():
    told = []
    pool = PrefixBlockPool(4, 2)
    pool.seams.unlink_on_revive = False
    pool.seams.on_defect = lambda kind, d: told.append((kind, d["block"]))
    a = cached_blocks(pool, [1, 2, 3, 4])
    for b in a:
        pool.free(b)
    pool.touch(a[0])  # revived, still queued: counted free while held
    assert pool.num_free == 4 and a[0] in pool.free_order() and pool.ref[a[0]] == 1
    taken = [pool.allocate() for _ in range(4)]  # the queue: 2, 3, then the held 0 and 1
    assert taken[2] == a[0] and pool.ref[a[0]] == 2  # re-handed with a reference more, not 1
    assert told == [("revive_queued", a[0]), ("rehanded", a[0])]

    pool, told = PrefixBlockPool(4, 2), []
    pool.seams.evict_on_reuse = pool.seams.verify_hits = False
    pool.seams.on_defect = lambda kind, d: told.append((kind, d["block"]))
    a = cached_blocks(pool, [1, 2, 3, 4])
    for b in reversed(a):
        pool.free(b)
    fresh = [pool.allocate() for _ in range(3)]  # 2, 3, then 1: A's second block, key kept
    assert fresh[2] == a[1] and told == [("kept_key", a[1])]
    hit = pool.match_prefix([1, 2, 3, 4])
    assert hit == a and pool.served_wrong([1, 2, 3, 4], hit) == [a[1]]  # only the reused one

    pool = PrefixBlockPool(4, 2, hash_fn=weak_hash)
    pool.seams.verify_hits = False
    cached_blocks(pool, [5, 6, 7, 8])
    hit = pool.match_prefix([6, 5, 7, 8])  # block 0: the same sum
    assert len(hit) == 2 and pool.served_wrong([6, 5, 7, 8], hit) == hit
    pool.seams.verify_hits = True
    assert pool.match_prefix([6, 5, 7, 8]) == []  # the remediation's check refuses it


def test_the_soak_draws_every_variant_with_prefix_caching_on():
    from kvchaos.harness.tools.soak_space import generate_scenario

    seen = set()
    for seed in range(200):
        d = generate_scenario(seed)
        pc = [f for f in d.get("faults", []) if f["name"] == "prefix_cache"]
        if pc:
            seen.add(pc[0]["params"]["variant"])
            assert d["engine"]["cache"]["prefix_caching"] and "prefix" in d["workload"]
            parse_scenario(d, f"<soak {seed}>")  # its params fit the engine drawn
    assert seen == set(VARIANTS) and "prefix_cache" in REGISTRY


@pytest.mark.parametrize("seed", [1020, 1428, 2028])
def test_stale_revive_fires_when_a_kept_key_s_block_is_written_over(seed):
    """Soak seeds 1020 (async scheduling, async_free) and 1428 (table_overflow, refcount_leak)
    were MISSED: the truth fired as allocate kept a key, while the block still held the KV the
    key names for 4-6 steps (its owner's KV a step late, or written astray, or the entry spoiled
    by another fault before). It fires when a write lands there with other KV: caught at once.
    2028: async_free's flood of wrong entries used the run's told cap by step 12 (now a step's)."""
    from kvchaos.harness.tools.soak_space import generate_scenario

    sc = parse_scenario(generate_scenario(seed), f"<soak {seed}>")
    r = run_scenario(sc, seed, "cpu", None)
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["prefix_cache"]
    kept = [x for x in truth["bad_entries"] if x["why"].startswith("re-allocated")]
    assert kept and truth["first_step"] == min(x["step"] for x in kept)
    assert r.results["time_to_detect_steps"]["prefix_cache"] <= 2


@pytest.mark.parametrize(
    "seed, step, block, restored",
    [
        (1521, 10, 27, False),  # r0's restore (unwritten: async_free staging) in a kept key
        (1115, 10, 30, True),  # r0's restore in pc0f0's kept keys; r7 restored its wrong hit
        (1773, 12, 36, True),
    ],
)
def test_stale_revive_sees_the_host_tier_s_copies_in(seed, step, block, restored):
    """Soak seeds 1521, 1115, 359, 905 and 1773 (the prefix-caching reference with a host tier)
    FAILed: a restore's new device blocks came from allocate with their keys kept, and the copy
    in landed the restored request's KV there, other KV than the keys name, written by no batch
    (the truth read only the engine's record of a batch's writes). Now a copy in is a write, at
    the step it landed. And a victim stored out and restored reads its wrong hit's KV on from
    the blocks its restore copied in (1115's r7, read at step 28)."""
    from kvchaos.harness.tools.soak_space import generate_scenario

    sc = parse_scenario(generate_scenario(seed), f"<soak {seed}>")
    r = run_scenario(sc, seed, "cpu", None)
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["prefix_cache"]
    assert {"step": step, "block": block, "why": BAD_ENTRIES["kept_key"]} in truth["bad_entries"]
    found = [
        f
        for f in r.findings
        if f.checker == "prefix_cache" and f.step == step and f.evidence.get("block") == block
    ]
    assert found and found[0].kind == "cache_content"
    assert any(x["why"] == "restored" for x in truth["wrong_hits"]) == restored
