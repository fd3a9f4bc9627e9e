"""Reference BlockManager (protocol v2, without a prefix cache): an O(1) free pool with explicit
reference counts, per-sequence block lists, fork with copy-on-write, and the flat block table it
writes itself ("own_table"). It keeps token counts, not token ids: admit answers 0.

Invariants (checked by tests/test_block_manager_stateful.py after every operation):
  I1  len(free) + #{b : ref[b] > 0} == num_blocks
  I2  ref[b] == number of sequences whose block list holds b
  I3  b in free  <=>  ref[b] == 0   (so no free block is referenced)
  I4  each sequence's table row == its block list, padded with -1
and, kept by BlockPool.incref/decref alone:
  I5  pool.shared == #{b : ref[b] > 1}   (none shared: decode skips the copy-on-write check)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchaos.engine.block_table import BlockTable
from kvchaos.engine.errors import OutOfBlocks, TableOverflow
from kvchaos.engine.protocols import Reason, Snapshot


class BlockPool:
    """Free stack plus ref counts. allocate/incref/decref are O(1), whatever the pool size."""

    __slots__ = ("num_blocks", "free", "ref", "shared")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.ref = [0] * num_blocks
        self.shared = 0  # blocks with ref > 1 (I5)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocks("no free block")
        b = self.free.pop()
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        r = self.ref[b]
        if r <= 0:
            raise ValueError(f"incref of free block {b}")
        self.ref[b] = r + 1
        if r == 1:
            self.shared += 1

    def decref(self, b: int) -> None:
        r = self.ref[b]
        if r <= 0:
            raise ValueError(f"decref of free block {b} (double free)")
        self.ref[b] = r - 1
        if r == 1:
            self.free.append(b)
        elif r == 2:
            self.shared -= 1


class BlockManager:
    """Maps each sequence's token positions to physical slots. Sequences are keyed by id; each
    sequence holding blocks owns one table row."""

    kvchaos_protocol = 2
    capabilities = frozenset({"fork", "seq_tokens", "estimates", "append_decode", "own_table"})

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.table = BlockTable(max_num_seqs, max_blocks_per_seq)
        self.blocks: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # set (a planted leak, faults/refcount_leak.py): release_skips(seq_id, reason, blocks)
        # names the blocks whose reference the release keeps; None costs nothing
        self.release_skips: Callable[[str, str, list], Sequence[int]] | None = None
        # a host tier of host_blocks slots ("offload"): store / restore a sequence's blocks
        self.host = BlockPool(host_blocks) if host_blocks > 0 else None
        self.host_slots: dict[str, list[int]] = {}  # seq -> its host slots, in logical order
        self.copying: dict[str, str] = {}  # seq -> "store" | "restore" until offload_done
        # set (a planted bug, faults/offload.py host_slot_freed): host_frees_early(seq_id) says
        # a completed store gives its host slots back while the sequence still needs them
        self.host_frees_early: Callable[[str], bool] | None = None
        self._freed_early: dict[str, set[int]] = {}  # seq -> its slots so given back (once)
        if self.host is not None:
            self.capabilities = type(self).capabilities | {"offload"}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        """Blocks an append of num_new_tokens would take, copy-on-write included (an id it does
        not hold: its admission's)."""
        bs = self.block_size
        have = self.num_tokens.get(seq_id, 0)
        need = -(-(have + num_new_tokens) // bs) - -(-have // bs)
        blocks = self.blocks.get(seq_id)
        if blocks and have % bs and self.pool.ref[blocks[-1]] > 1 and num_new_tokens:
            need += 1
        return need

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def block_ids(self, seq_id: str) -> list[int]:
        return self.blocks[seq_id]

    # -- mutations -----------------------------------------------------------------------
    def admit(
        self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int, max_computed: int
    ) -> int:
        """Start seq_id with slots for its first min(num_new_tokens, len(token_ids)) tokens. No
        prefix cache: nothing is computed already, so the answer is 0. Atomic, as _grow."""
        if seq_id in self.rows:
            raise ValueError(f"admit of sequence {seq_id}, which holds blocks")
        self._grow(seq_id, min(num_new_tokens, len(token_ids)))
        return 0

    def append(self, seq_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Slots for these tokens of a live sequence, next in order (only their count matters
        here). Returns the copy-on-write copies, as _grow. Atomic."""
        if seq_id not in self.rows:
            raise KeyError(f"append to {seq_id!r}, which holds no blocks: admit starts one")
        return self._grow(seq_id, len(token_ids))

    def _grow(self, seq_id: str, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for num_new_tokens more tokens of seq_id (a new id takes a row).
        Returns the (src, dst) block copies the caller must apply to the KV pool (copy-on-write).
        Atomic: raises OutOfBlocks (pool or rows exhausted) or TableOverflow (row width, bound check
        on) without changing anything."""
        need = self.blocks_needed(seq_id, num_new_tokens)
        if need > len(self.pool.free) or (seq_id not in self.rows and not self._free_rows):
            raise OutOfBlocks(
                f"sequence {seq_id}: {num_new_tokens} tokens need more blocks than are free"
            )
        last = -(-(self.num_tokens.get(seq_id, 0) + num_new_tokens) // self.block_size) - 1
        if (
            need and last >= self.table.width and self.table.bound_check
        ):  # refuse before changing anything
            raise TableOverflow(
                f"sequence {seq_id}: block-table index {last} >= width {self.table.width}"
            )
        pool, table, bs = self.pool, self.table, self.block_size
        if seq_id not in self.rows:
            self.rows[seq_id] = self._free_rows.pop()
            self.blocks[seq_id] = []
            self.num_tokens[seq_id] = 0
        row, blocks, have = self.rows[seq_id], self.blocks[seq_id], self.num_tokens[seq_id]
        copies = []
        if num_new_tokens and have % bs and pool.ref[blocks[-1]] > 1:
            src = blocks[-1]
            dst = pool.allocate()
            pool.decref(src)
            blocks[-1] = dst
            table.write(row, len(blocks) - 1, dst)
            copies.append((src, dst))
        total = have + num_new_tokens
        while len(blocks) * bs < total:
            b = pool.allocate()
            try:
                table.write(row, len(blocks), b)
            except Exception:
                pool.decref(b)
                raise
            blocks.append(b)
        self.num_tokens[seq_id] = total
        return copies

    def append_decode(
        self, seq_ids: Sequence[str], token_ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """append(s, [t]) for every s: the decode hot path, inlined. Same semantics, same
        atomicity: a failure (no free block, a row too narrow) leaves the manager as it was."""
        pool = self.pool
        free, ref = pool.free, pool.ref
        table = self.table
        bs, nt, blocks, rows = self.block_size, self.num_tokens, self.blocks, self.rows
        host, w = table.host, table.width
        cow = (
            pool.shared > 0
        )  # else no block is shared, so no partial last block needs copy-on-write
        if len(free) < len(seq_ids) or (cow and table.bound_check):  # rare: check everything first
            if table.bound_check:
                for s in seq_ids:
                    if nt[s] % bs == 0 and len(blocks[s]) >= w:
                        raise TableOverflow(
                            f"sequence {s}: block-table index {len(blocks[s])} >= width {w}"
                        )
            if sum(self.blocks_needed(s, 1) for s in seq_ids) > len(free):
                raise OutOfBlocks(
                    f"decode of {len(seq_ids)} sequences needs more blocks than are free"
                )
            return [c for s, t in zip(seq_ids, token_ids) for c in self.append(s, (t,))]
        copies: list[tuple[int, int]] = []
        for k, s in enumerate(seq_ids):
            n = nt[s]
            if n % bs:
                if (
                    cow and ref[blocks[s][-1]] != 1
                ):  # shared partial block: copy-on-write, the slow path
                    copies += self.append(s, (token_ids[k],))
                    continue
            else:
                bl = blocks[s]
                i = len(bl)
                if i >= w and table.bound_check:
                    self._undo_decode(seq_ids[:k])
                    raise TableOverflow(f"block-table row {rows[s]}: index {i} >= width {w}")
                b = free.pop()
                ref[b] = 1
                if i < w:
                    host[rows[s] * w + i] = b
                else:
                    table.write(rows[s], i, b)
                bl.append(b)
            nt[s] = n + 1
        return copies

    def _undo_decode(self, seq_ids: list[str]) -> None:
        """Take back one decode append of each sequence (no copy-on-write happened: none shared)."""
        bs, w, host = self.block_size, self.table.width, self.table.host
        for s in seq_ids:
            n = self.num_tokens[s] = self.num_tokens[s] - 1
            if n % bs == 0:
                b = self.blocks[s].pop()
                host[self.rows[s] * w + len(self.blocks[s])] = -1
                self.pool.decref(b)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up); the first append to a
        shared, partly filled last block copies it."""
        if child_id in self.rows:
            raise ValueError(f"sequence {child_id} already holds blocks")
        if not self._free_rows:
            raise OutOfBlocks("no free table row for the forked sequence")
        blocks = list(self.blocks[parent_id])
        row = self._free_rows.pop()
        for i, b in enumerate(blocks):
            self.pool.incref(b)
            self.table.write(row, i, b)
        self.rows[child_id], self.blocks[child_id] = row, blocks
        self.num_tokens[child_id] = self.num_tokens[parent_id]

    def release(self, seq_id: str, reason: Reason) -> bool:
        """Release every block and the row of seq_id, whatever the reason (no cache: an "error"
        leaves no key behind). Idempotent: an unknown id returns False."""
        self._release_host(seq_id)
        blocks = self.blocks.pop(seq_id, None)
        if blocks is None:
            return self.num_tokens.pop(seq_id, None) is not None  # stored out: host slots only
        row = self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        self.table.clear(row, len(blocks))
        skip = list(self.release_skips(seq_id, reason, blocks)) if self.release_skips else ()
        for b in reversed(blocks):  # tail first: the prefix stays hot at the top of the stack
            if b in skip:  # a planted leak: this reference is never dropped
                skip.remove(b)
                continue
            self.pool.decref(b)
        self._free_rows.append(row)
        return True

    # -- the host tier ("offload"; docs/protocol-v2.md section 10) -----------------------
    @property
    def host_blocks(self) -> int:
        return self.host.num_blocks if self.host is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.host.free) if self.host is not None else 0

    def offload_store(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Host slots for the blocks holding seq_id's first num_tokens tokens (those computed):
        (device block, host slot) in logical order. Blocks past them (reserved, never written) go
        back now; the stored ones stay held until offload_done. Atomic: OutOfBlocks."""
        if seq_id not in self.rows or seq_id in self.copying:
            raise KeyError(f"offload_store of {seq_id!r}: not resident, or a copy in flight")
        blocks, host = self.blocks[seq_id], self.host
        keep = -(-num_tokens // self.block_size)
        if not 0 < num_tokens <= self.num_tokens[seq_id]:
            raise ValueError(f"offload_store of {seq_id!r}: {num_tokens} tokens stored")
        if keep > len(host.free):
            raise OutOfBlocks(f"sequence {seq_id}: {keep} blocks, host tier full")
        row = self.rows[seq_id]
        for i in range(len(blocks) - 1, keep - 1, -1):
            self.table.host[row * self.table.width + i] = -1
            self.pool.decref(blocks.pop())
        self.num_tokens[seq_id] = num_tokens
        slots = [host.allocate() for _ in blocks]
        self.host_slots[seq_id], self.copying[seq_id] = slots, "store"
        return list(zip(blocks, slots))

    def offload_restore(self, seq_id: str) -> list[tuple[int, int]]:
        """New device blocks (and a row) for a stored seq_id: (host slot, device block) in logical
        order. Its host slots stay held until offload_done. Atomic: OutOfBlocks."""
        if seq_id in self.rows or seq_id not in self.host_slots or seq_id in self.copying:
            raise KeyError(f"offload_restore of {seq_id!r}: not stored out, or a copy in flight")
        slots = self.host_slots[seq_id]
        if len(slots) > len(self.pool.free) or not self._free_rows:
            raise OutOfBlocks(f"sequence {seq_id}: restoring {len(slots)} blocks, no room")
        row = self.rows[seq_id] = self._free_rows.pop()
        blocks = self.blocks[seq_id] = [self.pool.allocate() for _ in slots]
        for i, b in enumerate(blocks):
            self.table.write(row, i, b)
        self.copying[seq_id] = "restore"
        return list(zip(slots, blocks))

    def offload_done(self, seq_id: str) -> None:
        """seq_id's copy completed: a store's device blocks and row go back (the sequence is on
        the host tier alone), a restore's host slots do."""
        kind = self.copying.pop(seq_id)
        if kind == "restore":
            self._release_host(seq_id)
            return
        if self.host_frees_early is not None and self.host_frees_early(seq_id):
            for slot in self.host_slots[seq_id]:
                self.host.decref(slot)
            self._freed_early[seq_id] = set(self.host_slots[seq_id])
        blocks, row = self.blocks.pop(seq_id), self.rows.pop(seq_id)
        self.table.clear(row, len(blocks))
        for b in reversed(blocks):
            self.pool.decref(b)
        self._free_rows.append(row)

    def _release_host(self, seq_id: str) -> None:
        self.copying.pop(seq_id, None)
        given = self._freed_early.pop(seq_id, ())
        for slot in self.host_slots.pop(seq_id, ()):
            if slot not in given:
                self.host.decref(slot)

    def resize_table(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows = self.table.rows
        self.table.resize(rows or self.table.rows, width or self.table.width)
        self._free_rows[:0] = range(self.table.rows - 1, old_rows - 1, -1)

    # -- observation ---------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        snap = Snapshot(
            num_blocks=self.pool.num_blocks,
            free=list(self.pool.free),
            ref_counts=list(self.pool.ref),
            seq_blocks={s: list(b) for s, b in self.blocks.items()},
            seq_rows=dict(self.rows),
            table=self.table.host.tolist(),
            table_width=self.table.width,
            seq_tokens={s: n for s, n in self.num_tokens.items() if s in self.blocks},
        )
        if self.host is not None:
            snap.host_blocks = {s: list(v) for s, v in self.host_slots.items()}
            snap.host_free = list(self.host.free)
        return snap


class HostTierBlockManager(BlockManager):
    """The reference with a host tier of twice its device blocks ("offload"): what conformance
    (`--block-manager kvchaos.engine.block_manager:HostTierBlockManager`) drives the tier on."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int
    ) -> None:
        super().__init__(
            num_blocks, block_size, max_num_seqs, max_blocks_per_seq, host_blocks=2 * num_blocks
        )
