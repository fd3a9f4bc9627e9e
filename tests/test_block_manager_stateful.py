"""kvchaos.engine.block_manager.BlockManager as a Hypothesis state machine: the protocol v2
conformance suite every v2 manager faces (kvchaos.harness.conformance.v2: answers, refusals
change nothing, every computed position reads its own KV through the table, copy-on-write,
release reasons, each snapshot's integrity, table rows, resize keeps every row, append_decode all
or nothing), on a table narrower than the pool, plus what only the reference promises: a refusal
only without room, the exact block count and blocks_needed of each sequence, the invariants I1-I5
of block_manager.py, its private bookkeeping (token counts, free rows), cancel through `hold()`,
and TableOverflow / a narrowing resize refused without a trace.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import consumes, initialize, invariant, precondition, rule

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.boundary import describe
from kvchaos.engine.errors import OutOfBlocks, TableOverflow
from kvchaos.engine.protocols import capabilities
from kvchaos.engine.tables import OwnedTable
from kvchaos.harness.conformance.v2 import ConformanceMachineV2

SEQS, RELEASED = ConformanceMachineV2.seqs, ConformanceMachineV2.released


class Interrupted(BaseException):
    """Not an Exception: hold() must release on every exit path, not only on errors."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def state_of(bm: BlockManager) -> dict:
    """Everything a failed call must leave untouched (the snapshot plus private bookkeeping)."""
    d = bm.snapshot().to_dict()
    d["num_tokens"] = dict(bm.num_tokens)
    d["free_rows"] = list(bm._free_rows)
    d["rows_x_width"] = (bm.table.rows, bm.table.width)
    return d


class ReferenceMachine(ConformanceMachineV2):
    factory = BlockManager

    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.sampled_from((1, 2, 4)),
        rows=st.integers(2, 5),
        width=st.integers(2, 6),
    )
    def setup(self, num_blocks, block_size, rows, width):
        """A table narrower than the pool (the suite's own is as wide): rows and width matter."""
        self.num_blocks, self.bs = num_blocks, block_size
        self.bm = type(self).factory(num_blocks, block_size, rows, width)
        self.caps, self.reserved = capabilities(self.bm), set()
        self.table = OwnedTable(self.bm)
        self.check_snapshot()

    def fits(self, tokens: int) -> bool:
        """... and within a row: the engine refuses (or resizes for) a longer request."""
        return super().fits(tokens) and cdiv(tokens, self.bs) <= self.bm.table.width

    def answer(self, name: str, *args, refusable: bool = False):
        """Each call as the suite makes it; a refusal only when the pool (or the rows) cannot
        cover what the call needs."""
        bm = self.bm
        free, rows = bm.num_free_blocks, bm.num_free_rows
        need = {
            "admit": lambda s, toks, n, _: cdiv(min(n, len(toks)), self.bs),
            "append": lambda s, toks: self.expected_need(s, len(toks)),
            "append_decode": lambda seqs, _: sum(self.expected_need(s, 1) for s in seqs),
            "fork": lambda parent, child: 0,
        }.get(name)
        want = need(*args) if need else 0
        try:
            return super().answer(name, *args, refusable=refusable)
        except OutOfBlocks:
            no_row = name in ("admit", "fork") and rows == 0
            assert want > free or no_row, f"{describe(name, args)} refused with room ({free})"
            raise

    def expect_atomic_failure(self, exc, fn, *args):
        before = state_of(self.bm)
        with pytest.raises(exc):
            fn(*args)
        assert state_of(self.bm) == before, f"{fn.__name__}{args} raised but changed the manager"

    # -- the reference's own rules -------------------------------------------------------------
    @rule(target=RELEASED, seq=consumes(SEQS), n=st.integers(1, 6))
    def cancel(self, seq, n):
        """A cancel mid-way: the sequence's owner grows it, is interrupted, and releases it on
        the way out (as the engine's every exit path does)."""
        bm = self.bm
        with pytest.raises(Interrupted):
            try:
                try:
                    bm.append(seq, range(n))
                except (OutOfBlocks, TableOverflow):
                    pass
                raise Interrupted
            finally:
                bm.release(seq, "aborted")
        assert seq not in bm.blocks and seq not in bm.rows
        for record in (self.tokens, self.prefixes, self.done):
            del record[seq]
        self.check_data()
        self.check_snapshot()
        return seq

    @precondition(lambda self: self.bm is not None)
    @rule(extra=st.integers(1, 4))
    def start_past_the_row(self, extra):
        bm = self.bm
        n = bm.table.width * bm.block_size + extra
        exc = TableOverflow if cdiv(n, bm.block_size) <= bm.num_free_blocks else OutOfBlocks
        if bm.num_free_rows == 0:
            exc = (OutOfBlocks, TableOverflow)
        self.expect_atomic_failure(exc, bm.admit, "overlong", range(n), n, n - 1)

    @rule(seq=SEQS, extra=st.integers(1, 4))
    def append_past_the_row(self, seq, extra):
        bm = self.bm
        n = bm.table.width * bm.block_size - self.done[seq] + extra
        self.expect_atomic_failure((OutOfBlocks, TableOverflow), bm.append, seq, range(n))

    @precondition(lambda self: self.bm is not None and self.bm.table.width > 1)
    @rule()
    def narrowing_resize_refused(self):
        bm = self.bm
        self.expect_atomic_failure(ValueError, bm.resize_table, bm.table.rows, bm.table.width - 1)

    # -- what only the reference promises --------------------------------------------------------
    def expected_need(self, s: str, n: int) -> int:
        """Blocks append(s, n tokens) must take, from the model (not the manager's arithmetic)."""
        bm, have = self.bm, self.done[s]
        bs = bm.block_size
        need = cdiv(have + n, bs) - cdiv(have, bs)
        last = bm.blocks[s][-1] if bm.blocks[s] else None
        if n and have % bs and last is not None and bm.pool.ref[last] > 1:
            need += 1  # copy-on-write of the shared, partly filled last block
        return need

    @invariant()
    def exact_bookkeeping(self):
        bm = self.bm
        if bm is None:
            return
        bs = bm.block_size
        assert set(bm.blocks) == set(self.done) == set(bm.rows) == set(bm.num_tokens)
        for s, slots in self.done.items():
            assert bm.num_tokens[s] == slots and bm.block_ids(s) is bm.blocks[s]
            assert len(bm.blocks[s]) == cdiv(slots, bs)
            for n in (0, 1, bs, bs + 1):
                assert bm.blocks_needed(s, n) == self.expected_need(s, n)
        assert bm.blocks_needed("unseen", 3) == cdiv(3, bs)
        owned = list(bm.rows.values())
        assert sorted(bm._free_rows + owned) == list(range(bm.table.rows))
        assert bm.num_free_rows == bm.table.rows - len(self.done)
        ref = bm.pool.ref
        assert bm.pool.shared == sum(1 for r in ref if r > 1)  # I5
        assert sorted(bm.pool.free) == [b for b in range(bm.num_blocks) if ref[b] == 0]  # I1, I3
        assert bm.table.overflow_writes == 0


