"""Block managers written as a user would: behaviours real managers have (preallocation, refusals
under pressure, a watermark) and bugs they ship (rows left behind, crashes, a refusal that leaves
a trace). Plugged in by spec, e.g. "managers:Preallocating". Every one speaks protocol v2:
Delegate and its subclasses forward to the reference BlockManager, others subclass it, and PlainV2
is written from scratch."""

from __future__ import annotations

import os
import random
import signal
import sys
import time

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.protocols import Snapshot

HIDDEN = "__reserve__"  # a manager's own holder of preallocated blocks


def reserve(bm: BlockManager, seq_id: str, n: int) -> list[tuple[int, int]]:
    """Slots for n more tokens of seq_id on the reference (admitted when new): it counts tokens,
    so any n ids do."""
    if seq_id in bm.rows:
        return bm.append(seq_id, range(n))
    bm.admit(seq_id, range(n), n, 0)
    return []


class Delegate:
    """Protocol v2, forwarded to the reference manager, with every growth (admit or append) one
    call of `grow`: the managers below change what it does. No batched decode, so each decode is
    an append of its own and meets the same rules."""

    kvchaos_protocol = 2
    capabilities = frozenset({"fork", "seq_tokens", "estimates", "own_table"})

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

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.grow(seq_id, min(num_new_tokens, len(token_ids)))
        return 0  # no prefix cache

    def append(self, seq_id, token_ids):
        return self.grow(seq_id, len(token_ids))

    def grow(self, seq_id, n):
        self.calls += 1
        return reserve(self.inner, seq_id, n)

    def block_ids(self, seq_id):
        return self.inner.block_ids(seq_id)

    def fork(self, parent_id, child_id):
        self.inner.fork(parent_id, child_id)

    def release(self, seq_id, reason):
        return self.inner.release(seq_id, reason)

    def resize_table(self, rows=None, width=None):
        self.inner.resize_table(rows, width)

    def snapshot(self):
        return self.inner.snapshot()


class Preallocating(Delegate):
    """Takes more blocks than blocks_needed said: every growth also tops up a reserve of spare
    blocks (held by the manager's own sequence), given back when the pool runs low."""

    SPARE = 2

    def grow(self, seq_id, n):
        self.calls += 1
        try:
            copies = reserve(self.inner, seq_id, n)
        except OutOfBlocks:
            spare = len(self.inner.blocks.get(HIDDEN, []))
            if self.inner.blocks_needed(seq_id, n) > self.inner.num_free_blocks + spare:
                raise  # even the reserve would not do: refuse, changing nothing
            self.inner.release(HIDDEN, "aborted")  # the reserve goes first, then the request
            return reserve(self.inner, seq_id, n)
        have = len(self.inner.blocks.get(HIDDEN, []))
        if have < self.SPARE and self.inner.num_free_blocks > 8 and self.inner.num_free_rows > 1:
            try:
                reserve(self.inner, HIDDEN, self.block_size * (self.SPARE - have))
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

    def grow(self, seq_id, n):
        self.calls += 1
        if self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.rng.random() < 0.3:
            raise OutOfBlocks(f"{seq_id}: not now")
        return reserve(self.inner, seq_id, n)


