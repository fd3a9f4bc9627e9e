"""KV a planted fault wrote wrong, carried on by the host tier on the prefix-caching reference
(the soak's prefix tier mixes): a store copies a block as it is, its restore brings that KV back
into other device blocks, and the writer record follows it. The fault that wrote the KV explains
the read of it wherever it was carried; a write through an unused entry that lands in a block a
store is copying explains that store's host copy differing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvchaos.faults.async_free import AsyncFree
from kvchaos.faults.prefix_cache import PrefixCache
from kvchaos.faults.table_overflow import TableOverflow
from kvchaos.harness.check.verdict import attribute
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import parse_scenario
from kvchaos.harness.tools.soak_space import generate_scenario


def _read(req: str, block: int, writer: str, writer_step: int, step: int = 26) -> dict:
    ev = {"req": req, "block": block, "writer": writer, "writer_step": writer_step}
    return {"checker": "kv_reads", "kind": "wrong_read", "step": step, "evidence": ev}


def test_a_late_write_restored_into_another_block_is_the_async_free_s():
    """528: r1's late write landed in block 27 (r6's) at step 18; r6 was stored cold from it and
    restored into block 18, where it read r1's KV."""
    landed = [{"step": 18, "req": "r1", "written": 17, "blocks": [27], "holders": {"27": ["r6"]}}]
    truth = {"variant": "finish", "landed": landed, "victims": [{"step": 18, "req": "r6"}]}
    assert AsyncFree.explains(_read("r6", 18, "r1", 18), truth) == "cause"
    assert AsyncFree.explains(_read("r6", 27, "r1", 18), truth) == "cause"  # where it landed
    # r1's KV of another step, in a block no late write reached: not the late write
    assert AsyncFree.explains(_read("r6", 18, "r1", 12), truth) is None
    assert AsyncFree.explains(_read("r6", 18, "r1", 18, step=17), truth) is None  # not yet


def test_the_taker_s_kv_restored_into_the_victim_s_blocks_is_the_prefix_cache_s():
    """367: allocate handed block 68 of r8 (paused) to r10 at step 19, r10 wrote it; r8 was stored
    from it and restored into block 31, where it read r10's KV."""
    held = [{"step": 19, "block": 68, "holders": ["r8"], "taker": "r10"}]
    truth = {"variant": "evict_referenced", "evicted_held": held, "wrong_hits": []}
    assert PrefixCache.explains(_read("r8", 31, "r10", 19, step=58), truth) == "cause"
    assert PrefixCache.explains(_read("r8", 31, "r10", 18, step=58), truth) is None  # before
    assert PrefixCache.explains(_read("r9", 31, "r10", 19, step=58), truth) is None  # no holder
    assert PrefixCache.explains(_read("r8", 31, "r7", 19, step=58), truth) is None  # no taker


def test_the_taker_s_kv_restored_and_keyed_is_a_prefix_cache_consequence():
    """2405: allocate handed blocks 21, 20 of r8 (paused on a hit) to r9 at step 28, r9 wrote
    them; r8 was stored from them and restored into 22, 23 (step 35), which the restore keyed
    under r8's tokens: those cache entries hold r9's KV (and r2's, block 21's before)."""
    held = [{"step": 28, "block": b, "holders": ["r8", "r9"], "taker": "r9"} for b in (20, 21)]
    hits = [{"step": 35, "req": "r8", "blocks": [22, 23], "why": "restored"}]
    truth = {"variant": "evict_referenced", "evicted_held": held, "wrong_hits": hits}

    def content(block: int, writers: list[str], step: int = 36) -> dict:
        ev = {"block": block, "problem": "tokens", "writers": writers, "written": 8}
        return {"checker": "prefix_cache", "kind": "cache_content", "step": step, "evidence": ev}

    assert PrefixCache.explains(content(22, ["r2", "r9"]), truth) == "consequence"
    assert PrefixCache.explains(content(23, ["r9"]), truth) == "consequence"
    assert PrefixCache.explains(content(24, ["r9"]), truth) is None  # not restored wrong
    assert PrefixCache.explains(content(22, ["r2"]), truth) is None  # not the taker's KV
    assert PrefixCache.explains(content(22, ["r9"], step=34), truth) is None  # before landing
    hits[0]["why"] = "forked"  # a wrong hit not carried by a restore
    assert PrefixCache.explains(content(22, ["r9"]), truth) is None


