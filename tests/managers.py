"""Block managers written as a user would: behaviours real managers have (preallocation, refusals
under pressure, a watermark) and bugs they ship (rows left behind, crashes,
a refusal that leaves a trace). Plugged in by spec, e.g. "managers:Preallocating"."""

from __future__ import annotations

import random

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.errors import OutOfBlocks

HIDDEN = "__reserve__"  # a manager's own holder of preallocated blocks


class Delegate:
    """The protocol, forwarded to the reference manager."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_blocks_per_seq) -> None:
        self.inner = BlockManager(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)
        self.block_size = block_size
        self.calls = 0

    table = property(lambda self: self.inner.table)
    num_blocks = property(lambda self: self.inner.num_blocks)
    num_free_blocks = property(lambda self: self.inner.num_free_blocks)
    num_free_rows = property(lambda self: self.inner.num_free_rows)

    def blocks_needed(self, seq_id, n):
        return self.inner.blocks_needed(seq_id, n)

    def append(self, seq_id, n):
        self.calls += 1
        return self.inner.append(seq_id, n)

    def fork(self, parent_id, child_id):
        self.inner.fork(parent_id, child_id)

    def free(self, seq_id):
        return self.inner.free(seq_id)

    def resize_table(self, rows=None, width=None):
        self.inner.resize_table(rows, width)

    def snapshot(self):
        return self.inner.snapshot()


class Preallocating(Delegate):
    """Takes more blocks than blocks_needed said: every growth also tops up a reserve of spare
    blocks (held by the manager's own sequence), given back when the pool runs low."""

    SPARE = 2

    def append(self, seq_id, n):
        self.calls += 1
        try:
            copies = self.inner.append(seq_id, n)
        except OutOfBlocks:
            spare = len(self.inner.blocks.get(HIDDEN, []))
            if self.inner.blocks_needed(seq_id, n) > self.inner.num_free_blocks + spare:
                raise  # even the reserve would not do: refuse, changing nothing
            self.inner.free(HIDDEN)  # the reserve goes first, then the request may have it
            return self.inner.append(seq_id, n)
        have = len(self.inner.blocks.get(HIDDEN, []))
        if have < self.SPARE and self.inner.num_free_blocks > 8 and self.inner.num_free_rows > 1:
            try:
                self.inner.append(HIDDEN, self.block_size * (self.SPARE - have))
            except OutOfBlocks:
                pass
        return copies

    def blocks_needed(self, seq_id, n):  # an estimate that counts the reserve as free
        return max(0, self.inner.blocks_needed(seq_id, n) - len(self.inner.blocks.get(HIDDEN, [])))


class RefusesWhenLow(Delegate):
    """Refuses at random (seeded) when under a quarter of the pool is free, room or not."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.rng = random.Random(7)

    def append(self, seq_id, n):
        self.calls += 1
        if self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.rng.random() < 0.3:
            raise OutOfBlocks(f"{seq_id}: not now")
        return self.inner.append(seq_id, n)


class Watermark(Delegate):
    """Admits a new sequence only while a tenth of the pool would stay free: refuses with room."""

    def append(self, seq_id, n):
        self.calls += 1
        if seq_id not in self.inner.rows:
            left = self.inner.num_free_blocks - self.inner.blocks_needed(seq_id, n)
            if left < self.inner.num_blocks // 10:
                raise OutOfBlocks(f"{seq_id}: under the watermark")
        return self.inner.append(seq_id, n)


class NoFork(Delegate):
    """Shares nothing: every fork is refused (a prefix cache serves parallel samples instead)."""

    def fork(self, parent_id, child_id):
        raise OutOfBlocks("this manager does not fork")


class TracedRefusal(Delegate):
    """A refusal that leaves a trace: when it says no, it has already taken a block."""

    def append(self, seq_id, n):
        self.calls += 1
        if self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.calls % 5 == 0:
            self.inner.pool.allocate()  # taken, never given back
            raise OutOfBlocks(f"{seq_id}: not now")
        return self.inner.append(seq_id, n)


class LeavesRowsBehind(BlockManager):
    """free() gives the blocks back but leaves their ids in the table row."""

    def free(self, seq_id):
        row, blocks = self.rows.get(seq_id), list(self.blocks.get(seq_id, []))
        done = super().free(seq_id)
        w = self.table.width
        for i, b in enumerate(blocks[:w]):
            self.table.host[row * w + i] = b
        return done


class DoubleFreeGuard(BlockManager):
    """The pool's guard fires on the tenth free: "decref of free block (double free)"."""

    frees = 0

    def free(self, seq_id):
        self.frees += 1
        if self.frees == 10:
            raise RuntimeError("decref of free block (double free)")
        return super().free(seq_id)


class IndexErrorOnGrowth(BlockManager):
    """An off-by-one deep in growth: IndexError on the 15th append."""

    appends = 0

    def append(self, seq_id, n):
        self.appends += 1
        if self.appends == 15:
            return [][1]
        return super().append(seq_id, n)


class OutOfRangeSnapshot(BlockManager):
    """Its snapshot lists a block id past the pool."""

    def snapshot(self):
        snap = super().snapshot()
        if snap.seq_blocks:
            seq = next(iter(snap.seq_blocks))
            snap.seq_blocks[seq] = snap.seq_blocks[seq] + [snap.num_blocks + 5]
        return snap


class StaleSnapshot(BlockManager):
    """snapshot() returns a copy cached at the first call: it looks healthy forever."""

    cached = None

    def snapshot(self):
        if self.cached is None:
            self.cached = super().snapshot()
        return self.cached


class MiscountsFree(BlockManager):
    """num_free_blocks counts one block more than its own free list holds."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free) + 1


class SkipsCopyOnWrite(BlockManager):
    """Appending to a shared, partly filled last block writes into it: no copy is made."""

    def append(self, seq_id, n):
        blocks, b, saved = self.blocks.get(seq_id), None, 0
        if blocks and self.num_tokens[seq_id] % self.block_size:
            b = blocks[-1]
            saved, self.pool.ref[b] = self.pool.ref[b], 1
        try:
            return super().append(seq_id, n)
        finally:
            if b is not None:
                self.pool.ref[b] = saved


class WithoutFork(Delegate):
    """Has no fork at all (declares no such capability): parallel samples are fresh requests."""

    fork = None
    capabilities = frozenset()


class RefusalBumpsRef(Delegate):
    """A refusal that leaves a trace the free count cannot show: it bumps a held block's ref."""

    def append(self, seq_id, n):
        self.calls += 1
        held = [b for bs in self.inner.blocks.values() for b in bs]
        if held and self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.calls % 5 == 0:
            self.inner.pool.incref(held[0])  # one more holder nobody will release
            raise OutOfBlocks(f"{seq_id}: not now")
        return self.inner.append(seq_id, n)
