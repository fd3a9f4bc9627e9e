"""The kv_reads checker (harness/check/cache_checks.py): a wrong read becomes a finding that names
the request that READ it (never a bystander holding the block), its block, writer and hit; an
unexplained one FAILs the run like any finding; table_overflow and ordering_race explain the
reads their defects cause; the record is off (not judged) without a prefix cache. In runs: the
reference prefix cache reads no wrong KV, a manager serving a hit on a block with other tokens is
caught naming the request that took the hit, real ranks record what the simulation does."""

from __future__ import annotations

import pytest
import torch

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
from kvchaos.faults.ordering_race import OrderingRace
from kvchaos.faults.table_overflow import TableOverflow
from kvchaos.harness.check.cache_checks import check_kv_reads
from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario
from tests.managers import HitPastItsMatch


def wrong_read(step=44, **kw) -> dict:
    return {
        "e": "kv_read",
        "step": step,
        "req": "r7",
        "rank": 0,
        "index": 1,
        "block": 12,
        "slots": [0, 1, 2, 3],
        "pos": [4, 5, 6, 7],
        "writer": "r3",
        "writer_pos": 4,
        "writer_step": 41,
        "via_hit": True,
        "origin": None,
        **kw,
    }


def history(*reads) -> list[dict]:
    hit = {"req": "r7", "known": 9, "answered": 8, "used": 8, "capped": False, "blocks": [5, 12]}
    return [
        {"e": "run_start", "step": 0, "scenario": "t", "seed": 0, "config": {}},
        {"e": "kv_record", "step": 0, "ranks": 1},
        {"e": "submit", "step": 29, "req": "r7", "prompt_len": 9, "max_new": 4, "parent": None},
        {"e": "engine", "step": 30, "kind": "hit", "data": hit},
        {"e": "step", "step": 30, "prefill_tokens": 1, "decode_tokens": 0, "tokens": {"r7": 1}},
        *reads,
    ]


def test_a_wrong_read_is_a_finding_naming_its_reader_block_writer_and_hit():
    res = check_kv_reads(history(wrong_read()))
    (f,) = res.findings
    assert res.valid is False and (f.checker, f.kind, f.step) == ("kv_reads", "wrong_read", 44)
    assert f.message == (
        "request r7 read block 12 (its hit from step 30) at positions 4..7; that KV was written "
        "by r3 for other tokens at step 41"
    )
    assert f.evidence["req"] == "r7" and f.evidence["hit_step"] == 30


def test_the_kinds_unwritten_poisoned_and_torn_say_so():
    reads = [
        wrong_read(writer=None, writer_pos=None, writer_step=None, via_hit=False),
        wrong_read(origin="r2", block=13),
        wrong_read(torn=True, block=14, writer_pos=9),
    ]
    a, b, c = check_kv_reads(history(*reads)).findings
    assert a.kind == "unwritten_read" and "(entry 1)" in a.message and "ever written" in a.message
    assert b.kind == "poisoned_read" and "wrong read by request r2" in b.message
    assert c.kind == "wrong_read" and "a step that failed" in c.message


def test_no_record_no_judgement_and_a_clean_record_holds():
    assert check_kv_reads(history()[:1] + history()[2:]).status == "not judged"
    assert check_kv_reads(history()).status == "held"


def test_an_unexplained_wrong_read_fails_the_run_naming_the_reader():
    sc = parse_scenario({"scenario": {"name": "t"}, "expect": {"outcome": "clean"}}, "<test>")
    checks, v = evaluate(sc, history(wrong_read()), {}, None)
    assert v.verdict == "FAIL" and "kv_reads at step 44" in v.summary
    assert "request r7 read block 12" in v.summary
    assert next(c for c in checks if c.checker == "kv_reads").status == "fired"


def _finding(kind="wrong_read", step=12, **evidence) -> dict:
    return {"checker": "kv_reads", "step": step, "kind": kind, "evidence": evidence}


def test_table_overflow_explains_the_reads_of_what_it_touched():
    truth = {"first_step": 10, "touched": {"requests": ["r7"], "rows": [], "blocks": [12]}}
    explains = TableOverflow.explains
    assert explains(_finding(req="r7", block=3), truth) == "cause"
    assert explains(_finding(req="r1", block=12), truth) == "cause"  # KV a spilled write left
    assert explains(_finding("poisoned_read", req="r7", block=3), truth) == "consequence"
    assert explains(_finding(req="r1", block=3), truth) is None
    assert explains(_finding(step=9, req="r7", block=12), truth) is None  # before it fired


