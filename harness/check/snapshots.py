"""A block manager's snapshot is its word about itself: checked, as it is taken, against its own
shape and against what the harness itself knows (the pool it configured, the manager's counts,
the tokens the engine computed for each live request). A snapshot that fails is not handed to
the checkers; its problem becomes a finding against the manager."""

from __future__ import annotations

from itertools import chain

from kvchaos.harness.history.cache import cache_delta, ints_in


def judge(snap, engine, num_blocks: int, passed: dict | None = None):
    """judge_seen() against an engine: what its manager says and what it computed."""
    computed = [(s.id, s.num_computed, len(s.tokens)) for s in engine.scheduler.running]
    free = engine.bm.num_free_blocks
    return judge_seen(snap, num_blocks, free, engine.bm.block_size, computed, passed)


def problem_seen(
    snap, num_blocks: int, free_count: int, block_size: int, computed, passed=None
) -> str | None:
    """What is wrong with a snapshot against what a harness saw, or None: see judge_seen."""
    return judge_seen(snap, num_blocks, free_count, block_size, computed, passed)[0]


def judge_seen(snap, num_blocks: int, free_count: int, block_size: int, computed, passed=None):
    """(problem, fields, cache): a snapshot checked against what a harness saw: the pool it
    configured, the manager's free count, and for each live sequence (id, tokens computed,
    tokens it has). passed: the fields of the last snapshot that passed (its cache as
    cache_delta keeps it): a field equal to its value there is not checked for shape again
    (most of a snapshot is as it was a step before), unless it is the very same object, which
    its manager may have changed since. What the harness saw is checked every time.
    fields: the snapshot's, its cache (when it shows one) as cache_delta's change since passed;
    cache: the cache state to diff the next snapshot against (None without a cache)."""
    try:
        d = snap.to_dict()
    except Exception as e:  # not a Snapshot at all
        return f"snapshot() returned {type(snap).__name__}, not a Snapshot ({e})", None, None
    passed = passed or {}
    cache = d.pop("cache", None)
    delta, state, wrong = (
        cache_delta(passed.get("cache") or {}, cache, num_blocks)
        if cache is not None
        else ({}, None, None)
    )
    wrong = _problem(d, num_blocks, free_count, block_size, computed, passed) or wrong
    if wrong:
        return wrong, None, None
    d.update(delta)
    return None, d, state


def _problem(d: dict, num_blocks: int, free_count: int, block_size: int, computed, passed):
    def same(field: str) -> bool:
        """Equal to the field that passed: the event takes that very object (a history's
        unchanged fields are shared, and checkers skip what is the same object as before)."""
        now, was = d.get(field), passed.get(field)
        if now is not was and now == was:
            d[field] = was
            return True
        return False

    n, free, refs = d.get("num_blocks"), d.get("free"), d.get("ref_counts")
    if n != num_blocks:
        return f"num_blocks is {n!r}, the pool was configured with {num_blocks}"
    if not same("free") and (not ints_in(free, 0, n) or len(set(free)) != len(free)):
        return "free is not a list of distinct block ids in the pool"
    if not same("ref_counts") and (not ints_in(refs, 0, None) or len(refs) != n):
        return f"ref_counts is not {n} non-negative ints"
    blocks, rows = d.get("seq_blocks"), d.get("seq_rows")
    if not same("seq_blocks") and (
        not isinstance(blocks, dict)
        or set(map(type, blocks)) - {str}
        or set(map(type, blocks.values())) - {list}
        or not ints_in(list(chain.from_iterable(blocks.values())), 0, n)
    ):
        return "seq_blocks does not map sequence ids to block ids in the pool"
    table, width = d.get("table"), d.get("table_width")
    table_same = same("table") and width == passed.get("table_width")
    if not table_same:
        if not isinstance(width, int) or width < 1 or not ints_in(table, -1, n):
            return "table is not a list of block ids (or -1) with a positive table_width"
        if len(table) % width:
            return f"table has {len(table)} entries, not a multiple of its width {width}"
    nrows = len(table) // width
    if not (table_same and same("seq_rows")) and (
        not isinstance(rows, dict) or not ints_in(list(rows.values()), 0, nrows)
    ):
        return f"seq_rows does not map sequences to rows in [0, {nrows})"
    toks = d.get("seq_tokens")
    if (
        toks is not None
        and not same("seq_tokens")
        and not (isinstance(toks, dict) and ints_in(list(toks.values()), 0, None))
    ):
        return "seq_tokens (optional) does not map sequences to token counts"
    reserved = d.get("reserved")
    if reserved is not None and not same("reserved") and not ints_in(reserved, 0, n):
        return "reserved (optional) is not a list of block ids in the pool"
    if free_count != len(free):
        return f"num_free_blocks says {free_count}, the snapshot lists {len(free)} free blocks"
    for seq, done, total in computed:  # every token computed has a slot the snapshot lists
        have = len(blocks.get(seq, ())) * block_size
        if done > have:
            return (
                f"sequence {seq} has {done} tokens computed, the snapshot lists blocks for {have}"
            )
        n = (toks or {}).get(seq)
        if n is not None and not done <= n <= total:
            return (
                f"sequence {seq} has slots for {n} tokens by its snapshot; the engine has "
                f"computed {done} of its {total}"
            )
    return None
