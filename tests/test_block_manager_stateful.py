"""kvchaos.engine.block_manager.BlockManager as a Hypothesis state machine.

A model keeps each live sequence's token count; the rules start, grow (append and the batched
append_decode), fork, free (live, dead and unknown ids), cancel (free mid-way through a `hold()`
block), resize the table, and provoke OutOfBlocks / TableOverflow, which must leave the manager
exactly as it was. After every rule the invariants I1-I4 of block_manager.py are checked, plus the
block count of each sequence, the ownership of table rows and the free-row count.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.errors import OutOfBlocks, TableOverflow


class Interrupted(BaseException):
    """Not an Exception: hold() must free on every exit path, not only on errors."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def state_of(bm: BlockManager) -> dict:
    """Everything a failed call must leave untouched (the snapshot plus private bookkeeping)."""
    d = bm.snapshot().to_dict()
    d["num_tokens"] = dict(bm.num_tokens)
    d["free_rows"] = list(bm._free_rows)
    d["rows_x_width"] = (bm.table.rows, bm.table.width)
    return d


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.tokens: dict[str, int] = {}  # the model: live sequence -> token count
        self.dead: list[str] = []
        self.next_id = 0
        self.seen_cow = 0
        self.seen_errors = {"oob": 0, "overflow": 0}

    # -- helpers -------------------------------------------------------------------------
    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def pick(self, i: int) -> str:
        live = sorted(self.tokens)
        return live[i % len(live)]

    def last_shared(self, s: str) -> bool:
        bl = self.bm.blocks[s]
        return bool(bl) and self.bm.pool.ref[bl[-1]] > 1

    def expected_need(self, s: str | None, n: int) -> int:
        """Blocks append(s, n) must take, from the model (not from the manager's own arithmetic)."""
        bs = self.bm.block_size
        have = self.tokens.get(s, 0) if s is not None else 0
        need = cdiv(have + n, bs) - cdiv(have, bs)
        if s is not None and n and have % bs and self.last_shared(s):
            need += 1  # copy-on-write of the shared, partly filled last block
        return need

    def expect_atomic_failure(self, exc, fn, *args):
        before = state_of(self.bm)
        with pytest.raises(exc):
            fn(*args)
        assert state_of(self.bm) == before, f"{fn.__name__}{args} raised but changed the manager"

    # -- rules ---------------------------------------------------------------------------
    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.integers(2, 4),
        rows=st.integers(2, 5),
        width=st.integers(2, 6),
    )
    def setup(self, num_blocks, block_size, rows, width):
        self.bm = BlockManager(num_blocks, block_size, rows, width)

    @rule(n=st.integers(0, 12))
    def start(self, n):
        bm, s = self.bm, self.new_id()
        need = self.expected_need(None, n)
        assert bm.blocks_needed(s, n) == need
        oob = need > bm.num_free_blocks or bm.num_free_rows == 0
        overflow = need > bm.table.width
        if oob or overflow:
            exc = (
                OutOfBlocks
                if not overflow
                else TableOverflow
                if not oob
                else (OutOfBlocks, TableOverflow)
            )
            self.expect_atomic_failure(exc, bm.append, s, n)
            self.seen_errors["oob" if oob else "overflow"] += 1
            return
        assert bm.append(s, n) == []
        self.tokens[s] = n

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100), n=st.integers(0, 9))
    def append(self, i, n):
        self.do_append(self.pick(i), n)

    def do_append(self, s, n):
        bm = self.bm
        have, bs = self.tokens[s], bm.block_size
        need = self.expected_need(s, n)
        assert bm.blocks_needed(s, n) == need
        oob = need > bm.num_free_blocks
        overflow = need > 0 and cdiv(have + n, bs) > bm.table.width
        if oob or overflow:
            exc = (
                OutOfBlocks
                if not overflow
                else TableOverflow
                if not oob
                else (OutOfBlocks, TableOverflow)
            )
            self.expect_atomic_failure(exc, bm.append, s, n)
            self.seen_errors["oob" if oob else "overflow"] += 1
            return
        old = list(bm.blocks[s])
        old_ref = list(bm.pool.ref)
        cow = bool(n and have % bs and self.last_shared(s))
        copies = bm.append(s, n)
        new = bm.blocks[s]
        if cow:
            src, dst = old[-1], new[len(old) - 1]
            assert copies == [(src, dst)]
            assert dst != src and bm.pool.ref[dst] == 1 and old_ref[dst] == 0, (
                "copy target must be fresh"
            )
            assert bm.pool.ref[src] == old_ref[src] - 1
            assert new[: len(old) - 1] == old[:-1]
            self.seen_cow += 1
        else:
            assert copies == []
            assert new[: len(old)] == old, "existing blocks must not move"
        for b in new[len(old) :]:
            assert old_ref[b] == 0 and bm.pool.ref[b] == 1, "new blocks come from the free pool"
        self.tokens[s] = have + n

    @precondition(lambda self: self.tokens)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=5))
    def append_decode(self, picks):
        self.append_decode_batch(list(dict.fromkeys(self.pick(i) for i in picks)))

    def append_decode_batch(self, batch):
        bm, bs = self.bm, self.bm.block_size
        overflow = any(
            self.tokens[s] % bs == 0 and len(bm.blocks[s]) >= bm.table.width for s in batch
        )
        # Exact need, applying the batch in order (one side's copy-on-write unshares the other).
        ref = list(bm.pool.ref)
        exact, will_cow = 0, []
        for s in batch:
            bl = bm.blocks[s]
            if self.tokens[s] % bs == 0:
                exact += 1
            elif ref[bl[-1]] > 1:
                exact += 1
                ref[bl[-1]] -= 1
                will_cow.append(s)
        upper = sum(bm.blocks_needed(s, 1) for s in batch)
        free = bm.num_free_blocks
        if overflow or exact > free:
            exc = (
                TableOverflow
                if exact <= free
                else OutOfBlocks
                if not overflow
                else (OutOfBlocks, TableOverflow)
            )
            self.expect_atomic_failure(exc, bm.append_decode, batch)
            self.seen_errors["overflow" if overflow else "oob"] += 1
            return
        before = state_of(bm)
        old = {s: list(bm.blocks[s]) for s in batch}
        try:
            copies = bm.append_decode(batch)
        except OutOfBlocks:
            # Allowed only where the manager's conservative count (sum of blocks_needed) says it
            # might run dry; and then it must be atomic.
            assert upper > free and len(batch) > free
            assert state_of(bm) == before
            return
        assert [c[0] for c in copies] == [old[s][-1] for s in will_cow]
        for (src, dst), s in zip(copies, will_cow):
            assert bm.blocks[s][-1] == dst and bm.pool.ref[dst] == 1
        self.seen_cow += len(copies)
        for s in batch:
            self.tokens[s] += 1

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        self.do_fork(i)

    def do_fork(self, i):
        bm, parent = self.bm, self.pick(i)
        child = self.new_id()
        if bm.num_free_rows == 0:
            self.expect_atomic_failure(OutOfBlocks, bm.fork, parent, child)
            return None
        old_ref = list(bm.pool.ref)
        bm.fork(parent, child)
        assert bm.blocks[child] == bm.blocks[parent]
        for b in bm.blocks[parent]:
            assert bm.pool.ref[b] == old_ref[b] + 1
        self.tokens[child] = self.tokens[parent]
        return parent, child

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100), child_side=st.booleans(), n=st.integers(1, 5), batch=st.booleans())
    def fork_then_write(self, i, child_side, n, batch):
        """Fork, then write to one side at once: copy-on-write when the last block is partial."""
        forked = self.do_fork(i)
        if forked is None:
            return
        side = forked[child_side]
        if batch:
            self.append_decode_batch([side, forked[not child_side]][: n % 2 + 1])
        else:
            self.do_append(side, n)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100))
    def free_live(self, i):
        s = self.pick(i)
        assert self.bm.free(s) is True
        del self.tokens[s]
        self.dead.append(s)

    @rule(i=st.integers(0, 100), unknown=st.booleans())
    def free_dead_or_unknown(self, i, unknown):
        s = "never-seen" if unknown or not self.dead else self.dead[i % len(self.dead)]
        before = state_of(self.bm)
        assert self.bm.free(s) is False
        assert state_of(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6))
    def cancel(self, i, n):
        """A cancel mid-way: the sequence's owner grows it inside hold() and is interrupted."""
        bm, s = self.bm, self.pick(i)
        with pytest.raises(Interrupted):
            with bm.hold(s):
                try:
                    bm.append(s, n)
                    self.tokens[s] += n
                except (OutOfBlocks, TableOverflow):
                    pass
                raise Interrupted
        assert s not in bm.blocks and s not in bm.rows
        del self.tokens[s]
        self.dead.append(s)

    @rule(more_rows=st.integers(0, 2), more_width=st.integers(0, 3))
    def resize(self, more_rows, more_width):
        bm = self.bm
        rows, width = bm.table.rows, bm.table.width
        free_rows = bm.num_free_rows
        bm.resize_table(rows=rows + more_rows, width=width + more_width)
        assert (bm.table.rows, bm.table.width) == (rows + more_rows, width + more_width)
        assert bm.num_free_rows == free_rows + more_rows

    @precondition(lambda self: self.bm is not None and self.bm.table.width > 1)
    @rule()
    def shrink_refused(self):
        bm = self.bm
        self.expect_atomic_failure(ValueError, bm.resize_table, bm.table.rows, bm.table.width - 1)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def accounting(self):
        bm = self.bm
        if bm is None:
            return
        snap = bm.snapshot()
        free, ref, n = snap.free, snap.ref_counts, snap.num_blocks
        assert len(free) == len(set(free)), "duplicate in the free list"
        referenced = [b for b in range(n) if ref[b] > 0]
        assert len(free) + len(referenced) == n  # I1
        assert all(ref[b] == 0 for b in free)  # I3
        holders = [0] * n
        for bl in snap.seq_blocks.values():
            assert len(bl) == len(set(bl)), "a sequence holds a block twice"
            for b in bl:
                holders[b] += 1
        assert holders == ref  # I2
        assert bm.num_free_blocks == len(free)

    @invariant()
    def sequences_and_table(self):
        bm = self.bm
        if bm is None:
            return
        snap = bm.snapshot()
        w, bs = snap.table_width, bm.block_size
        assert set(snap.seq_blocks) == set(self.tokens) == set(snap.seq_rows) == set(bm.num_tokens)
        assert len(set(snap.seq_rows.values())) == len(snap.seq_rows), "two sequences share a row"
        for s, count in self.tokens.items():
            assert bm.num_tokens[s] == count
            assert len(snap.seq_blocks[s]) == cdiv(count, bs)
            r = snap.seq_rows[s]
            bl = snap.seq_blocks[s]
            assert snap.table[r * w : (r + 1) * w] == bl + [-1] * (w - len(bl))  # I4
        owned = set(snap.seq_rows.values())
        for r in range(bm.table.rows):
            if r not in owned:
                assert snap.table[r * w : (r + 1) * w] == [-1] * w, f"unowned row {r} is not empty"
        assert len(snap.table) == bm.table.rows * w
        assert bm.num_free_rows == bm.table.rows - len(self.tokens)
        assert sorted(bm._free_rows + list(owned)) == list(range(bm.table.rows))
        assert bm.table.overflow_writes == 0


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- plain unit tests ------------------------------------------------------------------------
def test_hold_frees_on_exception():
    bm = BlockManager(8, 4, 2, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with bm.hold("a") as sid:
            assert sid == "a"
            bm.append("a", 9)
            assert bm.num_free_blocks == 5
            raise RuntimeError("boom")
    assert bm.num_free_blocks == 8 and "a" not in bm.blocks and bm.num_free_rows == 2
    assert bm.table.host.tolist() == [-1] * 8
    with bm.hold("b"):  # and on a normal exit too
        bm.append("b", 1)
    assert bm.num_free_blocks == 8 and bm.free("b") is False


def test_double_decref_raises():
    pool = BlockPool(4)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(b)
    assert pool.free.count(b) == 1 and pool.ref[b] == 0
    with pytest.raises(ValueError):
        pool.incref(b)


def test_pool_allocation_order_and_exhaustion():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OutOfBlocks):
        pool.allocate()


