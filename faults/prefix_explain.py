"""What the prefix_cache fault explains (faults/prefix_cache.py's explains): pure over a finding
and the fault's ground truth (its wrong hits, blocks handed on while held, bad entries, the blocks
a victim keyed after its wrong read, poisoned requests)."""

from __future__ import annotations


def explains(finding: dict, truth: dict) -> str | None:
    """What prefix_cache's ground truth explains of a finding: "cause", "consequence" or None."""
    s, ev, kind = finding["step"], finding.get("evidence") or {}, finding.get("kind")
    checker = finding.get("checker")
    read = wrong_reads(truth, s)  # victim -> blocks it was served wrong, by step s
    if checker == "kv_reads":
        if kind in ("wrong_read", "unwritten_read"):
            if ev.get("block") in read.get(ev.get("req"), ()):
                return "cause"
            # the taker's KV, written over the victim's block once handed: the record
            # follows it where a host tier's store and restore carried it since
            return "cause" if _taker_read(truth, ev, s) else None
        return "consequence" if kind == "poisoned_read" and ev.get("origin") in read else None
    if checker == "oracle_divergence" and kind == "divergence":
        if ev.get("req") in read:
            return "cause"
        poisoned = {p["req"] for p in truth.get("poisoned", []) if p["step"] <= s}
        return "consequence" if ev.get("req") in poisoned else None
    if checker == "prefix_cache" and kind == "cache_content":
        bad = {x["block"] for x in truth.get("bad_entries", ()) if x["step"] <= s}
        if ev.get("block") in bad:
            return "cause"
        # a block a victim keyed over KV it computed after its wrong read, or one whose
        # parent is a bad entry (it does not continue that block's wrong KV)
        tainted = {x["block"] for x in truth.get("tainted_blocks", ()) if x["step"] <= s}
        wrong_parent = ev.get("parent_block") in bad | tainted
        if ev.get("block") in tainted or wrong_parent or _restored_taker_kv(truth, ev, s):
            return "consequence"
        return None
    if checker == "prefix_cache" and kind == "hit_blocks":
        return "cause" if ev.get("req") in read else None
    if checker == "block_accounting":
        queued = [x["block"] for x in truth.get("revived_queued", []) if x["step"] <= s]
        handed = [x["block"] for x in truth.get("evicted_held", []) if x["step"] <= s]
        if kind == "conservation":  # a held block still queued counts free and referenced
            excess = ev.get("free", 0) + ev.get("referenced", 0) - ev.get("total", 0)
            return "cause" if 0 < excess <= len(queued) else None
        named = set(ev.get("blocks") or ()) | ({ev["block"]} if "block" in ev else set())
        if kind in ("free_referenced", "refcount", "shared_write"):
            return "cause" if named and named <= set(queued) | set(handed) else None
    return None


def _taker_read(truth: dict, ev: dict, step: int) -> bool:
    """ev's reader held a block allocate handed to another request, and read KV that taker
    wrote from then on (the writer record's writer and writer_step)."""
    w, at, req = ev.get("writer"), ev.get("writer_step"), ev.get("req")
    if w is None or at is None:
        return False
    return any(
        x["step"] <= min(at, step) and x.get("taker") == w and req in x["holders"]
        for x in truth.get("evicted_held", [])
    )


def _restored_taker_kv(truth: dict, ev: dict, step: int) -> bool:
    """ev's block is one a victim's restore copied in from its host copy of a block allocate
    handed on while it held it (a wrong hit "restored"), and the restore's keying named it by
    the victim's tokens: it holds the KV that block's taker wrote over it."""
    b, writers = ev.get("block"), set(ev.get("writers") or ())
    victims = {
        x["req"]
        for x in truth.get("wrong_hits", [])
        if x.get("why") == "restored" and x["step"] <= step and b in x["blocks"]
    }
    return bool(victims) and any(
        x["step"] <= step and x.get("taker") in writers and victims & set(x["holders"])
        for x in truth.get("evicted_held", [])
    )


def wrong_reads(truth: dict, step: int) -> dict[str, set[int]]:
    """Each request served wrong KV at or before step: the blocks (its wrong hits' blocks, or a
    block it held that allocate handed to another request)."""
    out: dict[str, set[int]] = {}
    for x in truth.get("wrong_hits", []):
        if x["step"] <= step:
            out.setdefault(x["req"], set()).update(x["blocks"])
    for x in truth.get("evicted_held", []):
        if x["step"] <= step:
            for h in x["holders"]:
                out.setdefault(h, set()).add(x["block"])
    return out
