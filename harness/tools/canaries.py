"""Canaries: the reference block manager with one realistic bug planted, one per operation family.

`kvchaos selftest` runs each through the clean scenarios; a canary that survives is a blind spot
of the harness (TigerBeetle's VOPR practice: test the tester). Each bug is one a user could ship:
an off-by-one, a forgotten step, a fast path that skips what the slow path does. Each is a small
subclass of the reference (kvchaos.engine.block_manager.BlockManager; for the prefix-cache
family kvchaos.engine.prefix_manager.PrefixCachingManager) that differs by that one bug; where
the buggy line sits deep in a reference method, the override lets the reference run and then
takes back what the buggy line would never have done (same state, a fraction of the code)."""

from __future__ import annotations

from dataclasses import dataclass

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager


class _HotBlockPool(BlockPool):
    """Prefers the block freed last (its lines are still warm) but never takes it off the free
    stack: it stays listed as free while in use, and is handed out a second time later."""

    __slots__ = ("hot",)

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.hot: int | None = None

    def decref(self, b: int) -> None:
        super().decref(b)
        if self.ref[b] == 0:
            self.hot = b

    def allocate(self) -> int:
        b, self.hot = self.hot, None
        if b is None or self.ref[b]:  # checks the ref count, not that it is still listed free
            return super().allocate()
        self.ref[b] = 1
        return b


class AllocateHandsOutHeld(BlockManager):
    """allocate: a warm-block fast path hands out a block still on the free stack."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pool = _HotBlockPool(self.pool.num_blocks)


class AppendOffByOne(BlockManager):
    """append: maps slots for one token fewer than it records (`< total - 1`), so a chunk whose
    last token opens a new block leaves that token's table entry unmapped (-1)."""

    def _grow(self, seq_id, num_new_tokens):  # the growth admit and append share
        before = len(self.blocks.get(seq_id, ()))
        copies = super()._grow(seq_id, num_new_tokens)
        blocks, bs = self.blocks[seq_id], self.block_size
        total = self.num_tokens[seq_id]
        if len(blocks) > before and len(blocks) * bs - (total - 1) >= bs:
            b = blocks.pop()  # the block the buggy loop never allocates
            self.table.host[self.rows[seq_id] * self.table.width + len(blocks)] = -1
            self.pool.decref(b)
        return copies


class CowSharedByTwo(BlockManager):
    """copy-on-write: tests `ref > 2` for "shared", so a last block shared by exactly two
    sequences (a fork's parent and child) is written in place by both."""

    def append(self, seq_id, token_ids):
        copies = super().append(seq_id, token_ids)
        kept = []
        for src, dst in copies:
            if self.pool.ref[src] != 1:  # three or more sharers: this canary copies too
                kept.append((src, dst))
                continue
            blocks, row = self.blocks[seq_id], self.rows[seq_id]
            i = blocks.index(dst)  # undo the copy: as if the test had said "not shared"
            self.pool.incref(src)
            blocks[i] = src
            self.table.write(row, i, src)
            self.pool.decref(dst)
        return kept


class ForkNoIncref(BlockManager):
    """fork: the child maps every block of the parent, but no ref count goes up."""

    def fork(self, parent_id, child_id):
        if child_id in self.rows:
            raise ValueError(f"sequence {child_id} already holds blocks")
        if not self._free_rows:
            raise OutOfBlocks("no free table row for the forked sequence")
        blocks = list(self.blocks[parent_id])
        row = self._free_rows.pop()
        for i, b in enumerate(blocks):  # the incref is missing
            self.table.write(row, i, b)
        self.rows[child_id], self.blocks[child_id] = row, blocks
        self.num_tokens[child_id] = self.num_tokens[parent_id]


class FreeFirstBlockOnly(BlockManager):
    """free: release gives back the first block only (written when every sequence held one)."""

    def release(self, seq_id, reason):
        blocks = self.blocks.pop(seq_id, None)
        if blocks is None:
            return False
        row = self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        self.table.clear(row, len(blocks))
        if blocks:
            self.pool.decref(blocks[0])
        self._free_rows.append(row)
        return True


class CancelBeforeDecodeLeaks(BlockManager):
    """cancel: a sequence freed before it ever decoded (cancelled or preempted mid-prefill, or a
    fork child that never ran) takes an "abort" path that drops the bookkeeping and the row but
    never decrefs its blocks."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.decoded: set[str] = set()

    def append_decode(self, seq_ids, token_ids):
        copies = super().append_decode(seq_ids, token_ids)
        self.decoded.update(seq_ids)
        return copies

    def release(self, seq_id, reason):
        if seq_id in self.decoded or seq_id not in self.blocks:
            self.decoded.discard(seq_id)
            return super().release(seq_id, reason)
        blocks, row = self.blocks.pop(seq_id), self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        self.table.clear(row, len(blocks))
        self._free_rows.append(row)  # the blocks' references are never dropped
        return True


class PreemptLeavesRow(BlockManager):
    """preempt: a release for "preempted" takes a fast path (the sequence comes back soon) that
    gives back blocks and row but leaves the row's entries mapped."""

    def release(self, seq_id, reason):
        if seq_id not in self.blocks or reason != "preempted":
            return super().release(seq_id, reason)
        blocks, row = self.blocks.pop(seq_id), self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        for b in reversed(blocks):
            self.pool.decref(b)
        self._free_rows.append(row)  # table.clear(row, ...) left "for whoever reuses the row"
        return True


