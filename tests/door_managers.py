"""Block managers for the door and the boundary (tests/test_door.py): bugs the check before any
run meets (a double free on an aborted release, block ids outside the pool), a snapshot that
hands out live state (right or wrong), an append that reserves no slot for its last position, a
hit over max_computed, a manager that supports one block size, slow imports and a slow check.
Plugged in by spec, e.g. "door_managers:DoubleFreeOnAbort"."""

from __future__ import annotations

import os
import time

from managers import PlainV2

from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.protocols import Snapshot

if os.environ.get("KVCHAOS_TEST_SLOW_IMPORT"):  # an import slower than the check's limit
    time.sleep(float(os.environ["KVCHAOS_TEST_SLOW_IMPORT"]))


class DoubleFreeOnAbort(PlainV2):
    """Its first release of an aborted request raises, as a pool guard does on a double free."""

    def release(self, seq_id, reason):
        if reason == "aborted":
            raise RuntimeError("decref of free block 2 (double free)")
        return super().release(seq_id, reason)


class IdsOutsideThePool(PlainV2):
    """block_ids answers ids shifted past the pool."""

    def block_ids(self, seq_id):
        return [b + self.num_blocks for b in self.blocks[seq_id]]


class LiveSnapshot(PlainV2):
    """snapshot() hands out its live free list, ref counts, block lists and token counts."""

    def snapshot(self):
        return Snapshot(
            len(self.ref), self.free, self.ref, self.blocks, seq_tokens=self.tokens, reserved=[0]
        )


class LiveSnapshotLeaks(LiveSnapshot):
    """... and release keeps every sequence's last block: a real leak, to be caught."""

    def release(self, seq_id, reason):
        if seq_id not in self.blocks:
            return False
        blocks = self.blocks.pop(seq_id)
        for b in reversed(blocks[:-1]):
            self.ref[b] = 0
            self.free.append(b)
        del self.tokens[seq_id]
        return True


class SkipsLastSlot(PlainV2):
    """append reserves slots for one token fewer than it is given: a decode token that opens a
    new block gets no block, and its table entry stays -1."""

    def append(self, seq_id, token_ids):
        blocks, n = self.blocks[seq_id], len(token_ids)
        need = -(-(self.tokens[seq_id] + n - 1) // self.block_size) - len(blocks)
        for _ in range(max(0, need)):
            b = self.free.pop()
            self.ref[b] = 1
            blocks.append(b)
        self.tokens[seq_id] += n
        return []

    def snapshot(self):
        snap = super().snapshot()
        snap.seq_tokens = None  # its count of tokens is right; its slots are not
        return snap


class HitsOverTheCap(PrefixCachingManager):
    """A hit answers every known token, past max_computed (a full-prompt hit)."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        h = super().admit(seq_id, token_ids, num_new_tokens, max_computed)
        return len(token_ids) if h else 0


class OnlySixteen(PlainV2):
    """Supports block size 16 alone, and says so; it breaks at any other."""

    block_sizes = (16,)

    def __init__(self, num_blocks, block_size, *rest) -> None:
        if block_size != 16:
            raise AssertionError(f"block size {block_size}: only 16 is supported")
        super().__init__(num_blocks, block_size, *rest)


class SlowCheck(PlainV2):
    """Its snapshot takes two seconds: a check slower than a 1 s limit."""

    def snapshot(self):
        time.sleep(2)
        return super().snapshot()
