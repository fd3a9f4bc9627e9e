"""Protocol v2's types (docs/protocol-v2.md section 1): a v2 manager is recognised by shape, its
snapshot's optional fields stay out of to_dict until given, and capabilities are declared or
inferred."""

from __future__ import annotations

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.protocols import (
    CAPABILITIES,
    INFERABLE,
    REASONS,
    KVManager,
    Snapshot,
    capabilities,
    protocol_version,
)


class FakeV2:
    """The smallest v2 manager: no cache (admit answers 0), one block list per sequence."""

    kvchaos_protocol = 2
    block_size = 4

    def __init__(self, num_blocks: int = 8) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.ref)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.blocks[seq_id], self.tokens[seq_id] = [], 0
        self.append(seq_id, token_ids[:num_new_tokens])
        return 0

    def append(self, seq_id, token_ids):
        self.tokens[seq_id] += len(token_ids)
        while len(self.blocks[seq_id]) * self.block_size < self.tokens[seq_id]:
            b = self.free.pop()
            self.ref[b] = 1
            self.blocks[seq_id].append(b)
        return []

    def block_ids(self, seq_id):
        return self.blocks[seq_id]

    def release(self, seq_id, reason):
        for b in self.blocks.pop(seq_id, ()):
            self.ref[b] = 0
            self.free.append(b)
        return self.tokens.pop(seq_id, None) is not None

    def snapshot(self):
        return Snapshot(
            len(self.ref),
            list(self.free),
            list(self.ref),
            {s: list(b) for s, b in self.blocks.items()},
        )


class Undeclared:
    """FakeV2's members, without kvchaos_protocol."""

    block_size = 4
    num_blocks = num_free_blocks = 8
    admit = append = block_ids = release = snapshot = staticmethod(lambda *a: None)


class FakeV2Full(FakeV2):
    """Every optional member a v2 manager may have."""

    reserved_blocks = (0,)

    def blocks_needed(self, seq_id, num_new_tokens):
        have = self.tokens[seq_id]
        return -(-(have + num_new_tokens) // self.block_size) - -(-have // self.block_size)

    def append_decode(self, seq_ids, token_ids):
        return [c for s, t in zip(seq_ids, token_ids) for c in self.append(s, [t])]

    def fork(self, parent_id, child_id):
        pass

    def end_step(self, computed):
        pass


class FakeV2OwnTable(FakeV2):
    table = object()
    rows: dict[str, int] = {}
    num_free_rows = 4

    def resize_table(self, rows=None, width=None):
        pass


def test_a_v2_manager_is_a_kvmanager():
    m = FakeV2()
    assert isinstance(m, KVManager)
    assert protocol_version(m) == 2
    assert m.admit("a", list(range(6)), 6, 5) == 0 and m.block_ids("a") == [0, 1]
    assert m.release("a", "finished") and not m.release("a", "finished")  # idempotent
    undeclared = Undeclared()  # v2's members, no kvchaos_protocol: refused (v1 was removed)
    assert not isinstance(undeclared, KVManager) and protocol_version(undeclared) == 1
    ref = BlockManager(8, 4, 2, 4)  # the plain reference: v2, its own table
    assert isinstance(ref, KVManager) and protocol_version(ref) == 2


def test_a_manager_missing_a_v2_member_is_not_a_kvmanager():
    class NoBlockIds:
        kvchaos_protocol, block_size = 2, 4
        num_blocks = num_free_blocks = 8
        admit = append = release = snapshot = staticmethod(lambda *a: None)

    assert not isinstance(NoBlockIds(), KVManager)
    NoBlockIds.block_ids = staticmethod(lambda s: [])
    assert isinstance(NoBlockIds(), KVManager)


def test_protocol_version_needs_an_int_of_two_or_more():
    for value, want in ((2, 2), (3, 2), (1, 1), (True, 1), ("2", 1), (None, 1)):
        m = FakeV2()
        m.kvchaos_protocol = value
        assert protocol_version(m) == want, value


def test_to_dict_omits_fields_not_given():
    snap = FakeV2().snapshot()
    assert snap.seq_rows is snap.table is snap.cache is snap.reserved is None
    assert set(snap.to_dict()) == {"num_blocks", "free", "ref_counts", "seq_blocks"}
    entry = {"block": 3, "key": "ab01", "parent": None, "tokens": [1, 2, 3, 4]}
    full = Snapshot(8, [], [0] * 8, {}, {}, [-1] * 4, 4, {}, [0], [entry])
    assert full.to_dict()["cache"] == [entry] and full.to_dict()["reserved"] == [0]
    host = {"host_blocks", "host_free", "host_ref_counts"}  # a host tier's, not given here
    assert set(full.to_dict()) == set(Snapshot.__dataclass_fields__) - host


def test_an_own_table_snapshot_keeps_its_table_fields():
    snap = BlockManager(8, 4, 2, 4).snapshot()
    d = snap.to_dict()
    assert d["table_width"] == 4 and d["seq_rows"] == {} and len(d["table"]) == 8
    assert "cache" not in d and "reserved" not in d


def test_v2_capabilities_inferred_from_members():
    assert capabilities(FakeV2()) == frozenset()
    assert capabilities(FakeV2Full()) == {"estimates", "append_decode", "fork", "end_step"}
    assert capabilities(FakeV2OwnTable()) == {"own_table"}


def test_v2_capabilities_declared_keep_known_names_only():
    m = FakeV2Full()
    m.capabilities = frozenset({"prefix_cache", "cache_state", "teleport"})
    assert capabilities(m) == {"prefix_cache", "cache_state"}  # declared wins over inference
    assert set(CAPABILITIES) >= {"prefix_cache", "cache_state", "own_table", "end_step"}


def test_the_plain_reference_declares_what_it_offers():
    ref = BlockManager(8, 4, 2, 4)
    offered = {"fork", "seq_tokens", "estimates", "append_decode", "own_table"}
    assert capabilities(ref) == offered
    inferred = {name for name, shape in INFERABLE.items() if isinstance(ref, shape)}
    # the declaration matches its members; offload's are there, offered with a host tier only
    assert inferred == offered - {"seq_tokens"} | {"offload"}
    assert capabilities(BlockManager(8, 4, 2, 4, host_blocks=8)) == offered | {"offload"}


def test_release_reasons():
    assert REASONS == ("finished", "aborted", "preempted", "error")
