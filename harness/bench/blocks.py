"""Block-manager benchmarks: BlockPool and BlockManager against a bare list free pool and a short
re-implementation of nano-vllm's BlockManager (the baseline, kept here)."""

from __future__ import annotations

from collections import deque

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.config import CacheConfig
from kvchaos.harness.bench.timing import NoGC, perf, round_robin


# -- baselines ---------------------------------------------------------------------------------
class _NanoBlock:
    """nano-vllm's Block (prefix-cache fields kept, as reset() touches them)."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class _NanoSeq:
    __slots__ = ("num_tokens", "block_table")

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.block_table: list[int] = []


class NanoVllmBlockManager:
    """nano-vllm's BlockManager allocate/deallocate style, re-implemented for comparison: a deque of
    free ids (allocate takes the head, free appends to the tail), a set of used ids, Block objects
    with ref counts. may_append is its decode path without prefix-cache hashing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [_NanoBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self, block_id: int) -> _NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def allocate_one(self) -> int:
        block_id = self.free_block_ids[0]
        self._allocate_block(block_id)
        return block_id

    def free_one(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._deallocate_block(block_id)

    def allocate(self, seq: _NanoSeq) -> None:
        for _ in range(-(-seq.num_tokens // self.block_size)):
            seq.block_table.append(self.allocate_one())

    def may_append(self, seq: _NanoSeq) -> None:
        if seq.num_tokens % self.block_size == 1:  # the newest token opened a block
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            seq.block_table.append(block_id)


# -- block manager benchmarks ------------------------------------------------------------------
def bench_pool_rates(n: int, repeats: int, num_blocks: int = 65536) -> dict[str, float]:
    """Single-block allocate+free pairs per second: BlockPool, bare list, nano-vllm style."""
    pool = BlockPool(num_blocks)
    free_list = list(range(num_blocks - 1, -1, -1))
    nano = NanoVllmBlockManager(num_blocks, 16)
    loop = range(n)

    def ours() -> float:
        a, d = pool.allocate, pool.decref
        t = perf()
        for _ in loop:
            d(a())
        return perf() - t

    def bare() -> float:
        p, ap = free_list.pop, free_list.append
        t = perf()
        for _ in loop:
            ap(p())
        return perf() - t

    def nanovllm() -> float:
        a, d = nano.allocate_one, nano.free_one
        t = perf()
        for _ in loop:
            d(a())
        return perf() - t

    with NoGC():
        med = round_robin({"blockpool": ours, "list": bare, "nanovllm": nanovllm}, repeats)
    assert len(pool.free) == num_blocks and len(nano.used_block_ids) == 0
    return {k: n / v for k, v in med.items()}


def bench_pool_scale(
    n: int, repeats: int, small: int = 1_000, large: int = 1_000_000
) -> dict[str, float]:
    """Nanoseconds per pool operation at two pool sizes, each half full (blocks held by other
    sequences). `plain`: allocate, decref (frees). `shared`: allocate, incref (a fork shares it),
    decref (still referenced, not freed), allocate another, decref it, decref the first (the fork
    lets go): the pool hands out blocks while a shared prefix still references some."""
    pools = {}
    for size in (small, large):
        p = BlockPool(size)
        for _ in range(size // 2):
            p.allocate()
        pools[size] = p
    loop = range(n)

    def plain(p: BlockPool):
        def run() -> float:
            a, d = p.allocate, p.decref
            t = perf()
            for _ in loop:
                d(a())
            return (perf() - t) / (2 * n) * 1e9

        return run

    def shared(p: BlockPool):
        def run() -> float:
            a, i, d = p.allocate, p.incref, p.decref
            t = perf()
            for _ in loop:
                b = a()
                i(b)
                d(b)
                c = a()
                d(c)
                d(b)
            return (perf() - t) / (6 * n) * 1e9

        return run

    # The shared variant really re-uses blocks while the prefix holds one: check it once.
    p = pools[small]
    b = p.allocate()
    p.incref(b)
    p.decref(b)
    c = p.allocate()
    assert c != b and p.ref[b] == 1, "a block still referenced by a fork was handed out again"
    p.decref(c)
    p.decref(b)

    with NoGC():
        med = round_robin(
            {
                "plain_small": plain(pools[small]),
                "plain_large": plain(pools[large]),
                "shared_small": shared(pools[small]),
                "shared_large": shared(pools[large]),
            },
            repeats,
        )
    for size, p in pools.items():
        assert len(p.free) == size - size // 2
    return med


def bench_build(num_blocks: int, repeats: int) -> dict[str, float]:
    """Seconds to build a num_blocks BlockManager (default table shape), and a bare list free pool,
    median of `repeats` builds after one warm-up build of each."""
    cc = CacheConfig()

    def ours() -> float:
        t = perf()
        bm = BlockManager(num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq)
        dt = perf() - t
        del bm  # freeing a million ints is not part of the build
        return dt

    def bare() -> float:
        t = perf()
        free = list(range(num_blocks - 1, -1, -1))
        dt = perf() - t
        del free
        return dt

    with NoGC():
        ours(), bare()  # warm-up
        return round_robin({"blockmanager": ours, "list": bare}, repeats)


def bench_decode_bookkeeping(
    steps: int, repeats: int, num_seqs: int = 64, block_size: int = 16, prompt: int = 100
) -> dict[str, float]:
    """Microseconds per sequence per decode step of pure block bookkeeping: every sequence appends
    one token per step. Prompt lengths are staggered so block boundaries do not all coincide."""
    width = -(-(prompt + num_seqs + steps) // block_size) + 1
    num_blocks = num_seqs * width
    ids = [f"seq-{i}" for i in range(num_seqs)]

    def ours() -> float:
        bm = BlockManager(num_blocks, block_size, num_seqs, width)
        for i, s in enumerate(ids):
            bm.admit(s, range(prompt + i), prompt + i, 0)  # protocol v2; it counts tokens only
        step, tokens = bm.append_decode, [0] * num_seqs
        t = perf()
        for _ in range(steps):
            step(ids, tokens)
        dt = perf() - t
        assert bm.num_tokens[ids[-1]] == prompt + num_seqs - 1 + steps
        return dt / (steps * num_seqs) * 1e6

    def nanovllm() -> float:
        bm = NanoVllmBlockManager(num_blocks, block_size)
        seqs = [_NanoSeq(prompt + i) for i in range(num_seqs)]
        for s in seqs:
            bm.allocate(s)
        may_append = bm.may_append
        t = perf()
        for _ in range(steps):
            for s in seqs:
                s.num_tokens += 1  # the token the last step produced
                may_append(s)
        dt = perf() - t
        assert len(seqs[-1].block_table) == -(-seqs[-1].num_tokens // block_size)
        return dt / (steps * num_seqs) * 1e6

    with NoGC():
        return round_robin({"blockmanager": ours, "nanovllm": nanovllm}, repeats)
