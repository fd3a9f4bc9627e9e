"""Block managers whose outputs are right and whose throughput is not: the bugs only the
performance findings see (harness/check/performance.py). Plugged in by spec, e.g.
"perf_managers:OvercountsEstimate"."""

from __future__ import annotations

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager


class OvercountsEstimate(BlockManager):
    """blocks_needed counts a partly filled last block as full (`have // bs` where the blocks held
    are `ceil(have / bs)`): every estimate for a sequence mid-block asks one block too many, and
    its own room check refuses on it. Growth itself takes the right blocks."""

    def blocks_needed(self, seq_id, num_new_tokens):
        bs = self.block_size
        have = self.num_tokens.get(seq_id, 0)
        need = -(-(have + num_new_tokens) // bs) - have // bs
        blocks = self.blocks.get(seq_id)
        if blocks and have % bs and self.pool.ref[blocks[-1]] > 1 and num_new_tokens:
            need += 1
        return need


class _MostRecentFirst(PrefixBlockPool):
    """allocate hands out the most recently freed block, not the least: the tail of the free
    queue, where a finished request's prefix (its first block freed last) has just gone."""

    def allocate(self) -> int:
        if not self.num_free:
            raise OutOfBlocks("no free block")
        b = self._prev[self.num_blocks]  # the sentinel's prev: the queue's tail
        self._unlink(b)
        k = self.key[b]
        if k is not None:
            del self.cache[k]
            self.key[b] = self.parent[b] = self.tokens[b] = None
        self.ref[b] = 1
        return b


class EvictsMostRecent(PrefixCachingManager):
    """The reference prefix cache evicting the most recently freed cached block (MRU) instead of
    the least: every hit it serves is right, it serves fewer."""

    def __init__(self, num_blocks, block_size, *_) -> None:
        super().__init__(num_blocks, block_size, pool=_MostRecentFirst(num_blocks, block_size))
