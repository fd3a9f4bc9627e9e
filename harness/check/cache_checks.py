"""Checkers of what a prefix cache served (docs/protocol-v2.md sections 3 and 4). `kv_reads`: the
per-block writer record's kv_read events (harness/run/kv_record.py) become findings that name
the request whose attention READ the wrong KV, the block, its writer and the hit that served it.
A holder that never read the slot is named nowhere."""

from __future__ import annotations

from kvchaos.harness.check.findings import CheckResult, Finding, judged_result


def read_kind(e: dict) -> str:
    """A kv_read event's kind: its first failing slot never written, computed from a wrong read
    (same identity, tainted), or written for other tokens."""
    if e.get("writer") is None:
        return "unwritten_read"
    return "poisoned_read" if e.get("origin") is not None else "wrong_read"


def _span(pos: list[int]) -> str:
    if not pos:
        return "?"
    if pos == list(range(pos[0], pos[-1] + 1)):
        return str(pos[0]) if len(pos) == 1 else f"{pos[0]}..{pos[-1]}"
    return ", ".join(map(str, pos[:8])) + (" ..." if len(pos) > 8 else "")


def _message(e: dict, kind: str, hit: tuple[int, dict] | None) -> str:
    req, w = e["req"], e.get("writer")
    where = f"its hit from step {hit[0]}" if e.get("via_hit") and hit else f"entry {e['index']}"
    rank = f" on rank {e['rank']}" if e.get("rank") else ""
    head = f"request {req} read block {e['block']} ({where}) at positions {_span(e['pos'])}{rank}"
    if kind == "unwritten_read":
        return f"{head}; no KV was ever written there"
    who = f"{w} itself" if w == req else w
    at = f"at step {e['writer_step']}"
    if e.get("torn"):
        return f"{head}; that KV was written by {who} {at}, a step that failed (content unknown)"
    if kind == "poisoned_read":
        return (
            f"{head}; that KV was written by {who} {at} after a wrong read by request "
            f"{e['origin']}: computed from wrong KV (poisoned)"
        )
    same = e.get("pos") and e.get("writer_pos") == e["pos"][0]
    other = "for other tokens" if same else f"for position {e['writer_pos']}"
    return f"{head}; that KV was written by {who} {other} {at}"


EVIDENCE = (
    "req",
    "rank",
    "index",
    "block",
    "slots",
    "pos",
    "writer",
    "writer_pos",
    "writer_step",
    "via_hit",
    "origin",
)


def check_kv_reads(events: list[dict]) -> CheckResult:
    """Every position a request's attention read holds KV for its own prefix: the per-block writer
    record's verdict, read by read. Not judged when the record was off (no kv_record event: the
    manager offers no prefix cache) or nothing was computed."""
    on, steps, found = False, 0, []
    hits: dict[str, tuple[int, dict]] = {}  # req -> (step, data) of its latest cache hit
    for e in events:
        kind = e.get("e")
        if kind == "kv_record":
            on = True
        elif kind == "engine" and e.get("kind") == "hit":
            hits[e["data"]["req"]] = (e["step"], e["data"])
        elif kind == "step" and on and (e.get("prefill_tokens") or e.get("decode_tokens")):
            steps += 1
        elif kind == "kv_read":
            k, hit = read_kind(e), hits.get(e["req"])
            evidence = {f: e.get(f) for f in EVIDENCE}
            if hit is not None:
                evidence["hit_step"], evidence["hit_blocks"] = hit[0], hit[1].get("blocks")
            found.append(
                Finding(
                    checker="kv_reads",
                    step=e["step"],
                    message=_message(e, k, hit),
                    evidence=evidence,
                    manifest=None,
                    kind=k,
                )
            )
    return judged_result("kv_reads", found, steps)


CACHE_PROBLEMS = {
    "partial": "holds slots never written (keyed before its KV was computed)",
    "tokens": "holds KV of other tokens than its key's",
    "chain": "holds slots of different prefixes (not one chain of tokens)",
    "parent": "does not continue the block its parent key names",
}
HIT_PROBLEMS = {
    "not_cached": "is not in the cache",
    "tokens": "is cached over other tokens than the request's",
    "parent": "is cached after another parent than the block served before it",
}


def check_prefix_cache(events: list[dict]) -> CheckResult:
    """The manager's word about its cache against what was written: each cached block's contents
    match its key (cache_content), each hit served the blocks its keys name (hit_blocks). Not
    judged without cache state in the snapshots (the manager does not show its cache)."""
    on, judged, found = False, 0, []
    for e in events:
        kind = e.get("e")
        if kind == "kv_record":
            on = True
        elif kind == "snapshot" and on and ("cache_n" in e or "cache" in e):
            judged += 1
        elif kind == "cache_mismatch":
            who = ", ".join(e["writers"][:4]) or "nobody"
            msg = (
                f"cached block {e['block']} (key {str(e['key'])[:16]}) "
                f"{CACHE_PROBLEMS[e['problem']]}; {e['written']} slots written, by {who}"
            )
            evidence = {
                k: e.get(k)
                for k in ("block", "key", "problem", "writers", "written", "parent_block")
                if k in e
            }
            found.append(
                Finding(
                    checker="prefix_cache",
                    step=e["step"],
                    message=msg,
                    evidence=evidence,
                    manifest=None,
                    kind="cache_content",
                )
            )
        elif kind == "hit_mismatch":
            msg = (
                f"request {e['req']}'s cache hit served block {e['block']} as its block "
                f"{e['index']}, which {HIT_PROBLEMS[e['problem']]}"
            )
            evidence = {k: e.get(k) for k in ("req", "block", "index", "problem")}
            found.append(
                Finding(
                    checker="prefix_cache",
                    step=e["step"],
                    message=msg,
                    evidence=evidence,
                    manifest=None,
                    kind="hit_blocks",
                )
            )
    return judged_result("prefix_cache", found, judged)