class ResizeKeepsFirstRow(BlockManager):
    """resize: the widened table keeps the old buffer's first `width` entries (row 0) only."""

    def resize_table(self, rows=None, width=None):
        t = self.table
        old_rows, old_width = t.rows, t.width
        super().resize_table(rows, width)
        for r in range(1, old_rows):  # what the one-row copy leaves unmapped
            t.clear(r, old_width)


class DecodeTableNotUploaded(BlockManager):
    """table upload: append_decode takes a new block for a sequence crossing a block boundary
    but never writes it into the table row the kernels read."""

    def append_decode(self, seq_ids, token_ids):
        before = {s: len(self.blocks[s]) for s in seq_ids}
        copies = super().append_decode(seq_ids, token_ids)
        w = self.table.width
        for s in seq_ids:
            i = len(self.blocks[s]) - 1
            if before[s] <= i < w:
                self.table.host[self.rows[s] * w + i] = -1
        return copies


class _RowsByCount:
    """RowFromCount's free rows: "the next row" is the number of rows in use, and a freed row
    needs no record ("the count went down"). Right only while sequences end newest first."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager

    def __len__(self) -> int:
        return self.m.table.rows - len(self.m.rows)

    def pop(self) -> int:
        return len(self.m.rows)

    def append(self, row: int) -> None:
        pass

    def __setitem__(self, index, rows) -> None:  # resize_table adds rows: the count covers them
        pass


class RowFromCount(BlockManager):
    """row reuse: a new sequence gets row len(rows); once an older sequence has ended, that row
    still belongs to a live one, and both now write it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._free_rows = _RowsByCount(self)


class AdmissionFloor(BlockManager):
    """admission: blocks_needed rounds down (`//` for ceil). The engine grows sequences on that
    estimate, and growth, whose room check trusts it (admit, append, a decode batch), runs the
    pool dry halfway through instead of refusing up front: what it took before stays taken."""

    def blocks_needed(self, seq_id, num_new_tokens):
        bs = self.block_size
        have = self.num_tokens.get(seq_id, 0)
        need = (have + num_new_tokens) // bs - have // bs
        blocks = self.blocks.get(seq_id)
        if blocks and have % bs and self.pool.ref[blocks[-1]] > 1 and num_new_tokens:
            need += 1
        return need


class SnapshotStale(BlockManager):
    """snapshot: memoised on a generation counter that only append bumps, so after an admission,
    a release, a fork or a decode step it returns the picture from before."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.generation, self._cached = 0, None

    def append(self, seq_id, token_ids):
        self.generation += 1
        return super().append(seq_id, token_ids)

    def snapshot(self):
        if self._cached is None or self._cached[0] != self.generation:
            self._cached = (self.generation, super().snapshot())
        return self._cached[1]


# -- the prefix cache: bugs shipped in real managers' hit and eviction paths -------------------
class _ParentBlindPool(PrefixBlockPool):
    """Keys a block by its own token ids alone and checks only those on a hit."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, hash_fn=lambda parent, toks: hash(toks))

    def match_prefix(self, token_ids):
        bs, blocks = self.block_size, []
        for i in range(0, len(token_ids) - bs + 1, bs):
            toks = tuple(token_ids[i : i + bs])
            b = self.cache.get(hash(toks))
            if b is None or self.tokens[b] != toks:
                break
            blocks.append(b)
        return blocks


class HitIgnoresParent(PrefixCachingManager):
    """prefix cache hit: the key hashes a block's own tokens, not its parent's key, so equal blocks
    after different prefixes share KV computed for another context (and other positions)."""

    def __init__(self, num_blocks, block_size, *rest):
        super().__init__(num_blocks, block_size, pool=_ParentBlindPool(num_blocks, block_size))


