"""A snapshot's prefix cache as the history holds it: each snapshot event stores its change since
the one before (cache_added, cache_removed, cache_n), and apply_cache rebuilds it."""

from __future__ import annotations

_CACHE_SHAPE = (
    "cache (optional) is not a list of {block (in the pool), key (text), parent (text or null), "
    "tokens (ints or null)} entries"
)


def _entry_ok(e, n) -> bool:
    return (
        isinstance(e, dict)
        and ints_in([e.get("block")], 0, n)
        and isinstance(e.get("key"), str)
        and (e.get("parent") is None or isinstance(e["parent"], str))
        and (e.get("tokens") is None or ints_in(e["tokens"], 0, None))
    )


def ints_in(xs, lo: int, hi: int | None) -> bool:
    """A list of ints (bools are not) in [lo, hi): checked at C speed, every step's table."""
    if not isinstance(xs, list):
        return False
    if not xs:
        return True
    return set(map(type, xs)) == {int} and min(xs) >= lo and (hi is None or max(xs) < hi)


def cache_delta(prev: dict, cache: list[dict], n: int | None = None):
    """A snapshot's cache as a history event holds it: what changed since the previous snapshot
    event (a cache of hundreds of entries, whole in every step's event, would swamp the history).
    Returns (the event's fields, the state to diff the next one against, the problem: the shape
    of an entry new or changed since prev ({block, key, parent, tokens}, its block in [0, n)), or
    an entry listed twice; the fields and state are None then). An entry equal to the one prev
    holds for its (block, key) passed before: a cache of hundreds of entries, most unchanged
    from step to step, costs a comparison each."""
    if not isinstance(cache, list):
        return None, None, _CACHE_SHAPE
    known = list(prev.values())
    if cache[: len(known)] == known:  # as before, entry for entry (a step that keyed nothing)
        if len(cache) == len(known):
            return {"cache_added": [], "cache_removed": [], "cache_n": len(prev)}, prev, None
        now, fresh = dict(prev), cache[len(known) :]  # ... and new entries after them
    else:
        now, fresh = {}, cache
    added = []
    for e in fresh:
        try:
            k = (e["block"], e["key"])
            kept = prev.get(k)
        except (KeyError, TypeError):  # not a dict, one without a block or key, unhashable
            return None, None, _CACHE_SHAPE
        if kept is None or type(e) is not dict or kept != e:  # new, or changed under its key
            if not _entry_ok(e, n):
                return None, None, _CACHE_SHAPE
            tokens = e.get("tokens")  # the harness's own copy
            kept = {**e, "tokens": None if tokens is None else list(tokens)}
            added.append(kept)
        if k in now:
            return None, None, "cache (optional) lists an entry twice"
        now[k] = kept
    removed = [list(k) for k in prev if k not in now] if fresh is cache else []
    return {"cache_added": added, "cache_removed": removed, "cache_n": len(now)}, now, None


def apply_cache(state: dict, event: dict) -> dict:
    """The cache a snapshot event stands for ((block, key) -> entry), from the one before it."""
    if "cache" in event:  # whole (a snapshot outside a history)
        return {(e["block"], e["key"]): e for e in event["cache"]}
    for b, k in event.get("cache_removed", ()):
        state.pop((b, k), None)
    for e in event.get("cache_added", ()):
        state[(e["block"], e["key"])] = e
    return state
