"""The engine speaks protocol v2 (docs/protocol-v2.md section 1, build step 3): a v1 manager runs
through V1Shim making the very calls it always got; a v2 manager written against KVManager alone
(no shim, the engine builds its table) is told why each sequence leaves, has its answers checked
at the boundary, and runs a clean scenario to PASS."""

from __future__ import annotations

import warnings

import pytest

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.boundary import Boundary, ManagerError
from kvchaos.engine.compat import V1Shim, as_v2
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import KVManager, Snapshot
from kvchaos.engine.tables import BuiltTable, OwnedTable
from kvchaos.harness.judge.runner import run_scenario
from kvchaos.harness.judge.scenario import BUILTIN_DIR, load_scenario

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=61,
    max_position=128,
)


def make_engine(manager=None, num_blocks=40) -> Engine:
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, max_blocks_per_seq=8, max_num_seqs=4)
    cfg = EngineConfig(
        model=MODEL, cache=cache, seed=3, attention_backend="torch", max_prefill_tokens=8
    )
    return Engine(cfg, manager)


def drain(eng: Engine, steps: int = 300) -> None:
    for _ in range(steps):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("the engine did not finish")


class RecordingV1(BlockManager):
    """The reference (v1), every protocol call and its answer written down."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.log: list[tuple] = []

    def append(self, seq_id, n):
        out = super().append(seq_id, n)
        self.log.append(("append", seq_id, n, list(out)))
        return out

    def append_decode(self, seq_ids):
        out = super().append_decode(seq_ids)
        self.log.append(("append_decode", list(seq_ids), list(out)))
        return out

    def free(self, seq_id):
        out = super().free(seq_id)
        self.log.append(("free", seq_id, out))
        return out


class UserV1(RecordingV1):
    """A manager from outside kvchaos (this test module): warned about once."""


def test_shim_maps_each_v2_call_to_its_v1_call():
    v1 = RecordingV1(16, 4, 4, 8)
    shim = as_v2(v1)
    assert isinstance(shim, V1Shim) and isinstance(shim, KVManager)
    assert {"own_table", "estimates", "fork"} <= shim.capabilities
    assert shim.admit("a", list(range(10)), 6, 9) == 0  # no cache: nothing computed
    assert shim.append("a", [1, 2, 3, 4]) == []
    shim.fork("a", "b")
    copies = shim.append("b", [7])  # b writes into the block it shares with a: copy-on-write
    assert len(copies) == 1 and copies == v1.log[-1][3]
    assert shim.append_decode(["a"], [5]) == v1.log[-1][2]
    assert shim.block_ids("a") == v1.snapshot().seq_blocks["a"]
    assert shim.blocks_needed("c", 5) == v1.blocks_needed("c", 5)
    assert shim.release("a", "finished") is True and shim.release("a", "aborted") is False
    assert [c[:3] for c in v1.log if c[0] != "append_decode"] == [
        ("append", "a", 6),
        ("append", "a", 4),
        ("append", "b", 1),
        ("append", "a", 1),  # the reference's append_decode appends one by one
        ("free", "a", True),
        ("free", "a", False),
    ]
    with pytest.raises(OutOfBlocks):
        shim.admit("big", list(range(99)), 99, 98)


def test_a_v2_manager_is_not_wrapped_and_only_outside_managers_are_warned(monkeypatch):
    v2 = V2Manager(8, 4, 2, 4)
    assert as_v2(v2) is v2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        as_v2(UserV1(8, 4, 2, 4))
    assert not seen  # nothing to migrate to yet: --block-manager takes v1 managers alone
    monkeypatch.setattr("kvchaos.engine.compat.DEPRECATE_V1", True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        as_v2(BlockManager(8, 4, 2, 4))  # our own reference: v1 until it moves to v2
        as_v2(UserV1(8, 4, 2, 4))
        as_v2(UserV1(8, 4, 2, 4))  # once per class
    assert [str(w.message).split(" ")[0] for w in seen] == ["UserV1"]
    assert seen[0].category is DeprecationWarning and "docs/protocol-v2.md" in str(seen[0].message)


def test_engine_drives_a_v1_manager_through_the_shim_with_its_v1_calls():
    v1 = RecordingV1(40, 4, 4, 8)
    eng = make_engine(v1)
    assert isinstance(eng.bm, V1Shim) and isinstance(eng.bm.v1, Boundary)
    assert isinstance(eng.table, OwnedTable) and eng.capabilities == {"fork", "seq_tokens"}
    eng.add_request("a", list(range(1, 11)), 3)  # 10 tokens: chunks of 8 and 2
    eng.add_request("b", list(range(20, 25)), 2)
    drain(eng)
    assert v1.log[0] == ("append", "a", 8, [])  # admission = append of the first chunk
    assert ("append", "b", 5, []) in v1.log
    assert [c for c in v1.log if c[0] == "free"] == [("free", "b", True), ("free", "a", True)]
    # the boundary's record, the one run_end carries, keeps the v1 names
    assert set(eng.bm.calls) == {
        "blocks_needed",
        "append",
        "append_decode",
        "fork",
        "free",
        "resize_table",
        "snapshot",
    }
    assert eng.bm.calls["free"] == 2 and eng.bm.calls["append"] == 3


class V2Manager:
    """A v2 manager written against KVManager alone: no cache, no table, no fork; blocks_needed
    for the sequences it holds. Records every release reason."""

    kvchaos_protocol = 2

    def __init__(self, num_blocks, block_size, max_num_seqs=None, max_blocks_per_seq=None):
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.ref = [0] * num_blocks
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}
        self.released: list[tuple[str, str]] = []
        self.admits: list[tuple] = []

    @property
    def num_blocks(self) -> int:
        return len(self.ref)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq_id, n):
        if seq_id not in self.tokens:
            raise KeyError(f"asked about {seq_id!r}, which it does not hold")
        bs, have = self.block_size, self.tokens[seq_id]
        return -(-(have + n) // bs) - len(self.blocks[seq_id])

    def _grow(self, seq_id, n):
        need = -(-(self.tokens[seq_id] + n) // self.block_size) - len(self.blocks[seq_id])
        if need > len(self.free):
            raise OutOfBlocks(f"{seq_id}: {need} blocks, {len(self.free)} free")
        for _ in range(need):
            b = self.free.pop()
            self.ref[b] = 1
            self.blocks[seq_id].append(b)
        self.tokens[seq_id] += n

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.admits.append((seq_id, len(token_ids), num_new_tokens, max_computed))
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
        self.released.append((seq_id, reason))
        if seq_id not in self.blocks:
            return False
        for b in self.blocks.pop(seq_id):
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
        )


class AnswersBadly(V2Manager):
    def __init__(self, *args, answer=-1) -> None:
        super().__init__(*args)
        self.answer = answer

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        super().admit(seq_id, token_ids, num_new_tokens, max_computed)
        return self.answer


def test_v2_manager_runs_unwrapped_on_a_table_the_engine_builds():
    m = V2Manager(40, 4)
    eng = make_engine(m)
    assert eng.bm.manager is m and isinstance(eng.table, BuiltTable)
    assert "admit" in eng.bm.calls and "free" not in eng.bm.calls
    eng.add_request("a", list(range(1, 11)), 3)
    eng.step()
    # planned without asking about "a" before it was admitted; known tokens and the cap given
    assert m.admits == [("a", 10, 8, 9)]
    snap = eng.snapshot()
    row = snap.seq_rows["a"]
    assert snap.table[row * 8 : row * 8 + 3] == [0, 1, -1]
    drain(eng)
    assert m.released == [("a", "finished")] and eng.bm.calls["release"] == 1
    assert eng.snapshot().seq_rows == {} and m.num_free_blocks == 40


def test_release_reasons_reach_a_v2_manager():
    m = V2Manager(9, 4)  # 9 blocks: two long requests cannot both decode to the end
    eng = make_engine(m, num_blocks=9)
    eng.add_request("c", list(range(3, 6)), 4)
    eng.add_request("a", list(range(1, 13)), 8)
    eng.step()
    assert eng.seqs["c"].holds
    eng.cancel("c")
    eng.add_request("b", list(range(1, 13)), 8)
    drain(eng)
    reasons = dict.fromkeys(r for _, r in m.released)
    assert list(reasons) == ["aborted", "preempted", "finished"], m.released
    assert ("c", "aborted") in m.released
    eng.add_request("d", [1, 2, 3], 2)
    boom = RuntimeError("the forward failed")

    def fail(*args):
        raise boom

    eng.model.forward = fail
    with pytest.raises(RuntimeError):
        eng.step()
    assert m.released[-1] == ("d", "error")  # the step that reserved its slots did not run
    assert eng.seqs["d"].phase == "preempted" and not eng.seqs["d"].holds
    eng.close()


@pytest.mark.parametrize("answer", [-1, 11, "0", True, None])
def test_a_malformed_admit_answer_is_the_managers_error(answer):
    eng = make_engine(AnswersBadly(40, 4, answer=answer))
    eng.add_request("a", list(range(1, 11)), 3)
    with pytest.raises(ManagerError) as caught:
        eng.step()
    assert caught.value.call == "admit"
    assert str(caught.value).startswith(f"admit('a', [...], 8, 9) answered {answer!r}")


def test_v2_manager_runs_a_clean_scenario_to_pass():
    sc = load_scenario(BUILTIN_DIR / "baseline-clean.toml", "cpu")
    r = run_scenario(sc, 0, "cpu", None, block_manager=V2Manager)
    assert r.verdict == "PASS", r.summary
    assert r.results["block_manager_protocol"] == 2
    assert run_scenario(sc, 0, "cpu", None).results["block_manager_protocol"] == 2  # the default
    plain = run_scenario(sc, 0, "cpu", None, block_manager=BlockManager)
    assert plain.results["block_manager_protocol"] == 1
    end = next(e for e in r.events if e["e"] == "run_end")
    assert end["manager_calls"]["admit"] > 0 and end["manager_calls"]["release"] > 0