TestBlockManagerStateful = ReferenceMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# -- plain unit tests ------------------------------------------------------------------------
def test_admit_starts_a_sequence_and_append_grows_a_live_one_only():
    bm = BlockManager(8, 4, 2, 4)
    assert bm.admit("a", [5, 6, 7], 8, 2) == 0  # no cache; slots for the known tokens only
    assert bm.num_tokens == {"a": 3} and bm.block_ids("a") == [0]
    with pytest.raises(ValueError, match="holds blocks"):
        bm.admit("a", [1], 1, 0)
    with pytest.raises(KeyError, match="admit starts one"):
        bm.append("b", [1])
    assert state_of(bm)["num_tokens"] == {"a": 3} and bm.num_free_rows == 1
    for reason in ("finished", "aborted", "preempted", "error"):
        bm.admit("c", [1] * 5, 5, 4)
        assert bm.release("c", reason) is True and bm.release("c", reason) is False


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
    bm.admit("p", range(6), 6, 5)  # blocks [0, 1]; block 1 half full
    bm.fork("p", "c")
    shared = list(bm.blocks["p"])
    assert bm.blocks["c"] == shared and [bm.pool.ref[b] for b in shared] == [2, 2]
    other = "c" if writer == "parent" else "p"
    w = "p" if writer == "parent" else "c"
    assert bm.blocks_needed(w, 1) == 1
    copies = bm.append(w, [9])
    fresh = bm.blocks[w][-1]
    assert copies == [(shared[1], fresh)] and fresh not in shared
    assert bm.blocks[w] == [shared[0], fresh] and bm.blocks[other] == shared
    assert bm.pool.ref[shared[0]] == 2 and bm.pool.ref[shared[1]] == 1 and bm.pool.ref[fresh] == 1
    # the other side now owns its last block alone: no copy for it
    assert bm.append(other, [9]) == [] and bm.blocks[other] == shared
    # and through the decode path, a full shared block needs no copy either
    bm.append("p", [9]), bm.append("c", [9])  # both at 8 tokens: last blocks full
    bm.fork("p", "d")
    assert bm.append_decode(["p", "d"], [3, 3]) == []
    assert bm.blocks["p"][:2] == bm.blocks["d"][:2] and bm.blocks["p"][2] != bm.blocks["d"][2]


def test_append_decode_cow_through_fast_path():
    bm = BlockManager(16, 4, 4, 8)
    bm.admit("p", range(5), 5, 4)
    bm.fork("p", "c")
    src = bm.blocks["p"][1]
    copies = bm.append_decode(["p", "c"], [1, 2])
    assert copies == [
        (src, bm.blocks["p"][1])
    ]  # the first side copies; the second then owns src alone
    assert bm.blocks["c"][1] == src and bm.pool.ref[src] == 1


def test_table_overflow_is_atomic_for_new_sequence_and_decode_batch():
    bm = BlockManager(16, 2, 3, 2)
    bm.admit("a", [1, 2], 2, 1)
    bm.admit("b", [1, 2, 3, 4], 4, 3)  # row full
    before = state_of(bm)
    with pytest.raises(TableOverflow):
        bm.append_decode(["a", "b"], [5, 5])  # "a" would fit; the batch fails as a whole
    with pytest.raises(TableOverflow):
        bm.admit("new", range(5), 5, 4)
    with pytest.raises(TableOverflow):
        bm.append("b", [5])
    assert state_of(bm) == before
    bm.resize_table(width=3)
    assert bm.append_decode(["a", "b"], [5, 5]) == [] and bm.num_tokens == {"a": 3, "b": 5}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), bs=st.integers(1, 5))
def test_blocks_needed_matches_admit(n, bs):
    bm = BlockManager(64, bs, 2, 64)
    need = bm.blocks_needed("x", n)
    bm.admit("x", range(n), n, max(0, n - 1))
    assert need == cdiv(n, bs) == 64 - bm.num_free_blocks
