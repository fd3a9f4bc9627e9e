"""What each fault drawn into a soak scenario needs of the engine and workload the seed drew:
pure adjustments of the drawn dicts, no draws of their own (harness/tools/soak_space.py draws).
Each keeps the needs of the faults drawn beside it; tests/test_soak.py loads thousands of
draws."""

from __future__ import annotations


def fit_leak_variant(engine: dict, fault: dict) -> None:
    """What each variant's trigger needs of the engine (faults/refcount_leak.py check_engine):
    retry a prefix cache, a pool its fillers can hold all but a few blocks of, and rows for them;
    prefill a row longer than a chunk."""
    cache, v = engine["cache"], fault["params"]["variant"]
    bs, width = cache["block_size"], cache["max_blocks_per_seq"]
    if v in ("preempted", "retry"):  # four requests decoding past the pool: preemptions
        cache["num_blocks"] = min(cache["num_blocks"], 3 * width)
    if v == "prefill":
        engine["max_prefill_tokens"] = min(engine["max_prefill_tokens"], width * bs - 8)
    elif v == "retry":
        cache["prefix_caching"] = True
        cache["max_num_seqs"] = max(cache["max_num_seqs"], 6)
        # a cut chunk ends inside a block: what partial_key's trigger needs, if it is drawn too
        mpt = max(bs, min(engine["max_prefill_tokens"], (width - 4) * bs - 1))
        engine["max_prefill_tokens"] = mpt
        need = 3 + -(-mpt // bs)
        cache["max_blocks_per_seq"] = width = max(width, need + 4)
        cache["num_blocks"] = min(max(cache["num_blocks"], need + 8), 3 * width)


def fit_table_overflow(engine: dict, fault: dict) -> None:
    """What a table_overflow variant needs of the engine: a resize policy (stride_mismatch), a
    block of 3+ tokens (floor_width), a prefill chunk that crosses a row's end mid-chunk
    (chunked_growth), rows for requests that run the pool dry (slot_past_pool)."""
    v, cache = fault["params"].get("variant"), engine["cache"]
    if v == "stride_mismatch":
        cache["overflow_policy"] = "resize"
    elif v == "floor_width" and cache["block_size"] < 3:
        cache["block_size"] = 4
    elif v == "slot_past_pool":  # rows enough for its requests to run the pool dry at once
        pool_rows = -(-cache["num_blocks"] // cache["max_blocks_per_seq"])
        rows = fault["params"].get("neighbours", 3) + pool_rows + 2
        cache["max_num_seqs"] = max(cache["max_num_seqs"], rows)
    elif v == "chunked_growth":
        cap = cache["max_blocks_per_seq"] * cache["block_size"]
        mpt = min(engine["max_prefill_tokens"], cap - 1)
        while mpt > 2 and cap % mpt == 0:
            mpt -= 1
        engine["max_prefill_tokens"] = mpt


def fit_async_free(engine: dict, workload: dict, fault: dict, stall: bool) -> None:
    """async_free plants in asynchronous scheduling; preempt needs a pool the requests outgrow,
    which a stall's few long requests never do, staging one rank (else it frees on finish)."""
    engine["async_scheduling"] = True
    v = fault["params"]["variant"]
    if (v in ("preempt", "staging") and stall) or (v == "staging" and engine["tp_size"] > 1):
        fault["params"]["variant"] = "finish"
    elif fault["params"]["variant"] == "preempt":  # four requests that decode long: twice the
        cache, out = engine["cache"], workload["output_len"]  # blocks one needs is too few
        out["min"] = max(out["min"], out["max"] // 2)
        per = -(-(workload["prompt_len"]["max"] + out["max"]) // cache["block_size"])
        cache["num_blocks"] = max(cache["max_blocks_per_seq"], 2 * per)
        cache["max_num_seqs"] = max(cache["max_num_seqs"], 4)
        workload["num_requests"] = max(workload["num_requests"], 8)


def fit_prefix_cache(engine: dict, workload: dict, fault: dict) -> None:
    """The prefix_cache trigger needs prefix caching, rows (and a pool) for its requests and, for
    partial_key, a prefill chunk that ends inside a block; its workload shares prefixes."""
    from kvchaos.faults import REGISTRY

    cache, bs = engine["cache"], engine["cache"]["block_size"]
    cache["prefix_caching"] = True
    if fault["params"]["variant"] == "partial_key" and engine["max_prefill_tokens"] % bs == 0:
        engine["max_prefill_tokens"] += 1
    need = REGISTRY["prefix_cache"].row_tokens(fault["params"], bs, engine["max_prefill_tokens"])
    cache["max_blocks_per_seq"] = max(cache["max_blocks_per_seq"], -(-need // bs))
    cache["num_blocks"] = max(cache["num_blocks"], 3 * cache["max_blocks_per_seq"])
    if "cancel" not in workload:  # a staging-stall workload stays as it is
        return
    cap = cache["max_blocks_per_seq"] * bs
    shared = max(1, min(24, cap // 4))
    out = workload["output_len"]
    out["max"] = max(out["min"], min(out["max"], cap - workload["prompt_len"]["max"] - shared))
    workload["prefix"] = {
        "groups": 2,
        "prefix_len": {"dist": "uniform", "min": 1, "max": shared},
        "share": 0.7,
    }
