"""kvchaos.engine.block_pool.PrefixBlockPool: allocation order, LRU eviction of cached free blocks,
revive from the middle of the free queue, ref counts, the prefix match and its collision guard, a
revive touching the same number of queue nodes at 1k, 100k and 1M blocks, and a Hypothesis state
machine against a plain model with check() as its invariant."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchaos.engine.block_pool import PrefixBlockPool, chain_hash
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.harness.bench.prefix import bench_revive_scale, middle_ids


def fill(pool: PrefixBlockPool, token_ids: list[int]) -> list[int]:
    """Allocate and cache the full blocks of token_ids, as a request's prefill would."""
    blocks, key, bs = [], None, pool.block_size
    for i in range(0, len(token_ids) - bs + 1, bs):
        b = pool.allocate()
        key = pool.cache_full_block(b, key, token_ids[i : i + bs])
        blocks.append(b)
    return blocks


# -- allocation, free queue, ref counts ---------------------------------------------------------
def test_allocation_order_is_lru_and_double_free_refused():
    pool = PrefixBlockPool(4, 2)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.free(1)
    pool.free(0)
    assert pool.free_order() == [3, 1, 0]  # never used first, then in the order freed
    assert [pool.allocate() for _ in range(3)] == [3, 1, 0]
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    pool.free(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free(2)
    pool.check()


def test_eviction_is_lru_over_freed_cached_blocks():
    pool = PrefixBlockPool(3, 1)
    keys = [pool.cache_full_block(pool.allocate(), None, [t]) for t in (10, 11, 12)]
    for b in (2, 0, 1):  # freed in this order: still cached, evicted in this order
        pool.free(b)
    assert [pool.cached(k) for k in keys] == [0, 1, 2]
    assert pool.allocate() == 2 and pool.cached(keys[2]) is None
    assert pool.key[2] is None and pool.tokens[2] is None
    assert pool.cached(keys[0]) == 0 and pool.cached(keys[1]) == 1
    assert pool.allocate() == 0 and pool.cached(keys[0]) is None
    pool.check()


def test_revive_from_the_middle_and_ref_counts():
    pool = PrefixBlockPool(5, 1)
    held = [pool.allocate() for _ in range(5)]
    key = pool.cache_full_block(2, None, [7])
    for b in held:
        pool.free(b)
    assert pool.free_order() == [0, 1, 2, 3, 4]
    pool.touch(2)  # revived from the middle, its KV reused
    assert pool.free_order() == [0, 1, 3, 4] and pool.ref[2] == 1 and pool.cached(key) == 2
    pool.touch(2)  # a second request shares it
    assert pool.ref[2] == 2
    pool.free(2)
    assert pool.ref[2] == 1 and 2 not in pool.free_order()
    pool.free(2)
    assert pool.free_order() == [0, 1, 3, 4, 2] and pool.cached(key) == 2  # MRU now
    with pytest.raises(ValueError, match="no cached prefix"):
        pool.touch(3)  # free and uncached: its KV is garbage
    pool.check()


def test_cache_full_block_refuses_partial_free_and_rekeyed_blocks():
    pool = PrefixBlockPool(3, 2)
    b = pool.allocate()
    with pytest.raises(ValueError, match="a full block has 2"):
        pool.cache_full_block(b, None, [1])
    k = pool.cache_full_block(b, None, [1, 2])
    assert pool.cache_full_block(b, None, [1, 2]) == k  # idempotent
    with pytest.raises(ValueError, match="another key"):
        pool.cache_full_block(b, None, [3, 4])
    with pytest.raises(ValueError, match="free block 1"):
        pool.cache_full_block(1, None, [1, 2])
    pool.check()


def test_a_duplicate_block_stays_uncached_and_the_first_keeps_the_key():
    pool = PrefixBlockPool(4, 2)
    first = fill(pool, [1, 2, 3, 4])
    second = fill(pool, [1, 2, 3, 4])  # computed concurrently: both missed
    assert [pool.key[b] for b in second] == [None, None]
    assert pool.match_prefix([1, 2, 3, 4]) == first
    pool.check()


# -- prefix match -------------------------------------------------------------------------------
def test_match_prefix_finds_the_longest_cached_prefix_of_full_blocks():
    pool = PrefixBlockPool(8, 2)
    a = fill(pool, [1, 2, 3, 4, 5, 6])
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7]) == a  # the partial block is not matched
    assert pool.match_prefix([1, 2, 3, 4, 9, 9]) == a[:2]
    assert pool.match_prefix([1, 2, 3]) == a[:1]
    assert pool.match_prefix([3, 4, 5, 6]) == []  # same tokens, another prefix: another key
    assert pool.match_prefix([1]) == [] and pool.match_prefix([]) == []
    for b in reversed(a):
        pool.free(b)
    assert pool.match_prefix([1, 2, 3, 4, 5, 6]) == a  # freed, still revivable
    for _ in range(6):  # the 5 never-used blocks, then a[2] (freed first)
        pool.allocate()
    assert pool.match_prefix([1, 2, 3, 4, 5, 6]) == a[:2]
    pool.check()