class Watermark(Delegate):
    """Admits a new sequence only while a tenth of the pool would stay free: refuses with room."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        n = min(num_new_tokens, len(token_ids))
        left = self.inner.num_free_blocks - self.inner.blocks_needed(seq_id, n)
        if left < self.inner.num_blocks // 10:
            raise OutOfBlocks(f"{seq_id}: under the watermark")
        return super().admit(seq_id, token_ids, num_new_tokens, max_computed)


class NoFork(Delegate):
    """Shares nothing: every fork is refused (a prefix cache serves parallel samples instead)."""

    def fork(self, parent_id, child_id):
        raise OutOfBlocks("this manager does not fork")


class TracedRefusal(Delegate):
    """A refusal that leaves a trace: when it says no, it has already taken a block."""

    def grow(self, seq_id, n):
        self.calls += 1
        if self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.calls % 5 == 0:
            self.inner.pool.allocate()  # taken, never given back
            raise OutOfBlocks(f"{seq_id}: not now")
        return reserve(self.inner, seq_id, n)


class LeavesRowsBehind(BlockManager):
    """release() gives the blocks back but leaves their ids in the table row."""

    def release(self, seq_id, reason):
        row, blocks = self.rows.get(seq_id), list(self.blocks.get(seq_id, []))
        done = super().release(seq_id, reason)
        w = self.table.width
        for i, b in enumerate(blocks[:w]):
            self.table.host[row * w + i] = b
        return done


class KeepsRefsOnPreempt(BlockManager):
    """release(seq, "preempted") drops the sequence and its row, but not its blocks' refs: a
    preempted request's blocks stay referenced by no one."""

    def release(self, seq_id, reason):
        if reason != "preempted" or seq_id not in self.blocks:
            return super().release(seq_id, reason)
        blocks = self.blocks.pop(seq_id)
        del self.num_tokens[seq_id]
        row = self.rows.pop(seq_id)
        self.table.clear(row, len(blocks))
        self._free_rows.append(row)
        return True


class AdmitAnswersPastItsTokens(BlockManager):
    """admit answers more computed tokens than it was given (the boundary's BadAnswer)."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        return super().admit(seq_id, token_ids, num_new_tokens, max_computed) + len(token_ids) + 1


class DoubleFreeGuard(BlockManager):
    """The pool's guard fires on the tenth release: "decref of free block (double free)"."""

    frees = 0

    def release(self, seq_id, reason):
        self.frees += 1
        if self.frees == 10:
            raise RuntimeError("decref of free block (double free)")
        return super().release(seq_id, reason)


class IndexErrorOnGrowth(BlockManager):
    """An off-by-one deep in growth: IndexError on the 15th admission or append."""

    appends = 0

    def _grow(self, seq_id, n):
        self.appends += 1
        if self.appends == 15:
            return [][1]
        return super()._grow(seq_id, n)


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

    def append(self, seq_id, token_ids):
        blocks, b, saved = self.blocks.get(seq_id), None, 0
        if blocks and self.num_tokens[seq_id] % self.block_size:
            b = blocks[-1]
            saved, self.pool.ref[b] = self.pool.ref[b], 1
        try:
            return super().append(seq_id, token_ids)
        finally:
            if b is not None:
                self.pool.ref[b] = saved


class WithoutFork(Delegate):
    """Has no fork at all and declares nothing beyond the core protocol (so the engine builds its
    table from block_ids): parallel samples are fresh requests."""

    fork = None
    capabilities = frozenset()


class RefusalBumpsRef(Delegate):
    """A refusal that leaves a trace the free count cannot show: it bumps a held block's ref."""

    def grow(self, seq_id, n):
        self.calls += 1
        held = [b for bs in self.inner.blocks.values() for b in bs]
        if held and self.inner.num_free_blocks < self.inner.num_blocks // 4 and self.calls % 5 == 0:
            self.inner.pool.incref(held[0])  # one more holder nobody will release
            raise OutOfBlocks(f"{seq_id}: not now")
        return reserve(self.inner, seq_id, n)


# -- managers that hang or end the process (tests/test_isolation.py) --------------------------


def _hang() -> None:
    marks = os.environ.get("KVCHAOS_TEST_HANGS")
    if marks:  # the hang has begun (tests/test_isolation.py's clock waits for this)
        open(os.path.join(marks, str(os.getpid())), "w").close()
    while True:  # loops forever; sleeps, so a hung run does not take a core from the others
        time.sleep(0.01)