def test_a_write_through_an_unused_entry_into_a_block_in_store_explains_its_host_copy():
    """1370: r12 (its table mixed by async_free staging) wrote through an unused entry, landing in
    the pool's last block (20), which r9 (holding it as a prefix hit) was storing from step 139."""
    sc = SimpleNamespace(faults=[SimpleNamespace(name="async_free", defect=True)])
    mixed = [{"step": 139, "rows": [1], "seqs": ["r12"], "blocks": [20]}]
    verify = {"async_free": {"fired": True, "variant": "staging", "mixed": mixed}}
    store = SimpleNamespace(
        checker="offload",
        kind="store_content",
        step=140,
        evidence={"req": "r9", "blocks": [20], "issued": 139, "since": [139]},
    )

    def credited(step: int, blocks: list[int]) -> list:
        ev = {"req": "r12", "via": "unused_entry", "blocks": blocks}
        wrote = SimpleNamespace(checker="table_integrity", kind="unslotted_write", step=step)
        return attribute(sc, [SimpleNamespace(**vars(wrote), evidence=ev), store], verify)

    assert credited(139, [20]) == [[("async_free", "cause")], [("async_free", "consequence")]]
    assert credited(139, [19])[1] == []  # another block
    assert credited(139, [])[1] == []  # (as recorded before the landing blocks were)
    mixed[0]["step"] = 138
    assert credited(138, [20])[1] == []  # before the store's issue


def test_misread_rows_writing_blocks_in_store_explain_their_host_copy():
    """3803: the kernels run with twice the manager's block size; r0's store (blocks 0-8, issued
    at step 2, completed at 4): r2 (step 2) wrote through its misread row into blocks 3-5, r5
    (step 3) into 3-5 and, its entries past the kernels' pool wrapping, into 0-2."""
    strays = [{"step": 2, "blocks": [3, 4, 5]}, {"step": 3, "blocks": [0, 1, 2, 3, 4, 5]}]
    truth = {
        "fired": True,
        "first_step": 1,
        "variant": "kernel_block_size",
        "touched": {"requests": [], "rows": [], "blocks": list(range(66))},
        "strays": strays,
    }

    def store(blocks: list[int], since: int = 2, step: int = 4, kind="store_content") -> dict:
        ev = {"req": "r0", "blocks": blocks, "issued": since, "since": [since] * len(blocks)}
        return {"checker": "offload", "kind": kind, "step": step, "evidence": ev}

    assert TableOverflow.explains(store([0, 1, 2, 3, 4, 5]), truth) == "consequence"
    assert TableOverflow.explains(store([0, 1, 2, 6]), truth) is None  # 6: no misread write
    assert TableOverflow.explains(store([0], since=4, step=6), truth) is None  # before its issue
    assert TableOverflow.explains(store([0], step=3), truth) is None  # r5's write: after it landed
    assert TableOverflow.explains(store([0], kind="restore_content"), truth) is None
    # touched names every block: without where the writes landed, no credit
    assert TableOverflow.explains(store([0, 1]), {**truth, "strays": []}) is None


@pytest.mark.parametrize(
    "seed, checker, step, faults",
    [
        (528, "kv_reads", 26, {"async_free"}),  # r1's late write, stored and restored by r6
        (367, "kv_reads", 58, {"prefix_cache"}),  # r10's KV in r8's handed blocks, restored
        (1370, "offload", 140, {"table_overflow", "async_free"}),  # r12 wrote r9's block 20
        (2405, "prefix_cache", 36, {"prefix_cache"}),  # r9's KV restored into r8's, keyed
        # r2, r5 wrote r0's blocks in store through rows the kernels misread (kernel_block_size)
        (3803, "offload", 4, {"table_overflow", "offload"}),
    ],
)
def test_the_prefix_tier_mixes_seeds_pass(seed, checker, step, faults):
    d = generate_scenario(seed)
    assert d["engine"]["cache"]["prefix_caching"] and "offload" in d["engine"]
    r = run_scenario(parse_scenario(d, f"<soak {seed}>"), seed, report_dir=None)
    assert r.verdict == "PASS", (seed, r.summary)
    credits = [c for c in r.results["credits"] if c["checker"] == checker and c["step"] == step]
    assert credits and {c["fault"] for c in credits} <= faults, (seed, credits)  # (one each)
