"""Prefix-cache benchmark: reviving a cached free block from the middle of the free queue, on a
1M-block pool against a 1k-block pool, for PrefixBlockPool's intrusive linked list and for
nano-vllm's free_block_ids deque (its cache hit calls deque.remove). O(1) shows as a 1M/1k ratio
near 1 (what remains is memory locality); O(pool) as a ratio near 1000."""

from __future__ import annotations

import random
from collections import deque

from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.harness.bench.timing import NoGC, perf, round_robin


def middle_ids(n: int, count: int) -> list[int]:
    """count distinct block ids spread evenly over the middle half of 0..n-1, in a fixed shuffled
    order (spread, so that a large pool's revives do not share cache lines)."""
    lo, span = n // 4, n // 2
    if count > span:
        raise ValueError(f"{count} revives need a pool of at least {2 * count} blocks, not {n}")
    ids = [lo + i * span // count for i in range(count)]
    random.Random(n).shuffle(ids)
    return ids


def _pool_with_cached(n: int, ids: list[int]) -> PrefixBlockPool:
    """A free n-block pool, queue 0..n-1 in order, where the blocks `ids` hold a cached prefix."""
    pool = PrefixBlockPool(n, 1)
    for _ in range(n):
        pool.allocate()
    for b in ids:
        pool.cache_full_block(b, None, (b,))
    for b in range(n):
        pool.free(b)
    return pool


def bench_revive_scale(
    repeats: int,
    per_round: int = 32,
    deque_per_round: int = 4,
    small: int = 1_000,
    large: int = 1_000_000,
) -> dict[str, float]:
    """Nanoseconds per revive of a cached free block from the middle of the free queue: `pool_N`
    (PrefixBlockPool.touch) and `deque_N` (deque.remove, as nano-vllm's _allocate_block), for
    N in (small, large). Every round revives blocks not revived before, so each still sits in the
    middle, then frees them (untimed) to the tail. Each structure's two sizes share a rotation,
    apart from the other's: a deque scan of 1M ids would flush the caches the small pool lives in
    and hide part of what locality costs the large one."""
    pool_fns, deque_fns = {}, {}
    whole = []
    for n in (small, large):
        ids = middle_ids(n, repeats * per_round)
        pool = _pool_with_cached(n, ids)
        free_ids = deque(range(n))
        pool_fns[f"pool_{n}"] = _pool_rounds(pool, ids, per_round)
        deque_fns[f"deque_{n}"] = _deque_rounds(free_ids, ids, deque_per_round)
        whole.append((n, pool, free_ids))
    with NoGC():
        med = round_robin(pool_fns, repeats) | round_robin(deque_fns, repeats)
    for n, pool, free_ids in whole:
        assert pool.num_free == n and len(free_ids) == n, "a revived block was not given back"
    return med


def _pool_rounds(pool: PrefixBlockPool, ids: list[int], k: int):
    chunks = iter([ids[i : i + k] for i in range(0, len(ids), k)])

    def run() -> float:
        chunk = next(chunks)
        touch = pool.touch
        t = perf()
        for b in chunk:
            touch(b)
        dt = perf() - t
        assert pool.ref[chunk[0]] == 1 and pool.key[chunk[0]] is not None
        for b in chunk:
            pool.free(b)
        return dt / len(chunk) * 1e9

    return run


def _deque_rounds(free_ids: deque, ids: list[int], k: int):
    chunks = iter([ids[i : i + k] for i in range(0, len(ids), k)])

    def run() -> float:
        chunk = next(chunks)
        remove = free_ids.remove
        t = perf()
        for b in chunk:
            remove(b)
        dt = perf() - t
        free_ids.extend(chunk)
        return dt / len(chunk) * 1e9

    return run