@pytest.mark.parametrize("writer", ["parent", "child"])
def test_fork_copy_on_write(writer):
    bm = BlockManager(16, 4, 4, 8)
    bm.append("p", 6)  # blocks [0, 1]; block 1 half full
    bm.fork("p", "c")
    shared = list(bm.blocks["p"])
    assert bm.blocks["c"] == shared and [bm.pool.ref[b] for b in shared] == [2, 2]
    other = "c" if writer == "parent" else "p"
    w = "p" if writer == "parent" else "c"
    assert bm.blocks_needed(w, 1) == 1
    copies = bm.append(w, 1)
    fresh = bm.blocks[w][-1]
    assert copies == [(shared[1], fresh)] and fresh not in shared
    assert bm.blocks[w] == [shared[0], fresh] and bm.blocks[other] == shared
    assert bm.pool.ref[shared[0]] == 2 and bm.pool.ref[shared[1]] == 1 and bm.pool.ref[fresh] == 1
    # the other side now owns its last block alone: no copy for it
    assert bm.append(other, 1) == [] and bm.blocks[other] == shared
    # and through the decode path, a full shared block needs no copy either
    bm.append("p", 1), bm.append("c", 1)  # both at 8 tokens: last blocks full
    bm.fork("p", "d")
    assert bm.append_decode(["p", "d"]) == []
    assert bm.blocks["p"][:2] == bm.blocks["d"][:2] and bm.blocks["p"][2] != bm.blocks["d"][2]