def _hang_deaf() -> None:
    """A hang the worker's stop signal cannot reach (as one deep in C code): only a kill ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    _hang()


FATE = {
    "hang": _hang,
    "deaf": _hang_deaf,
    "exit": lambda: os._exit(0),
    "segfault": lambda: os.kill(os.getpid(), signal.SIGSEGV),
    "sys.exit": lambda: sys.exit(0),
    "sigkill": lambda: os.kill(os.getpid(), signal.SIGKILL),  # as the OOM killer does
}


class Fated(LeavesRowsBehind):
    """Leaves rows behind after release (table_integrity finds it from step 14 of baseline-clean
    seed 0), then meets its FATE in the first growth (admit or append) of several tokens after
    its 6th release (admit('r9', [...], 35, 34) at step 21 there): inside the call, or (OUTSIDE)
    in the engine's next step."""

    FATE, OUTSIDE = "hang", False
    frees = 0

    def release(self, seq_id, reason):
        self.frees += 1
        return super().release(seq_id, reason)

    def _grow(self, seq_id, n):
        if self.frees >= 6 and n > 1:
            fate = FATE[self.FATE]
            if not self.OUTSIDE:
                fate()
            Engine.step = lambda engine: fate()  # this process only: a fresh worker per run
        return super()._grow(seq_id, n)


class HangsInAdmit(Fated):
    pass


class DeafHangInAdmit(Fated):
    FATE = "deaf"


class ExitsInAdmit(Fated):
    FATE = "exit"


class SegfaultsInAdmit(Fated):
    FATE = "segfault"


class KilledInAdmit(Fated):
    FATE = "sigkill"


class SysExitsInAdmit(Fated):
    FATE = "sys.exit"


class HangsInTheEngine(Fated):
    OUTSIDE = True


class ExitsInTheEngine(Fated):
    FATE, OUTSIDE = "exit", True


_RUNS_IN_THIS_PROCESS = 0  # module-level state: what a fresh worker per run starts again from


class CountsRunsInItsModule(Delegate):
    """Counts its instances in its module; from the second in one process on, release() keeps the
    blocks (a leak the run's checkers find, a smoke test of the calls' answers does not)."""

    def __init__(self, *a) -> None:
        global _RUNS_IN_THIS_PROCESS
        super().__init__(*a)
        _RUNS_IN_THIS_PROCESS += 1
        self.nth = _RUNS_IN_THIS_PROCESS

    def release(self, seq_id, reason):
        return True if self.nth > 1 else super().release(seq_id, reason)


class OrdersItsPoolByHash(Delegate):
    """Hands out blocks in the order of their names' string hashes: the same in every process
    only when PYTHONHASHSEED is fixed."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.inner.pool.free.sort(key=lambda b: hash(f"block-{b}"))


class ShufflesItsPool(Delegate):
    """Hands out blocks in a random order of its own, unseeded: nondeterministic."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        random.SystemRandom().shuffle(self.inner.pool.free)


class WaitsForCtrlC(Delegate):
    """At its sixth growth (the door's smoke test makes four) it marks the file
    $KVCHAOS_TEST_MARK names and waits inside the call: the test then presses Ctrl-C on the
    runner."""

    def grow(self, seq_id, n):
        if self.calls == 5:
            open(os.environ["KVCHAOS_TEST_MARK"], "w").close()
            time.sleep(30)  # the runner's word (SIGUSR2) reaches the worker here
        return super().grow(seq_id, n)


class SharesFullBlocksOnly(Delegate):
    """Prefix-cache style: shares full blocks only and never copies on write, so a fork whose
    parent's last block is partly filled is refused (the engine runs the child fresh)."""

    def fork(self, parent_id, child_id):
        if self.inner.num_tokens[parent_id] % self.block_size:
            raise OutOfBlocks(f"{parent_id}: its last block is partly filled; no copy-on-write")
        self.inner.fork(parent_id, child_id)


class HidesSharing(BlockManager):
    """Its snapshot lies: every held block has ref count 1, shared or not."""

    def snapshot(self):
        snap = super().snapshot()
        snap.ref_counts = [min(r, 1) for r in snap.ref_counts]
        return snap


class NoRollback(Delegate):
    """Growth is not atomic: it takes blocks one at a time and, when the pool runs dry, refuses
    with the blocks it took still attached to the sequence."""

    def grow(self, seq_id, n):
        self.calls += 1
        inner = self.inner
        if seq_id in inner.rows and inner.blocks_needed(seq_id, n) > inner.num_free_blocks:
            blocks, row = inner.blocks[seq_id], inner.rows[seq_id]
            while inner.num_free_blocks and len(blocks) < inner.table.width:
                blocks.append(inner.pool.allocate())
                inner.table.write(row, len(blocks) - 1, blocks[-1])
            raise OutOfBlocks(f"{seq_id}: the pool ran dry")
        return reserve(self.inner, seq_id, n)


