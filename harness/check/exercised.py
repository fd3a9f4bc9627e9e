"""What a run exercised of the block manager: a PASS on a manager whose fork path never ran must
say so. Read from the history alone (a stored run gives the same table)."""

from __future__ import annotations

from kvchaos.harness.check.shapes import prefix_shapes

PHASES = ("waiting", "prefill", "decode", "preempted", "shared")
NEEDS_FORK = ("fork_calls", "copy_on_write_copies", "frees_of_shared_blocks")
# The table's edges a run reached (what the table_overflow variants break): counted, never "not
# exercised" (most workloads stay inside their rows, as they should)
TABLE_EDGES = (
    "full_rows",  # sequences whose blocks filled their row to its last entry
    "last_row_holds",  # sequences that held the table's last row
    "multi_block_growths",  # a held sequence grown by 2+ blocks at once (a prefill chunk)
    "rows_after_resize",  # sequences in a row past the first once the table grew wider
    "overlong_rejections",  # requests over a row refused at admission (429-style)
    "last_block_holds",  # sequences that held the pool's last block (num_blocks - 1)
)


def exercised(events: list[dict]) -> dict:
    """Path -> how often it ran; "not exercised" lists the paths that never did."""
    end = next((e for e in reversed(events) if e.get("e") == "run_end"), {})
    counters, calls = end.get("counters", {}), end.get("manager_calls", {})
    cancels = [e for e in events if e.get("e") == "cancel"]
    crossings = row_reuses = 0
    seen_blocks: dict[str, int] = {}
    row_owner: dict[int, str] = {}
    last_blocks = last_rows = None
    edges = {k: 0 for k in TABLE_EDGES}
    full: set[str] = set()
    last_row: set[str] = set()
    last_block: set[str] = set()
    after_resize: set[str] = set()
    first_width = None
    for e in events:
        if e.get("e") != "snapshot":
            continue
        w = e["table_width"]
        first_width = w if first_width is None else first_width
        if e["seq_blocks"] is not last_blocks or e["seq_rows"] is not last_rows:
            _edges(
                e, seen_blocks, (full, last_row, last_block), after_resize, w > first_width, edges
            )
        if e["seq_blocks"] is not last_blocks:  # not the very object counted before
            last_blocks = e["seq_blocks"]
            for seq, blocks in last_blocks.items():
                crossings += max(0, len(blocks) - seen_blocks.get(seq, 0))
                seen_blocks[seq] = len(blocks)
        if e["seq_rows"] is not last_rows:
            last_rows = e["seq_rows"]
            for seq, row in last_rows.items():
                if row_owner.get(row, seq) != seq:
                    row_reuses += 1
                row_owner[row] = seq
    edges.update(
        full_rows=len(full), last_row_holds=len(last_row), last_block_holds=len(last_block)
    )
    edges.update(rows_after_resize=len(after_resize))
    edges["overlong_rejections"] = counters.get("overlong_rejected", 0)
    forks = sum(1 for e in events if e.get("e") == "submit" and e.get("parent"))
    paths = {
        "appends": calls.get("append", 0) + calls.get("append_decode", 0),
        "block_boundary_crossings": crossings,
        "forks": forks,
        "fork_calls": calls.get("fork", 0),
        "copy_on_write_copies": counters.get("cow_copies", 0),
        "frees": calls.get("free", 0) + calls.get("release", 0),  # free: histories from v1
        "frees_of_shared_blocks": sum(1 for c in cancels if c.get("shared")),
        **{f"cancels_{p}": sum(1 for c in cancels if c.get("phase") == p) for p in PHASES[:4]},
        "preemption_releases": counters.get("preemptions", 0),
        "refusals": counters.get("refusals", 0),
        "refusals_with_room": counters.get("refusals_with_room", 0),
        "resizes": counters.get("table_resizes", 0),
        "row_reuses": row_reuses,
        **edges,
    }
    if any(e.get("e") == "kv_record" for e in events):  # the writer record judged reads
        # slots read that another request wrote (a cache hit, a fork): kv_reads judged sharing
        paths["shared_kv_reads"] = end.get("kv_record", {}).get("shared_slots", 0)
    start = next((e for e in events if e.get("e") == "run_start"), {})
    caps = set(start.get("capabilities", ["fork"]))
    lacking = [] if "fork" in caps else list(NEEDS_FORK)  # not applicable, never "missed"
    paths["not_exercised"] = [
        k
        for k, v in paths.items()
        if v == 0 and not k.startswith("refus") and k not in lacking and k not in TABLE_EDGES
    ]
    offload = start.get("config", {}).get("offload")
    if offload is not None and "offload" not in caps:  # a tier asked of a manager without one
        lacking = [*lacking, "offload"]
    paths["not_applicable"] = lacking
    if "offload_stores" in counters:  # the host tier's paths (engine/offload.py)
        paths["offload"] = offload_paths(events, counters)
    # the paths the refcount_leak variants break, and (with a prefix cache) the shapes prefix
    # cache bugs need: counts, never "not exercised" (most runs need none of them)
    paths["leak_paths"] = leak_paths(events)
    if "shared_kv_reads" in paths:
        cc = start.get("config", {}).get("cache", {})
        if cc.get("block_size") and cc.get("num_blocks"):
            paths["prefix_shapes"] = prefix_shapes(events, cc["block_size"], cc["num_blocks"])
    return paths