class HitOneTokenLong(PrefixCachingManager):
    """prefix cache hit: answers the matched length + 1 (a `<=` for `<` in the match loop), so the
    engine skips computing a token whose slot was never written."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        h = super().admit(seq_id, token_ids, num_new_tokens, max_computed)
        return h + 1 if h else 0


class _KeepQueuedOnRevive(PrefixBlockPool):
    def touch(self, b: int) -> None:
        self.ref[b] += 1  # revived without leaving the free queue: allocate may hand it out


class ReviveWithoutUnlink(PrefixCachingManager):
    """prefix cache revive: a cached free block taken by a hit stays in the free queue, so allocate
    hands the held block to another request, which overwrites it."""

    def __init__(self, num_blocks, block_size, *rest):
        super().__init__(num_blocks, block_size, pool=_KeepQueuedOnRevive(num_blocks, block_size))


class _TrustingPool(PrefixBlockPool):
    def allocate(self) -> int:
        b = self._next[self.num_blocks]
        if not self.num_free:
            raise OutOfBlocks("no free block")
        self._unlink(b)
        self.key[b] = self.parent[b] = self.tokens[b] = None  # cache[k] -> b stays behind
        self.ref[b] = 1
        return b

    def match_prefix(self, token_ids):
        bs, k, blocks = self.block_size, None, []
        for i in range(0, len(token_ids) - bs + 1, bs):
            k = self.hash_fn(k, tuple(token_ids[i : i + bs]))
            b = self.cache.get(k)  # the key is trusted: no token check
            if b is None:
                break
            blocks.append(b)
        return blocks

    def touch(self, b: int) -> None:
        if self.ref[b] == 0:
            self._unlink(b)
        self.ref[b] += 1

    def cache_full_block(self, b, parent_key, token_ids):
        k = self.hash_fn(parent_key, tuple(token_ids))
        if k not in self.cache and self.key[b] is None:
            self.cache[k] = b
            self.key[b], self.parent[b], self.tokens[b] = k, parent_key, tuple(token_ids)
        return k


class EvictKeepsEntry(PrefixCachingManager):
    """prefix cache evict: allocate clears the block's key but leaves the cache's entry pointing at
    it, and a hit trusts the entry, so it serves a block re-allocated and overwritten since."""

    def __init__(self, num_blocks, block_size, *rest):
        super().__init__(num_blocks, block_size, pool=_TrustingPool(num_blocks, block_size))


class AllocateBeforeTouch(PrefixCachingManager):
    """prefix cache admit: allocates the new blocks before taking its hit, so allocate may evict a
    block of the hit itself and hand it out again as a new block of the same request."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        pool, bs = self.pool, self.block_size
        hit = pool.match_prefix(token_ids[: max(0, max_computed)])
        h = len(hit) * bs
        total = h + min(num_new_tokens, len(token_ids) - h)
        new = -(-total // bs) - len(hit)
        if new + sum(pool.ref[b] == 0 for b in hit) > pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id}: no room")
        fresh = [pool.allocate() for _ in range(new)]  # may evict a block of the hit
        for b in hit:
            pool.touch(b)
        self.blocks[seq_id], self.tokens[seq_id] = hit + fresh, list(token_ids[:total])
        self.keyed[seq_id], self.last_key[seq_id] = len(hit), pool.key[hit[-1]] if hit else None
        return h


class _SkipTouchPool(PrefixBlockPool):
    skip = False

    def touch(self, b: int) -> None:
        if not self.skip:
            super().touch(b)


class HitWithoutIncref(PrefixCachingManager):
    """prefix cache hit: the served blocks are not referenced (the touch is missing) and so not
    released either: the owner's free queues them while the reader still reads them, and allocate
    re-hands them."""

    def __init__(self, num_blocks, block_size, *rest):
        super().__init__(num_blocks, block_size, pool=_SkipTouchPool(num_blocks, block_size))
        self.borrowed: dict[str, int] = {}

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.pool.skip = True
        try:
            h = super().admit(seq_id, token_ids, num_new_tokens, max_computed)
        finally:
            self.pool.skip = False
        self.borrowed[seq_id] = h // self.block_size
        return h

    def release(self, seq_id, reason):
        n = self.borrowed.pop(seq_id, 0)
        if seq_id in self.blocks:
            self.blocks[seq_id] = self.blocks[seq_id][n:]  # never referenced: not freed
        return super().release(seq_id, reason)


@dataclass(frozen=True)
class Canary:
    name: str
    family: str
    manager: type

    @property
    def bug(self) -> str:
        return (self.manager.__doc__ or "").split(": ", 1)[-1].replace("\n    ", " ").strip()


CANARIES = [
    Canary("allocate-held-block", "allocate", AllocateHandsOutHeld),
    Canary("append-off-by-one", "append", AppendOffByOne),
    Canary("cow-shared-by-two", "copy-on-write", CowSharedByTwo),
    Canary("fork-no-incref", "fork", ForkNoIncref),
    Canary("free-first-block-only", "free", FreeFirstBlockOnly),
    Canary("cancel-before-decode-leaks", "cancel", CancelBeforeDecodeLeaks),
    Canary("preempt-leaves-row", "preempt", PreemptLeavesRow),
    Canary("resize-keeps-first-row", "resize", ResizeKeepsFirstRow),
    Canary("decode-table-not-uploaded", "table upload", DecodeTableNotUploaded),
    Canary("row-from-count", "row reuse", RowFromCount),
    Canary("admission-floor", "admission", AdmissionFloor),
    Canary("snapshot-stale", "snapshot", SnapshotStale),
    Canary("hit-ignores-parent", "prefix cache", HitIgnoresParent),
    Canary("hit-one-token-long", "prefix cache", HitOneTokenLong),
    Canary("revive-without-unlink", "prefix cache", ReviveWithoutUnlink),
    Canary("evict-keeps-entry", "prefix cache", EvictKeepsEntry),
    Canary("allocate-before-touch", "prefix cache", AllocateBeforeTouch),
    Canary("hit-without-incref", "prefix cache", HitWithoutIncref),
]
