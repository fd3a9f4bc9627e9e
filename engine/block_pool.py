"""A block pool with prefix caching, as vLLM v1's BlockPool and nano-vllm do it: full blocks are
keyed by a chained hash of (parent key, the block's token ids); a new request reuses the blocks of
its longest cached prefix; a freed block keeps its key, revivable until allocate evicts it (LRU).

The free queue is an intrusive doubly linked list over preallocated per-block links (two int
lists), as vLLM's FreeKVCacheBlockQueue: popleft, append and remove-from-the-middle (a revive) are
O(1) whatever the pool size; nano-vllm's deque.remove is O(pool).

Invariants (check() verifies them; tests/test_block_pool.py runs it after every step):
  P1  the free queue is a consistent circular list through the sentinel, num_free nodes long
  P2  b is in the free queue  <=>  ref[b] == 0   (no held block queued, no free block lost)
  P3  cache[k] == b  <=>  key[b] == k   (one block per key, one key per block)
  P4  a cached block has block_size tokens and the key hash_fn(parent[b], tokens[b])

PoolSeams switch the prefix cache's shipped bug classes on (faults/prefix_cache.py plants them);
the defaults are the remediation. A defect path never raises: it does what the bug did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from kvchaos.engine.errors import OutOfBlocks

HashFn = Callable[[Hashable, tuple], Hashable]


def _ignore(kind: str, detail: dict) -> None:
    return None


@dataclass
class PoolSeams:
    """Defect switches of the prefix cache (the defaults are the remediation), and the callbacks
    that give a planted fault its ground truth."""

    verify_hits: bool = True  # a hit checks the block's stored tokens and parent key (vllm#12621)
    unlink_on_revive: bool = True  # a revive takes the block out of the free queue (atlas#373)
    evict_on_reuse: bool = True  # allocate drops the popped block's key (vllm#4761)
    key_after_compute: bool = True  # the manager keys a block once computed (vllm#34587)
    # an admission checks for room before it touches its hit, so a refusal changes nothing
    check_before_touch: bool = True
    on_defect: Callable[[str, dict], None] = _ignore  # a defect path changed what was done
    # set: told every admission's hit, on_admit(seq_id, hit blocks, revived blocks), before
    # allocate (a planted fault's trigger accounting); None costs nothing
    on_admit: Callable[[str, list, list], None] | None = None
    # set: called once the manager keyed a step's computed blocks (end_step), before any release
    on_end_step: Callable[[], None] | None = None
    # set: told every refused admission, on_refused(seq_id, hit blocks); None costs nothing
    on_refused: Callable[[str, list], None] | None = None


def chain_hash(parent_key: int | None, token_ids: tuple[int, ...]) -> int:
    """The key of a full block: a hash of its parent's key and its token ids. Tuples of ints hash
    the same in every process (hash(None) would not on Python < 3.12: the root hashes no parent)."""
    return hash(token_ids) if parent_key is None else hash((parent_key, token_ids))


class PrefixBlockPool:
    """Blocks 0..num_blocks-1 with ref counts, an LRU free queue and a prefix cache."""

    __slots__ = (
        "num_blocks",
        "block_size",
        "hash_fn",
        "ref",
        "key",
        "parent",
        "tokens",
        "cache",
        "num_free",
        "_prev",
        "_next",
        "seams",
        "queued_held",
        "stale_keys",
        "collided",
    )

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = chain_hash) -> None:
        n = self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn  # a parameter, so a planted weak key can replace it
        self.ref = [0] * n
        self.key: list[Hashable | None] = [None] * n  # None: not cached
        self.parent: list[Hashable | None] = [None] * n  # the parent key it was cached under
        self.tokens: list[tuple | None] = [None] * n
        self.cache: dict[Hashable, int] = {}
        self.num_free = n
        # Node n is the sentinel: _next[n] is the LRU head, _prev[n] the tail. Queue 0, 1, ..., n-1.
        self._next = list(range(1, n + 1)) + [0]
        self._prev = [n] + list(range(n))
        self.seams = PoolSeams()
        self.queued_held: set[int] = set()  # unlink_on_revive off: held blocks left queued
        self.stale_keys: set = set()  # evict_on_reuse off: keys whose block was re-allocated
        self.collided: set = set()  # verify_hits off: keys two different blocks were keyed to

    # -- the free queue: O(1) each ------------------------------------------------------------
    def _unlink(self, b: int) -> None:
        p, q = self._prev[b], self._next[b]
        self._next[p] = q
        self._prev[q] = p
        self.num_free -= 1

    def _append(self, b: int) -> None:
        s = self.num_blocks
        t = self._prev[s]
        self._next[t] = b
        self._prev[b] = t
        self._next[b] = s
        self._prev[s] = b
        self.num_free += 1

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        """The least recently freed block, ref 1, its cache key (if any) evicted."""
        if not self.num_free:
            raise OutOfBlocks("no free block")
        b = self._next[self.num_blocks]
        self._unlink(b)
        k = self.key[b]
        if k is not None:
            if self.seams.evict_on_reuse:
                del self.cache[k]
                self.key[b] = self.parent[b] = self.tokens[b] = None
            else:  # defect: the entry stays and will serve this block's next contents
                self.stale_keys.add(k)
                self.seams.on_defect("kept_key", {"block": b})
        if self.seams.unlink_on_revive:
            self.ref[b] = 1
        else:  # defect: a revive may have left this block queued while held: handed out again
            r = self.ref[b]
            self.ref[b] = r + 1
            if r:
                self.queued_held.discard(b)
                self.seams.on_defect("rehanded", {"block": b, "refs": r})
        return b

    def free(self, b: int) -> None:
        """Drop one reference; at zero the block joins the queue's tail, still cached if it was."""
        r = self.ref[b]
        if r <= 0:
            raise ValueError(f"free of free block {b} (double free)")
        self.ref[b] = r - 1
        if r == 1:
            if self.queued_held and b in self.queued_held:  # defect: it never left the queue
                self.queued_held.discard(b)
            else:
                self._append(b)

    def touch(self, b: int) -> None:
        """Take a reference to a cached block: revive it from anywhere in the free queue (ref 0),
        or share it (ref > 0)."""
        r = self.ref[b]
        if r == 0:
            if self.key[b] is None:  # its KV is stale: only allocate may hand it out
                raise ValueError(f"touch of free block {b} that holds no cached prefix")
            if self.seams.unlink_on_revive:
                self._unlink(b)
            else:  # defect: still queued and counted free, so allocate may hand it out
                self.queued_held.add(b)
                self.seams.on_defect("revive_queued", {"block": b})
        self.ref[b] = r + 1

    # -- the prefix cache -----------------------------------------------------------------------
    def cached(self, key: Hashable) -> int | None:
        return self.cache.get(key)

    def cache_full_block(
        self, b: int, parent_key: Hashable | None, token_ids: Sequence[int]
    ) -> Hashable:
        """Key held block b, now full with token_ids after the prefix keyed parent_key (None: the
        first block). Returns the key, which the next block takes as its parent key. If another
        block already has the key, the first one keeps it and b stays uncached."""
        toks = tuple(token_ids)
        if len(toks) != self.block_size:
            raise ValueError(
                f"block {b}: {len(toks)} token ids, a full block has {self.block_size}"
            )
        if self.ref[b] <= 0:
            raise ValueError(f"cache of free block {b}")
        k = self.hash_fn(parent_key, toks)
        if self.key[b] is not None:
            if self.key[b] == k:
                self.stale_keys.discard(k)  # (evict_on_reuse off) the same contents again
                return k
            if self.seams.evict_on_reuse:
                raise ValueError(f"block {b} is already cached under another key")
            if k in self.cache:  # defect: a record kept from before its reuse stays
                return k
            # defect: that record is replaced; its entry stays behind, pointing here
        if k not in self.cache:
            self.cache[k] = b
            self.key[b], self.parent[b], self.tokens[b] = k, parent_key, toks
            if not self.seams.verify_hits and parent_key in self.collided:  # defect truth
                self.seams.on_defect("collided_parent", {"block": b})
        elif not self.seams.verify_hits and k not in self.stale_keys:
            c = self.cache[k]  # defect truth: another prefix's block holds this key
            if c != b and (self.tokens[c] != toks or self.parent[c] != parent_key):
                self.collided.add(k)
        return k

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of token_ids' full blocks, in order; a query
        (the caller touches what it reuses). A key that finds a block with other tokens or another
        parent key is a collision, so a miss. Not guarded: prefixes whose keys collide and then go
        on with the same tokens (about 2**-64 with chain_hash; real with a weak hash_fn)."""
        bs, h, cache = self.block_size, self.hash_fn, self.cache
        tokens, parent = self.tokens, self.parent
        verify = self.seams.verify_hits  # off: a key is trusted (a defect)
        blocks: list[int] = []
        k = None
        for i in range(0, len(token_ids) - bs + 1, bs):
            toks = tuple(token_ids[i : i + bs])
            nk = h(k, toks)
            b = cache.get(nk)
            if b is None or verify and (tokens[b] != toks or parent[b] != k):
                break
            blocks.append(b)
            k = nk
        return blocks

    def served_wrong(self, token_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
        """Of blocks a trusted key served for token_ids (verify_hits off), those whose KV is not
        token_ids': re-allocated since keyed (a stale key), or from the first block keyed over
        other tokens or another parent on (a collision: what follows belongs to another prefix).
        Ground truth for a planted defect; O(blocks)."""
        bs, out, other, k = self.block_size, [], False, None
        for i, b in enumerate(blocks):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            nk = self.hash_fn(k, toks)
            if nk in self.stale_keys:
                out.append(b)
            elif other or self.tokens[b] != toks or self.parent[b] != k:
                other = True
                out.append(b)
            k = nk
        return out

    # -- observation ----------------------------------------------------------------------------
    def free_order(self) -> list[int]:
        """The free queue, LRU first (O(pool): for tests and snapshots)."""
        out, s = [], self.num_blocks
        b = self._next[s]
        while b != s and len(out) <= s:
            out.append(b)
            b = self._next[b]
        return out

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (P1-P4)."""
        n, nxt, prv = self.num_blocks, self._next, self._prev

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        queued, b = [], n
        for _ in range(n + 1):  # P1: the walk comes back to the sentinel, links agree both ways
            q = nxt[b]
            need(prv[q] == b, f"free queue: next[{b}] = {q} but prev[{q}] = {prv[q]}")
            if q == n:
                break
            queued.append(q)
            b = q
        need(q == n, "free queue: no way back to the sentinel (a cycle)")
        need(
            len(queued) == self.num_free,
            f"free queue holds {len(queued)}, num_free {self.num_free}",
        )
        need(len(set(queued)) == len(queued), "free queue: a block queued twice")
        need(all(r >= 0 for r in self.ref), "a negative ref count")
        zero = {b for b, r in enumerate(self.ref) if r == 0}
        need(set(queued) == zero, f"P2: queued {sorted(set(queued) ^ zero)} vs ref 0")  # P2
        for k, b in self.cache.items():  # P3
            need(self.key[b] == k, f"P3: cache[{k!r}] = {b} but block {b} has key {self.key[b]!r}")
        keyed = sum(k is not None for k in self.key)
        need(keyed == len(self.cache), f"P3: {keyed} blocks keyed, {len(self.cache)} cache entries")
        for b, k in enumerate(self.key):  # P4
            if k is None:
                need(self.tokens[b] is None and self.parent[b] is None, f"P4: uncached block {b}")
            else:
                toks = self.tokens[b]
                need(toks is not None and len(toks) == self.block_size, f"P4: block {b} tokens")
                need(self.hash_fn(self.parent[b], toks) == k, f"P4: block {b} key is not its hash")
