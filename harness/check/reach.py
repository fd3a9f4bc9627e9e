"""Reach: the manager path each fault variant's trigger needs, as keys of results.json
["exercised"] (harness/check/exercised.py), so a clean run on any manager can say whether its
trigger reached the path the variant breaks. A path is a key, a dotted key into a nested count
("leak_paths.cancels"), or alternatives "a|b" (either counts: the remediations of one trigger);
a variant reaches when every one of its paths counts > 0. No paths: the variant plants on an
engine seam that no manager call reaches (the staging buffer of the table upload).

scripts/reach-table.py runs each clean scenario and prints this as a table (docs/reach.md)."""

from __future__ import annotations

from kvchaos.faults.ordering_variants import REACH as ORDERING

REACH: dict[str, dict[str, tuple[str, ...]]] = {
    "table_overflow": {
        "unchecked": ("full_rows", "overlong_rejections|resizes"),
        "article": ("overlong_rejections|resizes",),
        "off_by_one": ("full_rows", "overlong_rejections"),
        "floor_width": ("full_rows",),
        "stride_mismatch": ("resizes", "rows_after_resize"),
        "last_row": ("last_row_holds", "resizes"),
        "chunked_growth": ("multi_block_growths", "full_rows", "overlong_rejections"),
        "slot_past_pool": ("last_block_holds", "preemption_releases"),  # the pool ran dry
        "kernel_block_size": ("block_boundary_crossings",),  # contexts read across blocks
    },
    "refcount_leak": {
        "any": ("leak_paths.cancels",),
        "prefill": ("cancels_prefill",),
        "decode": ("cancels_decode",),
        "shared": ("leak_paths.frees_all_shared",),
        "partial": ("leak_paths.frees_partly_shared",),
        "preempted": ("preemption_releases",),
        "retry": ("leak_paths.cancels_after_refused_admission",),
        "rate": ("leak_paths.cancels",),
        "waiting": ("leak_paths.cancels_waiting_holding",),
        "engine_abort": ("leak_paths.engine_aborts",),
    },
    "staging_stall": {"ramp": (), "from_start": (), "bursts": ()},
    "ordering_race": {v: (p,) for v, p in ORDERING.items()},
    "prefix_cache": {  # hits served (slots read that another request wrote), and their shapes
        "partial_key": ("prefix_shapes.prefill_aborts", "shared_kv_reads"),
        "weak_key": ("shared_kv_reads",),
        "evict_referenced": ("shared_kv_reads",),
        "stale_revive": ("shared_kv_reads",),
    },
    "async_free": {  # a release while the step in flight wrote the blocks, by exit
        "finish": ("frees",),
        "abort": ("cancels_decode|cancels_prefill",),
        "preempt": ("preemption_releases",),
        "staging": ("block_boundary_crossings",),  # rows past the first change between uploads
        "load_abort": ("offload.restores", "leak_paths.cancels"),  # a cancel during a restore
    },
    "offload": {  # the host tier's stores and restores (exercised.offload)
        "store_before_compute": ("offload.fences",),  # stores that waited for the step in flight
        "restore_race": ("offload.restores",),
        "stale_host": ("offload.stores_cold", "offload.restores"),
        "host_slot_freed": ("offload.restores",),
    },
}


def count(exercised: dict, path: str) -> int | None:
    """The count at one path (alternatives summed); None: the run has no such count."""
    total, found = 0, False
    for alt in path.split("|"):
        v = exercised
        for k in alt.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, int):
            total, found = total + v, True
    return total if found else None


def reached(exercised: dict, paths: tuple[str, ...]) -> bool | None:
    """Every path counts > 0; None where the variant has no manager path."""
    if not paths:
        return None
    return all((count(exercised, p) or 0) > 0 for p in paths)
