"""The engine paths refcount_leak's waiting and engine_abort variants plant on: a request admitted
and waiting for its KV to land (seams.kv_load_steps) holds blocks in the waiting queue, runs the
chunk its admission reserved once it lands (the same tokens as without the wait), and its cancel
releases them; a request's own error in a step (RequestFailed from seams.on_sample) ends it in
error with its blocks released while the others' step goes on; any other error still fails the
step."""

from __future__ import annotations

import pytest
from tiny_model import tiny_model

from kvchaos.engine import CacheConfig, Engine, EngineConfig, RequestFailed, State

MODEL = tiny_model(61)


def make_engine() -> Engine:
    cache = CacheConfig(
        block_size=4, num_blocks=40, max_blocks_per_seq=8, max_num_seqs=4, prefix_caching=False
    )
    return Engine(
        EngineConfig(
            model=MODEL, cache=cache, seed=3, attention_backend="torch", max_prefill_tokens=8
        )
    )


PROMPTS = {"a": [5, 9, 2, 7, 1, 3], "b": [8, 8, 1, 4, 6, 2, 9]}


def run(eng: Engine, steps: int = 40) -> dict[str, list[int]]:
    for req, p in PROMPTS.items():
        eng.add_request(req, p, 5)
    for _ in range(steps):
        if not eng.has_unfinished():
            break
        eng.step()
    return {r: eng.seqs[r].tokens for r in PROMPTS}


def test_a_request_waiting_for_its_kv_holds_blocks_then_runs_the_same_tokens():
    plain = run(make_engine())
    eng = make_engine()
    asked = []

    def kv_load_steps(seq) -> int:
        asked.append(seq.id)
        return 2 if seq.id == "a" else 0

    eng.seams.kv_load_steps = kv_load_steps
    eng.add_request("a", PROMPTS["a"], 5)
    eng.step()  # admitted, parked: it holds the blocks its first chunk lands in
    a = eng.seqs["a"]
    assert a.state is State.WAITING and a.holds and "a" in eng.scheduler.loading
    assert len(eng.bm.block_ids("a")) == 2 and a.num_computed == 0
    eng.add_request("b", PROMPTS["b"], 5)
    for _ in range(40):
        if not eng.has_unfinished():
            break
        eng.step()
    assert {r: eng.seqs[r].tokens for r in PROMPTS} == plain
    assert asked.count("a") == 1 and eng.bm.num_free_blocks == 40


def test_cancel_of_a_waiting_request_holding_blocks_releases_them():
    eng = make_engine()
    eng.seams.kv_load_steps = lambda seq: 3
    eng.add_request("a", PROMPTS["a"], 5)
    eng.step()
    assert eng.bm.num_free_blocks == 38
    assert eng.cancel("a") and eng.seqs["a"].state is State.CANCELLED
    assert eng.bm.num_free_blocks == 40 and not eng.scheduler.loading
    assert not eng.has_unfinished()


def test_a_request_error_ends_it_in_error_and_the_step_goes_on():
    eng = make_engine()

    def on_sample(seq) -> None:
        if seq.id == "a" and seq.num_generated == 2:
            raise RequestFailed("a: sampling failed")

    eng.seams.on_sample = on_sample
    reasons = []
    eng.seams.free_on_exit = lambda seq, why: reasons.append((seq.id, why)) or True
    failed = []
    for req, p in PROMPTS.items():
        eng.add_request(req, p, 5)
    while eng.has_unfinished():
        failed += eng.step().failed
    a, b = eng.seqs["a"], eng.seqs["b"]
    assert failed == ["a"] and a.state is State.FAILED and a.done and a.num_generated == 2
    assert b.state is State.FINISHED and b.num_generated == 5
    assert ("a", "error") in reasons and eng.bm.num_free_blocks == 40


def test_any_other_error_in_sampling_still_fails_the_step():
    eng = make_engine()

    def on_sample(seq) -> None:
        raise RuntimeError("not a request's own error")

    eng.seams.on_sample = on_sample
    eng.add_request("a", PROMPTS["a"], 5)
    with pytest.raises(RuntimeError):
        for _ in range(3):
            eng.step()
