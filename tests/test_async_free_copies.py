"""async_free: a late write carried by copy-on-write. The writes of a request freed early land
in a block two requests share; the one that writes there next takes a copy of it, late write
and all, and reads it: the fault's ground truth follows the copy (its `copied`)."""

from __future__ import annotations

from kvchaos.faults.async_free import AsyncFree
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import parse_scenario

# soak seed 2722 (table_overflow + prefix_cache + async_free), shrunk (kvchaos shrink): fill0,
# finished on step 15's output, is freed while step 15 still writes its position 44 (async_free);
# block 94, freed, is handed to fill4 and revived for fill5 from a stale key (prefix_cache's
# stale_revive), so both hold it when fill0's write lands there at step 16. At step 17 fill4
# appends into 94 (shared): copy-on-write copies 94 to 48, fill0's write with it, and fill4 reads
# 48 for its position 42. Before, the fault knew only 94: that read was explained by no planted
# fault (FAIL). The unshrunk run: sp0h6 reads block 38, copied from 107, r5's write (step 70).
SEED_2722 = {
    "scenario": {"name": "soak-2722-min", "seeds": [2722]},
    "engine": {
        "max_prefill_tokens": 46,
        "tp_size": 2,
        "async_scheduling": True,
        "cache": {
            "block_size": 2,
            "max_blocks_per_seq": 24,
            "max_num_seqs": 10,
            "num_blocks": 120,
            "prefix_caching": True,
        },
    },
    "workload": {"num_requests": 0},
    "faults": [
        {
            "name": "table_overflow",
            "defect": True,
            "params": {"at_step": 1, "neighbours": 1, "variant": "slot_past_pool"},
        },
        {"name": "prefix_cache", "defect": True, "params": {"variant": "stale_revive"}},
        {"name": "async_free", "defect": True, "params": {}},
    ],
    "expect": {
        "outcome": "detect",
        "checkers": [
            "block_accounting",
            "kv_reads",
            "oracle_divergence",
            "prefix_cache",
            "table_integrity",
        ],
        "within_steps": {"table_overflow": 2, "prefix_cache": 2, "async_free": 2},
    },
    "run": {"max_steps": 22},
}


def test_a_late_write_copied_on_write_is_the_early_frees():
    r = run_scenario(parse_scenario(SEED_2722, "<test>"), 2722, "cpu", None)
    truth = r.results["fault_verify"]["async_free"]
    landed = [x for x in truth["landed"] if x["req"] == "fill0"]
    assert [(x["step"], x["blocks"], x["holders"]) for x in landed] == [
        (16, [94], {"94": ["fill4", "fill5"]})
    ]
    assert truth["copied"] == [{"step": 17, "src": 94, "dst": 48}]
    assert 48 in truth["touched"]["blocks"]
    cow = [e["data"]["copies"] for e in r.events if e["e"] == "engine" and e["kind"] == "cow"]
    assert [94, 48] in [list(c) for cs in cow for c in cs]
    reads = [
        e
        for e in r.events
        if e["e"] == "kv_read" and e["req"] == "fill4" and e["block"] == 48 and e["step"] == 17
    ]
    assert reads and {(e["writer"], e["writer_step"], e["via_hit"]) for e in reads} == {
        ("fill0", 16, False)
    }
    credited = {
        (c["fault"], c["how"])
        for c in r.results["credits"]
        if c["checker"] == "kv_reads" and c["step"] == 17
    }
    assert ("async_free", "cause") in credited and (None, None) not in credited
    assert r.verdict == "PASS", r.summary


def _read(step: int, block: int, writer: str = "r5") -> dict:
    ev = {"req": "sp0h6", "block": block, "writer": writer, "origin": None}
    return {"checker": "kv_reads", "step": step, "kind": "wrong_read", "evidence": ev}


def test_a_copy_explains_reads_of_the_late_writers_kv_from_the_copys_step_on():
    truth = {
        "variant": "finish",
        "landed": [
            {"step": 70, "req": "r5", "written": 69, "blocks": [107], "holders": {"107": []}}
        ],
        "copied": [{"step": 71, "src": 107, "dst": 38}],
    }
    explains = AsyncFree.explains
    assert explains(_read(70, 107), truth) == "cause"
    assert explains(_read(71, 38), truth) == "cause"
    assert explains(_read(70, 38), truth) is None  # before the copy: 38 held other KV
    assert explains(_read(71, 38, writer="sp0h7"), truth) is None  # not the late writer's KV
    assert explains(_read(71, 39), truth) is None
    without = {k: v for k, v in truth.items() if k != "copied"}
    assert explains(_read(71, 38), without) is None  # the gap this closes
