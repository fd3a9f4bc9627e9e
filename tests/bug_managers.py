"""Block managers with one bug each, the bug's method named: what call localization must name
(scripts/localization-rate.py measures it; tests/test_localize.py holds a few)."""

from __future__ import annotations

from kvchaos.engine.block_manager import BlockManager
from kvchaos.harness.tools.canaries import AppendOffByOne, CowSharedByTwo, EvictKeepsEntry
from tests.managers import RefusalBumpsRef


class PreemptLeak(BlockManager):
    """release(seq, "preempted") drops the row and the mapping but not the blocks' refs."""

    def release(self, seq_id, reason):
        if reason != "preempted" or seq_id not in self.blocks:
            return super().release(seq_id, reason)
        blocks = self.blocks.pop(seq_id)
        row = self.rows.pop(seq_id)
        del self.num_tokens[seq_id]
        self.table.clear(row, len(blocks))
        self._free_rows.append(row)
        return True


class DoubleReleaseOnAbort(BlockManager):
    """release(seq, "aborted") drops a shared block's ref twice (the cleanup runs twice)."""

    def release(self, seq_id, reason):
        blocks = list(self.blocks.get(seq_id, ()))
        out = super().release(seq_id, reason)
        if reason == "aborted":
            for b in blocks:
                if self.pool.ref[b] > 0:
                    self.pool.decref(b)
        return out


class MissingSlot(BlockManager):
    """append_decode: a sequence crossing into a new block gets no slot for its new position
    (the table entry stays -1)."""

    def append_decode(self, seq_ids, token_ids):
        before = {s: len(self.blocks[s]) for s in seq_ids}
        copies = super().append_decode(seq_ids, token_ids)
        for s in seq_ids:
            blocks = self.blocks[s]
            if len(blocks) > before[s]:
                b = blocks.pop()
                self.table.host[self.rows[s] * self.table.width + len(blocks)] = -1
                self.pool.decref(b)
                break
        return copies


# manager -> the calls whose method holds its bug
BUGGY = {
    PreemptLeak: ("release",),
    AppendOffByOne: ("append", "admit"),  # one growth, shared by both
    DoubleReleaseOnAbort: ("release",),
    EvictKeepsEntry: ("admit",),  # the hit that trusts a stale entry
    CowSharedByTwo: ("append", "append_decode"),
    RefusalBumpsRef: ("admit", "append", "append_decode"),  # the refusing growth
    MissingSlot: ("append_decode",),
}
