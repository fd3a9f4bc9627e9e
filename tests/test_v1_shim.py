"""The engine speaks protocol v2 (docs/protocol-v2.md section 1, build step 3): a v1 manager runs
through V1Shim making the very calls it always got, and a user's v1 class is warned about once
(deprecated); a v2 manager written against KVManager alone (no shim, the engine builds its table)
is told why each sequence leaves, has its answers checked at the boundary, and runs a clean
scenario to PASS."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from kvchaos.engine import CacheConfig, Engine, EngineConfig
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.boundary import Boundary, ManagerError
from kvchaos.engine.compat import V1Shim, as_v2
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.protocols import KVManager
from kvchaos.engine.tables import BuiltTable, OwnedTable
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

sys.path.insert(0, str(Path(__file__).parent))  # tests/managers.py

import managers  # noqa: E402
from tiny_model import tiny_model  # noqa: E402

MODEL = tiny_model()


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


class RecordingV1(managers.Delegate):
    """A user's v1 manager (over the reference), every protocol call and its answer written
    down."""

    capabilities = frozenset({"fork", "seq_tokens"})

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.log: list[tuple] = []

    def append(self, seq_id, n):
        out = super().append(seq_id, n)
        self.log.append(("append", seq_id, n, list(out)))
        return out

    def append_decode(self, seq_ids):
        out = self.inner.append_decode(seq_ids, [0] * len(seq_ids))
        self.log.append(("append_decode", list(seq_ids), list(out)))
        return out

    def free(self, seq_id):
        out = super().free(seq_id)
        self.log.append(("free", seq_id, out))
        return out


class UserV1(RecordingV1):
    """Another user's v1 class: warned about once, on its own."""


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
    assert [c[:3] for c in v1.log] == [
        ("append", "a", 6),
        ("append", "a", 4),
        ("append", "b", 1),
        ("append_decode", ["a"], []),
        ("free", "a", True),
        ("free", "a", False),
    ]
    with pytest.raises(OutOfBlocks):
        shim.admit("big", list(range(99)), 99, 98)


def warned(*managers_) -> list[str]:
    """The deprecation warnings as_v2 gives for these managers: the class each names."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for m in managers_:
            as_v2(m)
    assert all(w.category is FutureWarning for w in seen)
    return [str(w.message).split(" ")[0] for w in seen]


def test_a_users_v1_manager_is_warned_once_a_class_and_v2_never(monkeypatch):
    monkeypatch.setattr("kvchaos.engine.compat._warned", set())
    v2 = RecordingV2(8, 4, 2, 4)
    assert as_v2(v2) is v2
    ours = type("OwnV1", (RecordingV1,), {"__module__": "kvchaos.engine.somewhere"})
    refs = [BlockManager(8, 4, 2, 4), PrefixCachingManager(8, 4), v2, ours(8, 4, 2, 4)]
    assert warned(*refs) == []  # v2 (both references), or kvchaos's own
    assert warned(UserV1(8, 4, 2, 4), UserV1(8, 4, 2, 4), RecordingV1(8, 4, 2, 4)) == [
        "UserV1",  # once per class
        "RecordingV1",
    ]
    with pytest.warns(FutureWarning, match="docs/adapters.md") as seen:
        make_engine(type("LateV1", (RecordingV1,), {})(40, 4, 4, 8))  # through the engine
    (w,) = seen
    assert "LateV1 implements the v1 BlockManagerProtocol" in str(w.message)
    assert "move it to protocol v2" in str(w.message)
    monkeypatch.setattr("kvchaos.engine.compat.DEPRECATE_V1", False)
    assert warned(type("Quiet", (RecordingV1,), {})(8, 4, 2, 4)) == []


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


class RecordingV2(managers.PlainV2):
    """PlainV2 (KVManager alone, block 0 reserved) with estimates for the sequences it holds only
    (an unseen id is an error), recording every admission and release reason."""

    capabilities = frozenset({"seq_tokens", "estimates"})

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.released: list[tuple[str, str]] = []
        self.admits: list[tuple] = []

    def blocks_needed(self, seq_id, n):
        if seq_id not in self.tokens:
            raise KeyError(f"asked about {seq_id!r}, which it does not hold")
        bs, have = self.block_size, self.tokens[seq_id]
        return -(-(have + n) // bs) - len(self.blocks[seq_id])

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        self.admits.append((seq_id, len(token_ids), num_new_tokens, max_computed))
        return super().admit(seq_id, token_ids, num_new_tokens, max_computed)

    def release(self, seq_id, reason):
        self.released.append((seq_id, reason))
        return super().release(seq_id, reason)


class AnswersBadly(RecordingV2):
    def __init__(self, *args, answer=-1) -> None:
        super().__init__(*args)
        self.answer = answer

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        super().admit(seq_id, token_ids, num_new_tokens, max_computed)
        return self.answer


def test_v2_manager_runs_unwrapped_on_a_table_the_engine_builds():
    m = RecordingV2(40, 4)
    eng = make_engine(m)
    assert eng.bm.manager is m and isinstance(eng.table, BuiltTable)
    assert "admit" in eng.bm.calls and "free" not in eng.bm.calls
    eng.add_request("a", list(range(1, 11)), 3)
    eng.step()
    # planned without asking about "a" before it was admitted; known tokens and the cap given
    assert m.admits == [("a", 10, 8, 9)]
    snap = eng.snapshot()
    row = snap.seq_rows["a"]
    assert snap.table[row * 8 : row * 8 + 3] == [1, 2, -1]  # block 0 is reserved
    drain(eng)
    assert m.released == [("a", "finished")] and eng.bm.calls["release"] == 1
    assert eng.snapshot().seq_rows == {} and m.num_free_blocks == 39


def test_release_reasons_reach_a_v2_manager():
    m = RecordingV2(10, 4)  # 9 usable blocks: two long requests cannot both decode to the end
    eng = make_engine(m, num_blocks=10)
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
    r = run_scenario(sc, 0, "cpu", None, block_manager=RecordingV2)
    assert r.verdict == "PASS", r.summary
    assert r.results["block_manager_protocol"] == 2
    assert run_scenario(sc, 0, "cpu", None).results["block_manager_protocol"] == 2  # the default
    plain = run_scenario(sc, 0, "cpu", None, block_manager=BlockManager)
    assert plain.results["block_manager_protocol"] == 2  # the plain reference too
    v1 = run_scenario(sc, 0, "cpu", None, block_manager=managers.Delegate)
    assert v1.verdict == "PASS" and v1.results["block_manager_protocol"] == 1
    end = next(e for e in r.events if e["e"] == "run_end")
    assert end["manager_calls"]["admit"] > 0 and end["manager_calls"]["release"] > 0