def test_a_key_collision_is_a_miss_never_another_blocks_kv():
    def weak(parent, toks):  # deliberately weak: every block of one parent collides
        return (parent, 0)

    pool = PrefixBlockPool(6, 2, hash_fn=weak)
    a = fill(pool, [1, 2, 3, 4])
    b = fill(pool, [5, 6, 7, 8])  # collides with a at every level: stays uncached
    assert [pool.key[x] for x in b] == [None, None]
    assert pool.match_prefix([5, 6, 7, 8]) == []  # tokens differ: a miss, not a's blocks
    assert pool.match_prefix([1, 2, 7, 8]) == a[:1]
    assert pool.match_prefix([1, 2, 3, 4]) == a

    def parent_blind(parent, toks):
        return toks

    pool = PrefixBlockPool(6, 2, hash_fn=parent_blind)
    x = fill(pool, [1, 2, 3, 4])
    assert pool.match_prefix([3, 4]) == []  # x[1]'s tokens, but its parent key is not the root
    assert pool.match_prefix([1, 2, 3, 4]) == x
    pool.check()


def test_the_guard_has_one_hole_a_weak_hash_opens():
    """Prefixes whose keys collide and then go on with the same tokens: what a planted weak key
    exploits (chain_hash makes it about 2**-64). The oracle, not the pool, must catch it."""

    def parent_blind(parent, toks):
        return toks

    pool = PrefixBlockPool(6, 1, hash_fn=parent_blind)
    fill(pool, [1])
    other = fill(pool, [9, 1, 2])  # its block [2] has parent key (1,), as [1, 2] would
    assert pool.match_prefix([1, 2]) == [0, other[2]]  # KV of [9, 1, 2] returned for [1, 2]


def test_chain_hash_is_a_chain():
    assert chain_hash(None, (1, 2)) == hash((1, 2))
    k = chain_hash(None, (1, 2))
    assert chain_hash(k, (3, 4)) != chain_hash(None, (3, 4))
    assert chain_hash(k, (3, 4)) == chain_hash(chain_hash(None, (1, 2)), (3, 4))


def test_check_names_a_broken_invariant():
    pool = PrefixBlockPool(4, 1)
    pool.check()
    b = pool.allocate()
    pool.ref[b] = 0  # lost: free by its count, not in the queue
    with pytest.raises(AssertionError, match="P2"):
        pool.check()
    pool = PrefixBlockPool(4, 1)
    pool._prev[2] = 0
    with pytest.raises(AssertionError, match="free queue"):
        pool.check()
    pool = PrefixBlockPool(4, 1)
    pool.cache_full_block(pool.allocate(), None, [5])
    pool.tokens[0] = (6,)
    with pytest.raises(AssertionError, match="P4"):
        pool.check()
    pool.cache.clear()
    with pytest.raises(AssertionError, match="P3"):
        pool.check()