def test_ordering_race_explains_the_reads_of_a_rank_it_delayed():
    truth = {
        "stale": [{"step": 5, "ranks": [1], "requests": ["r0"]}],
        "touched": {"requests": ["r0"], "rows": [], "blocks": [3]},
    }
    explains = OrderingRace.explains
    assert explains(_finding(step=7, rank=1, block=3), truth) == "cause"
    assert explains(_finding(step=5, rank=1, block=9), truth) == "cause"  # read on the stale table
    assert explains(_finding("poisoned_read", step=7, rank=1, block=3), truth) == "consequence"
    assert explains(_finding(step=7, rank=0, block=3), truth) is None  # rank 0 never lagged
    assert explains(_finding(step=7, rank=1, block=9), truth) is None
    assert explains(_finding(step=4, rank=1, block=3), truth) is None
    # later, on that rank, a read of KV its request computed through the stale table: knock-on
    assert explains(_finding(step=7, rank=1, block=9, req="r0"), truth) == "consequence"
    assert explains(_finding(step=7, rank=0, block=9, req="r0"), truth) is None


def test_ordering_race_explains_a_poisoned_read_on_any_rank_as_its_consequence():
    """A wrong read's output is gathered from every rank: KV its reader wrote since is poisoned on
    rank 0 too, and read there by a request the race never touched (a cache hit on its block)."""
    late = {"late_copies": [{"step": 3, "ranks": [1], "requests": ["r2"], "blocks": [18]}]}
    stale = {"stale": [{"step": 5, "ranks": [1], "requests": ["r0"]}]}
    explains = OrderingRace.explains
    for truth, origin, s in ((late, "r2", 3), (stale, "r0", 5)):
        truth["touched"] = {"requests": [origin], "rows": [], "blocks": [18]}
        poisoned = _finding("poisoned_read", step=12, rank=0, req="f6", block=18, origin=origin)
        assert explains(poisoned, truth) == "consequence"
        assert explains({**poisoned, "step": s - 1}, truth) is None  # before the race fired
        elsewhere = _finding("poisoned_read", step=12, rank=0, req="f6", block=18, origin="r9")
        assert explains(elsewhere, truth) is None  # another request's wrong read: not the race's
    assert explains(_finding(step=12, rank=0, req="f6", block=18), late) is None  # not poisoned


# soak seed 14, shrunk (kvchaos shrink): cow_lag's late copy on rank 1 makes r2 read wrongly at
# step 4; f6, forked beside it, preempted and re-admitted, hits r2's block at step 13, whose KV
# (written by r2 after that read) is poisoned on rank 0 as on rank 1. Before, rank 0's record
# held it clean: f6's divergence at step 15 was explained by no planted fault (FAIL).
SEED_14 = {
    "scenario": {"name": "soak-14-min", "seeds": [14]},
    "engine": {
        "max_prefill_tokens": 36,
        "tp_size": 2,
        "async_scheduling": True,
        "cache": {"block_size": 2, "max_blocks_per_seq": 16, "max_num_seqs": 6, "num_blocks": 36},
    },
    "workload": {
        "num_requests": 9,
        "fork_groups": 9,
        "prompt_len": {"dist": "uniform", "min": 1, "max": 18},
        "output_len": {"dist": "uniform", "min": 9, "max": 18},
    },
    "faults": [
        {
            "name": "ordering_race",
            "defect": True,
            "params": {"probability": 1.0, "variant": "cow_lag"},
        }
    ],
    "expect": {
        "outcome": "detect",
        "checkers": ["kv_reads", "oracle_divergence", "prefix_cache", "table_integrity"],
        "within_steps": {"ordering_race": 2},
    },
    "run": {"max_steps": 15},
}


def test_a_hit_on_kv_a_cow_lag_read_poisoned_is_the_races_consequence_on_every_rank():
    run = run_scenario(parse_scenario(SEED_14, "<test>"), 14, report_dir=None)
    assert run.verdict == "PASS", run.summary
    reads = [e for e in run.events if e["e"] == "kv_read" and e["req"] == "f6"]
    assert {(e["rank"], e["origin"], e["via_hit"]) for e in reads} == {(0, "r2", True)}
    credits = run.results["credits"]
    f6 = [c for c in credits if c["checker"] == "oracle_divergence" and c["step"] == 15]
    assert f6 == [
        {"checker": "oracle_divergence", "step": 15, "fault": "ordering_race", "how": "consequence"}
    ]