def test_append_decode_cow_through_fast_path():
    bm = BlockManager(16, 4, 4, 8)
    bm.append("p", 5)
    bm.fork("p", "c")
    src = bm.blocks["p"][1]
    copies = bm.append_decode(["p", "c"])
    assert copies == [
        (src, bm.blocks["p"][1])
    ]  # the first side copies; the second then owns src alone
    assert bm.blocks["c"][1] == src and bm.pool.ref[src] == 1


def test_table_overflow_is_atomic_for_new_sequence_and_decode_batch():
    bm = BlockManager(16, 2, 3, 2)
    bm.append("a", 2)
    bm.append("b", 4)  # row full
    before = state_of(bm)
    with pytest.raises(TableOverflow):
        bm.append_decode(["a", "b"])  # "a" would fit; the batch fails as a whole
    with pytest.raises(TableOverflow):
        bm.append("new", 5)
    with pytest.raises(TableOverflow):
        bm.append("b", 1)
    assert state_of(bm) == before
    bm.resize_table(width=3)
    assert bm.append_decode(["a", "b"]) == [] and bm.num_tokens == {"a": 3, "b": 5}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), bs=st.integers(1, 5))
def test_blocks_needed_matches_append(n, bs):
    bm = BlockManager(64, bs, 2, 64)
    need = bm.blocks_needed("x", n)
    bm.append("x", n)
    assert need == cdiv(n, bs) == 64 - bm.num_free_blocks
