"""kvchaos.engine.prefix_manager.PrefixCachingManager: a Hypothesis state machine (admit with
hits, append, end_step, fork, release with every reason) with M1-M3 and the pool's P1-P4 as
invariants, and the atomicity of a refused admission."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.protocols import REASONS, KVManager, capabilities

BS, POOL = 2, 12
TEMPLATES = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [7, 7, 1, 2])  # prefixes that share blocks


def test_it_is_a_v2_manager_with_its_capabilities():
    m = PrefixCachingManager(4, BS)
    assert isinstance(m, KVManager)
    assert {"prefix_cache", "cache_state", "end_step", "fork"} <= capabilities(m)


def test_a_refused_admission_changes_nothing():
    m = PrefixCachingManager(3, BS)
    m.admit("a", [1, 2, 3, 4], 4, 3)
    m.end_step({"a": 4})
    m.release("a", "finished")  # 2 cached free blocks
    m.admit("b", [5, 6], 2, 1)
    before = m.snapshot().to_dict()
    with pytest.raises(OutOfBlocks):
        m.admit("c", [1, 2, 3, 4, 5, 6, 7, 8], 8, 7)  # revive 1 + 3 new > 2 free
    assert m.snapshot().to_dict() == before


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = PrefixCachingManager(POOL, BS)
        self.live: dict[str, list[int]] = {}  # seq -> known tokens
        self.computed: dict[str, int] = {}
        self.n = 0

    @rule(t=st.sampled_from(TEMPLATES), tail=st.lists(st.integers(0, 3), max_size=3))
    def admit(self, t, tail):
        self.n += 1
        s, toks = f"s{self.n}", t + tail
        try:
            h = self.m.admit(s, toks, len(toks), len(toks) - 1)
        except OutOfBlocks:
            assert s not in self.m.blocks
            return
        assert h % BS == 0 and 0 <= h <= len(toks) - 1
        self.live[s], self.computed[s] = toks, h

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        """The engine's forward: every reserved slot computed, then end_step."""
        s = data.draw(st.sampled_from(sorted(self.live)))
        self.computed[s] = len(self.m.tokens[s])
        self.m.end_step({s: self.computed[s]})

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def append(self, data, tok):
        s = data.draw(st.sampled_from(sorted(self.live)))
        try:
            self.m.append(s, [tok])
        except OutOfBlocks:
            return
        self.live[s].append(tok)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def decode(self, data, tok):
        """append_decode of a few sequences: all or nothing, as append(s, [t]) each."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        before = self.m.snapshot().to_dict()
        try:
            copies = self.m.append_decode(ids, [tok] * len(ids))
        except OutOfBlocks:
            assert self.m.snapshot().to_dict() == before
            return
        held = {b for s in ids for b in before["seq_blocks"][s]}
        assert all(src in held and dst in before["free"] for src, dst in copies)
        for s in ids:
            self.live[s].append(tok)
            assert self.m.tokens[s] == self.live[s]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        p = data.draw(st.sampled_from(sorted(self.live)))
        self.n += 1
        c = f"s{self.n}"
        self.m.fork(p, c)
        self.live[c], self.computed[c] = list(self.m.tokens[c]), self.computed[p]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), why=st.sampled_from(REASONS))
    def release(self, data, why):
        s = data.draw(st.sampled_from(sorted(self.live)))
        assert self.m.release(s, why)
        assert not self.m.release(s, why)  # idempotent
        del self.live[s], self.computed[s]

    @invariant()
    def invariants(self):
        m, pool = self.m, self.m.pool
        pool.check()  # P1-P4
        holders = [0] * POOL
        for s, blocks in m.blocks.items():
            for b in blocks:
                holders[b] += 1
            assert len(blocks) == -(-len(m.tokens[s]) // BS)  # M2
            for i, b in enumerate(blocks[: m.keyed[s]]):  # M3: keyed blocks full and computed
                assert (i + 1) * BS <= self.computed[s]
                if pool.key[b] is not None:
                    assert list(pool.tokens[b]) == m.tokens[s][i * BS : (i + 1) * BS]
        assert holders == pool.ref  # M1
        snap = m.snapshot()
        assert len(snap.free) == m.num_free_blocks
        keyed = {b for b in range(POOL) if pool.key[b] is not None}
        assert {e["block"] for e in snap.cache} == keyed


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