def _prefix_shared(caching: bool):
    sc = load_scenario("prefix-shared-clean")
    sc.engine.setdefault("cache", {})["prefix_caching"] = caching
    return sc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reference_prefix_cache_reads_no_wrong_kv(seed):
    r = run_scenario(_prefix_shared(True), seed, report_dir=None)
    assert r.verdict == "PASS", r.summary
    kinds = [e["e"] for e in r.events]
    assert "kv_record" in kinds and "kv_read" not in kinds
    assert next(c for c in r.results["checkers"] if c["checker"] == "kv_reads")["status"] == "held"
    assert r.results["exercised"]["shared_kv_reads"] > 0  # it judged reads of others' KV


def test_without_a_prefix_cache_the_record_is_off_and_costs_nothing():
    r = run_scenario(_prefix_shared(False), 0, report_dir=None)
    assert not [e for e in r.events if e["e"] in ("kv_record", "kv_read")]
    assert "shared_kv_reads" not in r.results["exercised"]
    assert next(c for c in r.results["checkers"] if c["checker"] == "kv_reads")["status"] == (
        "not judged"
    )


def test_a_hit_on_a_block_with_other_tokens_is_caught_naming_the_request_that_took_it():
    r = run_scenario(_prefix_shared(False), 0, report_dir=None, block_manager=HitPastItsMatch)
    assert r.verdict == "FAIL", r.summary
    found = [f for f in r.findings if f.checker == "kv_reads"]
    assert found and r.summary.startswith("bug found: kv_reads")
    hits = {}
    for e in r.events:
        if e["e"] == "engine" and e["kind"] == "hit":
            hits.setdefault(e["data"]["req"], set()).update(e["data"]["blocks"])
    for f in found:  # the reader took the block with its hit; the writer only held it
        ev = f.evidence
        assert f.kind == "wrong_read" and ev["via_hit"] and ev["block"] in hits[ev["req"]]
        assert ev["writer"] != ev["req"] and f.message.startswith(f"request {ev['req']} read")
    readers = {f.evidence["req"] for f in found}
    diverged = {f.evidence["req"] for f in r.findings if f.checker == "oracle_divergence"}
    assert readers <= diverged and all(f.manifest for f in found)


def test_observing_the_batch_changes_nothing_the_engine_computes():
    model = ModelConfig(
        num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=61, max_position=128,
    )  # fmt: skip
    cache = CacheConfig(block_size=4, num_blocks=40, max_blocks_per_seq=8, max_num_seqs=4)
    cfg = EngineConfig(model=model, cache=cache, seed=3, attention_backend="torch", tp_size=2)
    outs, seen = [], []
    for observe in (False, True):
        eng = Engine(cfg)
        if observe:
            eng.seams.on_batch = lambda rank, reads, writes: seen.append((rank, reads, writes))
        eng.add_request("a", [1, 2, 3, 4, 5, 6], 6)
        eng.add_request("b", [1, 2, 3, 9], 5)
        logits = []
        while eng.has_unfinished():
            logits += [v for _, v in sorted(eng.step().logits.items())]
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])
    assert seen and {rank for rank, _, _ in seen} == {0}  # rank 1's table is rank 0's: mirrored
    rank, reads, writes = seen[0]
    assert [(s, n) for s, n, _ in reads] == [("a", 6), ("b", 4)]
    assert [w[:3] for w in writes[:2]] == [("a", 0, 1), ("a", 1, 2)]


@pytest.mark.distributed
def test_real_ranks_record_what_the_simulation_does():
    from kvchaos.engine.cluster import Cluster

    def reads(**kw):
        sc = load_scenario("ordering-race-detect")
        sc.engine.setdefault("cache", {})["prefix_caching"] = True
        r = run_scenario(sc, 0, report_dir=None, **kw)
        assert r.verdict == "PASS", r.summary
        return [e for e in r.events if e["e"] == "kv_read"]

    with Cluster(timeout_s=60) as c:
        real = reads(tp_mode="distributed", cluster=c)
    assert real and real == reads()
    assert {e["rank"] for e in real} == {1}  # the lagging rank's own record