# -- O(1): nodes touched ------------------------------------------------------------------------
class CountingLinks(list):
    """A link list that records every node an operation reads or writes (a scan touches all)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.touched: set[int] = set()

    def __getitem__(self, i):
        self.touched.add(i)
        return super().__getitem__(i)

    def __setitem__(self, i, v):
        self.touched.add(i)
        super().__setitem__(i, v)

    def __iter__(self):
        self.touched.update(range(len(self)))
        return super().__iter__()


def touched(pool: PrefixBlockPool, op, *args) -> set[int]:
    pool._prev, pool._next = CountingLinks(pool._prev), CountingLinks(pool._next)
    op(*args)
    nodes = pool._prev.touched | pool._next.touched
    pool._prev, pool._next = list(pool._prev), list(pool._next)
    return nodes


@pytest.mark.parametrize("n", [1_000, 100_000, 1_000_000])
def test_revive_touches_three_nodes_whatever_the_pool_size(n):
    pool = PrefixBlockPool(n, 1)
    for _ in range(n // 2):
        pool.allocate()
    mid = n // 2 - 1
    pool.cache_full_block(mid, None, [42])
    pool.free(mid)
    for b in range(mid):
        pool.free(b)  # queue: n/2 .. n-1, mid, 0 .. mid-1: mid sits half way
    before, after = pool._prev[mid], pool._next[mid]
    assert (before, after) == (n - 1, 0)
    assert touched(pool, pool.touch, mid) == {before, mid, after}
    assert pool._next[before] == after and pool.num_free == n - 1
    assert touched(pool, pool.free, mid) == {n, mid - 1, mid}  # sentinel, tail
    assert touched(pool, pool.allocate) == {n, n // 2, n // 2 + 1}  # sentinel, head, next


# -- the state machine --------------------------------------------------------------------------
class PrefixBlockPoolMachine(RuleBasedStateMachine):
    """A plain model: ref counts, the free queue as a Python list (LRU first), and the cached
    blocks by the whole token prefix they hold (hash-free, so the match is checked by content)."""

    @initialize(num_blocks=st.integers(1, 8), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.pool = PrefixBlockPool(num_blocks, block_size)
        self.ref = [0] * num_blocks
        self.queue = list(range(num_blocks))
        self.prefix_of: dict[int, tuple] = {}  # cached block -> its whole prefix

    def held(self):
        return [b for b, r in enumerate(self.ref) if r > 0]

    @rule()
    def allocate(self):
        if not self.queue:
            with pytest.raises(OutOfBlocks):
                self.pool.allocate()
            return
        want = self.queue.pop(0)
        self.prefix_of.pop(want, None)  # evicted
        assert self.pool.allocate() == want
        self.ref[want] = 1

    @precondition(lambda self: any(self.ref))
    @rule(i=st.integers(0, 99))
    def free(self, i):
        held = self.held()
        b = held[i % len(held)]
        self.pool.free(b)
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.queue.append(b)

    @precondition(lambda self: self.queue)
    @rule(i=st.integers(0, 99))
    def double_free(self, i):
        with pytest.raises(ValueError):
            self.pool.free(self.queue[i % len(self.queue)])

    @precondition(lambda self: any(self.ref))
    @rule(i=st.integers(0, 99), parent=st.integers(-1, 99), data=st.data())
    def cache(self, i, parent, data):
        held = [b for b in self.held() if b not in self.prefix_of]
        if not held:
            return
        b = held[i % len(held)]
        cached = sorted(self.prefix_of)
        p = None if parent < 0 or not cached else cached[parent % len(cached)]
        toks = tuple(
            data.draw(
                st.lists(
                    st.integers(0, 2), min_size=self.pool.block_size, max_size=self.pool.block_size
                )
            )
        )
        pkey = None if p is None else self.pool.key[p]
        self.pool.cache_full_block(b, pkey, toks)
        whole = (() if p is None else self.prefix_of[p]) + toks
        if whole not in self.prefix_of.values():  # a duplicate stays uncached
            self.prefix_of[b] = whole
        assert (self.pool.key[b] is not None) == (b in self.prefix_of)

    @precondition(lambda self: any(b in self.prefix_of for b in self.queue))
    @rule(i=st.integers(0, 99))
    def revive(self, i):
        cached = [b for b in self.queue if b in self.prefix_of]
        b = cached[i % len(cached)]
        self.queue.remove(b)
        self.pool.touch(b)
        self.ref[b] = 1

    @precondition(lambda self: any(self.ref[b] for b in self.prefix_of))
    @rule(i=st.integers(0, 99))
    def share(self, i):
        cached = sorted(b for b in self.prefix_of if self.ref[b])
        b = cached[i % len(cached)]
        self.pool.touch(b)
        self.ref[b] += 1

    @precondition(lambda self: any(b not in self.prefix_of for b in self.queue))
    @rule(i=st.integers(0, 99))
    def touch_uncached_free(self, i):
        stale = [b for b in self.queue if b not in self.prefix_of]
        with pytest.raises(ValueError):
            self.pool.touch(stale[i % len(stale)])

    @rule(i=st.integers(0, 99), extra=st.lists(st.integers(0, 2), max_size=4))
    def match(self, i, extra):
        wholes = sorted(self.prefix_of.values())
        query = (wholes[i % len(wholes)] if wholes else ()) + tuple(extra)
        by_prefix = {v: b for b, v in self.prefix_of.items()}
        want, bs = [], self.pool.block_size
        while (len(want) + 1) * bs <= len(query) and query[: (len(want) + 1) * bs] in by_prefix:
            want.append(by_prefix[query[: (len(want) + 1) * bs]])
        assert self.pool.match_prefix(list(query)) == want

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        assert self.pool.ref == self.ref
        assert self.pool.free_order() == self.queue
        assert {b for b, k in enumerate(self.pool.key) if k is not None} == set(self.prefix_of)


TestPrefixBlockPoolStateful = PrefixBlockPoolMachine.TestCase
TestPrefixBlockPoolStateful.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- the bench row's mechanics (its speed is reported by `kvchaos bench`, never asserted) ---------
def test_revive_bench_takes_distinct_blocks_from_the_middle_and_gives_them_back():
    ids = middle_ids(1_000, 352)
    assert len(set(ids)) == 352 and all(250 <= b < 750 for b in ids)
    with pytest.raises(ValueError, match="at least 1000 blocks"):
        middle_ids(100, 500)
    med = bench_revive_scale(2, per_round=4, deque_per_round=2, small=100, large=10_000)
    assert set(med) == {"pool_100", "deque_100", "pool_10000", "deque_10000"}
    assert all(v > 0 for v in med.values())
