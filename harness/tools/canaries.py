"""Canaries: the reference block manager with one realistic bug planted, one per operation family.

`kvchaos selftest` runs each through the clean scenarios; a canary that survives is a blind spot
of the harness (TigerBeetle's VOPR practice: test the tester). Each bug is one a user could ship:
an off-by-one, a forgotten step, a fast path that skips what the slow path does. Each is a small
subclass of kvchaos.engine.block_manager.BlockManager that differs from it by that one bug; where
the buggy line sits deep in a reference method, the override lets the reference run and then
takes back what the buggy line would never have done (same state, a fraction of the code)."""

from __future__ import annotations

from dataclasses import dataclass

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.errors import OutOfBlocks


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

    def append(self, seq_id, num_new_tokens):
        before = len(self.blocks.get(seq_id, ()))
        copies = super().append(seq_id, num_new_tokens)
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

    def append(self, seq_id, num_new_tokens):
        copies = super().append(seq_id, num_new_tokens)
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
    """free: gives back the first block only (written when every sequence held one)."""

    def free(self, seq_id):
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

    def append_decode(self, seq_ids):
        copies = super().append_decode(seq_ids)
        self.decoded.update(seq_ids)
        return copies

    def free(self, seq_id):
        if seq_id in self.decoded or seq_id not in self.blocks:
            self.decoded.discard(seq_id)
            return super().free(seq_id)
        blocks, row = self.blocks.pop(seq_id), self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        self.table.clear(row, len(blocks))
        self._free_rows.append(row)  # the blocks' references are never dropped
        return True


class PreemptLeavesRow(BlockManager):
    """preempt: under pressure (fewer free blocks than live sequences: the engine is preempting)
    a fast release path gives back blocks and row but leaves the row's entries mapped."""

    def free(self, seq_id):
        if seq_id not in self.blocks or len(self.pool.free) >= len(self.rows):
            return super().free(seq_id)
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

    def append_decode(self, seq_ids):
        before = {s: len(self.blocks[s]) for s in seq_ids}
        copies = super().append_decode(seq_ids)
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
    """admission: blocks_needed rounds down (`//` for ceil). The engine admits and grows on that
    estimate, and append, whose room check trusts it, runs the pool dry halfway through instead
    of refusing up front: the blocks taken before the refusal stay taken."""

    def blocks_needed(self, seq_id, num_new_tokens):
        bs = self.block_size
        have = self.num_tokens.get(seq_id, 0)
        need = (have + num_new_tokens) // bs - have // bs
        blocks = self.blocks.get(seq_id)
        if blocks and have % bs and self.pool.ref[blocks[-1]] > 1 and num_new_tokens:
            need += 1
        return need


class SnapshotStale(BlockManager):
    """snapshot: memoised on a generation counter that only append bumps, so after a free, a
    fork or a decode step it returns the picture from before."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.generation, self._cached = 0, None

    def append(self, seq_id, num_new_tokens):
        self.generation += 1
        return super().append(seq_id, num_new_tokens)

    def snapshot(self):
        if self._cached is None or self._cached[0] != self.generation:
            self._cached = (self.generation, super().snapshot())
        return self._cached[1]


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
]