def offload_paths(events: list[dict], counters: dict) -> dict[str, int]:
    """Stores by cause (cold, preempt), restores, stores that waited for the step in flight,
    the peak host slots in use, and prefix hits loaded from the host tier (the tier's own counts
    and events)."""
    out = {"stores_cold": 0, "stores_preempt": 0, "host_peak": 0}
    for e in events:
        if e.get("e") != "engine":
            continue
        if e["kind"] == "offload_store":
            out[f"stores_{e['data']['why']}"] += 1
        elif e["kind"] == "offload_tier":
            out["host_peak"] = max(out["host_peak"], e["data"]["host_used"])
    out["restores"] = counters.get("offload_restores", 0)
    out["fences"] = counters.get("offload_fences", 0)
    if "offload_hit_loads" in counters:  # a prefix cache: hits loaded from the host tier
        out["hit_loads"] = counters["offload_hit_loads"]
    return out


def leak_paths(events: list[dict]) -> dict[str, int]:
    """Cancels per phase (prefill, decode, waiting after a refused admission, waiting holding
    blocks, preempted), frees of shared blocks (all shared, or shared and private: partial),
    preemption releases, the cancels in all (rate), and the requests the engine itself ended in
    error in a step (engine_abort)."""
    refused: set[str] = set()
    last_held: dict | None = None  # the latest snapshot's seq_blocks
    out = dict.fromkeys(
        (
            "cancels",
            "cancels_after_refused_admission",
            "cancels_waiting_holding",
            "frees_all_shared",
            "frees_partly_shared",
            "engine_aborts",
        ),
        0,
    )
    for e in events:
        kind = e.get("e")
        if kind == "snapshot":
            last_held = e["seq_blocks"]
        elif kind == "step":
            out["engine_aborts"] += len(e.get("failed", ()))
        elif kind == "engine" and e.get("kind") == "refusal" and e["data"]["call"] == "admit":
            refused.add(e["data"]["seq"])
        elif kind == "cancel":
            out["cancels"] += 1
            out["cancels_after_refused_admission"] += e["req"] in refused
            out["cancels_waiting_holding"] += e.get("phase") == "waiting" and bool(e.get("blocks"))
            if e.get("shared") and last_held is not None:  # held by no one else: private
                others = {b for s, bs in last_held.items() if s != e["req"] for b in bs}
                private = any(b not in others for b in e.get("blocks", ()))
                out["frees_partly_shared" if private else "frees_all_shared"] += 1
    end = next((e for e in reversed(events) if e.get("e") == "run_end"), {})
    out["preemption_releases"] = end.get("counters", {}).get("preemptions", 0)
    return out


def _edges(e, seen_blocks, held: tuple, after_resize, resized: bool, edges: dict) -> None:
    """One snapshot's table edges (before seen_blocks takes its block counts); held: the sets of
    sequences that filled a row, held the last row, held the pool's last block."""
    full, last_row, last_block = held
    w, rows = e["table_width"], len(e["table"]) // max(1, e["table_width"])
    top = e.get("num_blocks", 0) - 1
    for seq, blocks in e["seq_blocks"].items():
        before = seen_blocks.get(seq, 0)
        edges["multi_block_growths"] += before > 0 and len(blocks) - before >= 2
        if len(blocks) >= w:
            full.add(seq)
        if top in blocks:
            last_block.add(seq)
    for seq, row in e["seq_rows"].items():
        if row == rows - 1:
            last_row.add(seq)
        if resized and row > 0:
            after_resize.add(seq)