class HangsWhenBuilt(BlockManager):
    """Never returns from its constructor: the check before any run must not hang kvchaos."""

    def __init__(self, *a) -> None:
        _hang()


class ExitsWhenBuilt(BlockManager):
    def __init__(self, *a) -> None:
        os._exit(3)


# -- protocol v2 (kvchaos_protocol = 2) ---------------------------------------------------------
class PlainV2:
    """Protocol v2 as a user's first manager: no prefix cache (admit answers 0), no fork, no
    table (the engine builds it from block_ids), block 0 reserved as vLLM reserves its null block.
    A refusal changes nothing; release is idempotent."""

    kvchaos_protocol = 2
    capabilities = frozenset({"seq_tokens"})
    reserved_blocks = (0,)

    def __init__(self, num_blocks, block_size, max_num_seqs=None, max_blocks_per_seq=None):
        self.block_size = block_size
        self.ref = [0] * num_blocks
        # pop() hands out low ids first
        self.free = [b for b in range(num_blocks - 1, -1, -1) if b not in self.reserved_blocks]
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.ref)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _grow(self, seq_id, n) -> None:
        blocks = self.blocks[seq_id]
        need = -(-(self.tokens[seq_id] + n) // self.block_size) - len(blocks)
        if need > len(self.free):
            raise OutOfBlocks(f"{seq_id}: needs {need} blocks, {len(self.free)} free")
        for _ in range(need):
            b = self.free.pop()
            self.ref[b] = 1
            blocks.append(b)
        self.tokens[seq_id] += n

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.blocks[seq_id], self.tokens[seq_id] = [], 0
        try:
            self._grow(seq_id, min(num_new_tokens, len(token_ids)))
        except OutOfBlocks:
            del self.blocks[seq_id], self.tokens[seq_id]
            raise
        return 0

    def append(self, seq_id, token_ids):
        self._grow(seq_id, len(token_ids))
        return []

    def block_ids(self, seq_id):
        return self.blocks[seq_id]

    def release(self, seq_id, reason):
        if seq_id not in self.blocks:
            return False
        for b in reversed(self.blocks.pop(seq_id)):
            self.ref[b] = 0
            self.free.append(b)
        del self.tokens[seq_id]
        return True

    def snapshot(self) -> Snapshot:
        return Snapshot(
            len(self.ref),
            list(self.free),
            list(self.ref),
            {s: list(b) for s, b in self.blocks.items()},
            seq_tokens=dict(self.tokens),
            reserved=list(self.reserved_blocks),
        )


class HandsOutNullBlock(PlainV2):
    """Declares block 0 reserved, then hands it out first (its free list forgot the rule)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.free.append(0)


# -- prefix caches (tests/test_kv_record.py) ----------------------------------------------------
class _TrustsParentKeys(PrefixBlockPool):
    """Past the verified match, serves one more block keyed under the match's last key, whatever
    its tokens: the first block another request wrote after a shared template."""

    def match_prefix(self, token_ids):
        blocks, bs = super().match_prefix(token_ids), self.block_size
        if blocks and (len(blocks) + 1) * bs <= len(token_ids):
            k = self.key[blocks[-1]]
            extra = next(
                (b for b, p in enumerate(self.parent) if p == k and self.key[b] is not None), None
            )
            if extra is not None:
                blocks.append(extra)
        return blocks


class HitPastItsMatch(PrefixCachingManager):
    """The reference prefix cache on a pool that trusts a parent key alone for one block past
    its match: a request sharing a template with an earlier one reads that one's KV for other
    tokens (the earlier one only holds it, or held it)."""

    def __init__(self, num_blocks, block_size, *_) -> None:
        super().__init__(num_blocks, block_size, pool=_TrustsParentKeys(num_blocks, block_size))
