"""The engine speaks protocol v2 to every manager (docs/protocol-v2.md section 1): one written
against KVManager alone (the engine builds its table) is told why each sequence leaves, has its
answers checked at the boundary, and runs a clean scenario to PASS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvchaos.engine import CacheConfig, Engine, EngineConfig
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.boundary import ManagerError
from kvchaos.engine.tables import BuiltTable
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
    assert "admit" in eng.bm.calls and "release" in eng.bm.calls
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
    end = next(e for e in r.events if e["e"] == "run_end")
    assert end["manager_calls"]["admit"] > 0 and end["manager_calls"]["release"] > 0
