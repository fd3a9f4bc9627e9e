"""Bad input leaves the engine intact: every refused call raises the documented error and changes
nothing (block manager snapshot, request ids, queues), and the engine still runs its other
requests to completion, matching the oracle. Plus configuration validation and the config
helpers (KV bytes per token, blocks in a memory budget)."""

from __future__ import annotations

import pytest
import torch
from tiny_model import tiny_model

from kvchaos.engine import (
    CacheConfig,
    ConfigError,
    Engine,
    EngineConfig,
    InvalidRequest,
    KVChaosError,
    ModelConfig,
    RequestRejected,
    State,
)
from kvchaos.harness.run.oracle import Oracle

VOCAB = 61
MODEL = tiny_model(VOCAB)
BS, WIDTH, POOL = 4, 6, 40  # a table row holds 24 tokens


def make_engine(policy="reject", num_blocks=POOL, **kw) -> Engine:
    cache = CacheConfig(
        block_size=BS,
        num_blocks=num_blocks,
        max_blocks_per_seq=WIDTH,
        max_num_seqs=4,
        overflow_policy=policy,
        prefix_caching=False,  # the plain reference manager, whose table and pool these inspect
    )
    return Engine(
        EngineConfig(
            model=MODEL, cache=cache, seed=3, attention_backend="torch", max_prefill_tokens=8, **kw
        )
    )


def fingerprint(eng: Engine) -> dict:
    return {
        "bm": eng.bm.snapshot().to_dict(),
        "seqs": list(eng.seqs),
        "waiting": [s.id for s in eng.scheduler.waiting],
        "running": [s.id for s in eng.scheduler.running],
        "states": {k: (s.state, list(s.tokens), s.num_computed) for k, s in eng.seqs.items()},
        "table": (eng.bm.table.rows, eng.bm.table.width),
        "step": eng.step_count,
    }


def run_to_completion(eng: Engine, logits: dict) -> None:
    for _ in range(500):
        if not eng.has_unfinished():
            return
        out = eng.step()
        for rid, row in out.logits.items():
            logits.setdefault(rid, []).append(row)
    raise AssertionError("the engine did not finish")


def check_oracle(eng: Engine, logits: dict) -> None:
    oracle = Oracle(eng.model)
    for s in eng.seqs.values():
        assert s.done
        rows = logits.get(s.id, [])
        assert len(rows) == s.num_generated
        res = oracle.check(
            s.id, s.tokens, s.prompt_len, torch.stack(rows) if rows else torch.empty(0, VOCAB)
        )
        assert res.first_divergence is None and res.max_abs_err < 1e-4, res.to_dict()


def assert_all_free(eng: Engine) -> None:
    bm = eng.bm
    assert (
        bm.num_free_blocks == bm.num_blocks
        and bm.blocks == {}
        and bm.num_free_rows == bm.table.rows
    )
    assert set(bm.table.host.tolist()) == {-1}


@pytest.fixture
def busy():
    """An engine mid-run: one finished, one cancelled, some running (prefill/decode), one
    waiting."""
    eng = make_engine()
    logits: dict = {}
    eng.add_request("done", [1, 2, 3], 1)
    eng.add_request("gone", [4, 5], 5)
    eng.add_request("long", list(range(1, 19)), 4)
    out = eng.step()
    for rid, row in out.logits.items():
        logits.setdefault(rid, []).append(row)
    assert eng.seqs["done"].state is State.FINISHED
    assert eng.cancel("gone") is True
    eng.add_request("a", [7, 8, 9, 10, 11], 6)
    eng.add_request("b", [12] * 9, 3)
    for _ in range(2):
        out = eng.step()
        for rid, row in out.logits.items():
            logits.setdefault(rid, []).append(row)
    eng.add_request("w", [13, 14], 2)
    assert eng.scheduler.running and eng.scheduler.waiting
    return eng, logits


def finish_and_check(eng: Engine, logits: dict) -> None:
    run_to_completion(eng, logits)
    for rid in ("long", "a", "b", "w"):
        assert eng.seqs[rid].state is State.FINISHED
    check_oracle(eng, logits)
    assert_all_free(eng)


BAD_REQUESTS = {
    "empty prompt": (("x", [], 4), InvalidRequest, "empty prompt"),
    "negative token": (("x", [1, -1], 4), InvalidRequest, "vocabulary"),
    "token == vocab": (("x", [VOCAB], 4), InvalidRequest, "vocabulary"),
    "token > vocab": (("x", [3, VOCAB + 100], 4), InvalidRequest, "vocabulary"),
    "float token": (("x", [1.0], 4), InvalidRequest, "vocabulary"),
    "str token": (("x", ["1"], 4), InvalidRequest, "vocabulary"),
    "None token": (("x", [2, None], 4), InvalidRequest, "vocabulary"),
    "bool token": (("x", [True], 4), InvalidRequest, "vocabulary"),
    "tensor token": (("x", torch.tensor([1, 2]), 4), InvalidRequest, "vocabulary"),
    "zero max_new": (("x", [1], 0), InvalidRequest, "max_new_tokens"),
    "negative max_new": (("x", [1], -3), InvalidRequest, "max_new_tokens"),
    "float max_new": (("x", [1], 2.0), InvalidRequest, "max_new_tokens"),
    "str max_new": (("x", [1], "2"), InvalidRequest, "max_new_tokens"),
    "bool max_new": (("x", [1], True), InvalidRequest, "max_new_tokens"),
    "None max_new": (("x", [1], None), InvalidRequest, "max_new_tokens"),
    "duplicate running id": (("a", [1], 2), InvalidRequest, "duplicate"),
    "duplicate waiting id": (("w", [1], 2), InvalidRequest, "duplicate"),
    "duplicate finished id": (("done", [1], 2), InvalidRequest, "duplicate"),
    "duplicate cancelled id": (("gone", [1], 2), InvalidRequest, "duplicate"),
    "empty id": (("", [1], 2), InvalidRequest, "non-empty string"),
    "None id": ((None, [1], 2), InvalidRequest, "non-empty string"),
    "int id": ((7, [1], 2), InvalidRequest, "non-empty string"),
    "row overflow": (("x", [1] * 20, 5), RequestRejected, "table row"),
    "row overflow by one token": (("x", [1] * (BS * WIDTH), 1), RequestRejected, "table row"),
    "past max_position": (("x", [1] * 100, 40), RequestRejected, "positions"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_leaves_engine_intact(busy, case):
    eng, logits = busy
    args, exc, msg = BAD_REQUESTS[case]
    before = fingerprint(eng)
    with pytest.raises(exc, match=msg) as info:
        eng.add_request(*args)
    assert isinstance(info.value, KVChaosError)
    if exc is RequestRejected:
        assert info.value.status == 429
    assert fingerprint(eng) == before
    finish_and_check(eng, logits)


def test_request_at_exact_row_capacity_is_admitted():
    eng = make_engine()
    eng.add_request("edge", [5] * (BS * WIDTH - 3), 3)  # exactly WIDTH blocks
    logits: dict = {}
    run_to_completion(eng, logits)
    assert len(eng.seqs["edge"].tokens) == BS * WIDTH and eng.bm.table.width == WIDTH
    check_oracle(eng, logits)
    assert_all_free(eng)


def test_request_larger_than_pool_rejected_even_under_resize():
    eng = make_engine(policy="resize", num_blocks=8)
    before = fingerprint(eng)
    with pytest.raises(RequestRejected, match="pool") as info:
        eng.add_request("huge", [1] * 30, 3)  # 9 blocks > 8
    assert info.value.status == 429 and fingerprint(eng) == before


def test_resize_policy_admits_overlong_request_and_matches_oracle():
    eng = make_engine(policy="resize")
    logits: dict = {}
    eng.add_request("short", [3, 4, 5], 4)
    for rid, row in eng.step().logits.items():  # "short" holds a row before the table grows
        logits.setdefault(rid, []).append(row)
    before = eng.bm.snapshot()
    eng.add_request("long", list(range(1, 31)), 10)  # 40 tokens: 10 blocks > width 6
    assert eng.bm.table.width == 10
    r = before.seq_rows["short"]
    assert (
        eng.bm.table.row(r)[:WIDTH] == before.table[r * WIDTH : (r + 1) * WIDTH]
    )  # rows kept on growth
    eng.fork("long", "long.1", 6, [2, 2])  # 32 tokens + 6 = 38 fits; the child of a waiting parent
    eng.add_request("longer", [9] * 40, 4)  # 44 tokens: 11 blocks, grows again
    assert eng.bm.table.width == 11
    run_to_completion(eng, logits)
    assert len(eng.seqs["long"].tokens) == 40 and len(eng.seqs["longer"].tokens) == 44
    assert all(s.state is State.FINISHED for s in eng.seqs.values())
    assert eng.bm.table.overflow_writes == 0
    check_oracle(eng, logits)
    assert_all_free(eng)


def test_cancel_errors_and_noops(busy):
    eng, logits = busy
    before = fingerprint(eng)
    with pytest.raises(InvalidRequest, match="unknown"):
        eng.cancel("nobody")
    assert eng.cancel("done") is False
    assert eng.cancel("gone") is False
    assert fingerprint(eng) == before
    finish_and_check(eng, logits)
    for rid in ("a", "w"):
        assert eng.cancel(rid) is False  # finished now
    assert_all_free(eng)


@pytest.mark.parametrize(
    "case",
    [
        "finished parent",
        "cancelled parent",
        "unknown parent",
        "duplicate child",
        "bad extra token",
        "child too long",
        "bad max_new",
    ],
)
def test_bad_fork_leaves_engine_intact(busy, case):
    eng, logits = busy
    parent, child, max_new, extra, exc = {
        "finished parent": ("done", "c", 2, [], InvalidRequest),
        "cancelled parent": ("gone", "c", 2, [], InvalidRequest),
        "unknown parent": ("nobody", "c", 2, [], InvalidRequest),
        "duplicate child": ("a", "b", 2, [], InvalidRequest),
        "bad extra token": ("a", "c", 2, [VOCAB], InvalidRequest),
        "child too long": ("long", "c", 10, [], RequestRejected),
        "bad max_new": ("a", "c", 0, [], InvalidRequest),
    }[case]
    before = fingerprint(eng)
    with pytest.raises(exc):
        eng.fork(parent, child, max_new, extra)
    assert fingerprint(eng) == before
    finish_and_check(eng, logits)


def test_fork_of_parent_that_finished_meanwhile_raises(busy):
    eng, logits = busy
    finish_and_check(eng, logits)
    before = fingerprint(eng)
    with pytest.raises(InvalidRequest, match="not a live request"):
        eng.fork("a", "a.late", 2)
    assert fingerprint(eng) == before


def test_engine_still_accepts_work_after_many_refusals(busy):
    eng, logits = busy
    for args, exc, _ in BAD_REQUESTS.values():
        with pytest.raises(exc):
            eng.add_request(*args)
    eng.add_request("x", [1, 2, 3], 2)  # the refused id is free to use
    finish_and_check(eng, logits)
    assert eng.seqs["x"].state is State.FINISHED


def test_failed_step_releases_its_sequences_with_error_and_recomputes(busy):
    eng, logits = busy
    reasons = []
    eng.seams.free_on_exit = lambda seq, why: reasons.append((seq.id, why)) or True
    running = [s.id for s in eng.scheduler.running]
    forward = eng.model.forward

    def fail(*args):
        raise RuntimeError("the forward failed")

    eng.model.forward = fail
    with pytest.raises(RuntimeError, match="the forward failed"):
        eng.step()
    released = {r for r, _ in reasons}  # the running ones and those admitted this step
    assert running and set(running) <= released and {why for _, why in reasons} == {"error"}
    assert all(eng.seqs[r].phase == "preempted" and not eng.seqs[r].holds for r in released)
    assert eng.bm.snapshot().seq_blocks == {}  # nothing half-done is held
    eng.model.forward = forward
    finish_and_check(eng, logits)


# -- configuration --------------------------------------------------------------------------
CONFIG_ERRORS = {
    "heads not multiple of kv heads": (
        lambda: ModelConfig(num_heads=6, num_kv_heads=4),
        "model.num_kv_heads",
    ),
    "unknown dtype": (lambda: ModelConfig(dtype="float8"), "model.dtype"),
    "odd head_dim": (lambda: ModelConfig(head_dim=15), "model.head_dim"),
    "zero layers": (lambda: ModelConfig(num_layers=0), "model.num_layers"),
    "negative hidden": (lambda: ModelConfig(hidden_size=-1), "model.hidden_size"),
    "zero vocab": (lambda: ModelConfig(vocab_size=0), "model.vocab_size"),
    "zero kv heads": (lambda: ModelConfig(num_kv_heads=0), "model.num_kv_heads"),
    "zero block_size": (lambda: CacheConfig(block_size=0), "cache.block_size"),
    "negative num_blocks": (lambda: CacheConfig(num_blocks=-4), "cache.num_blocks"),
    "zero width": (lambda: CacheConfig(max_blocks_per_seq=0), "cache.max_blocks_per_seq"),
    "zero rows": (lambda: CacheConfig(max_num_seqs=0), "cache.max_num_seqs"),
    "bad overflow_policy": (lambda: CacheConfig(overflow_policy="grow"), "cache.overflow_policy"),
    "watermark 1": (lambda: CacheConfig(watermark=1.0), "cache.watermark"),
    "negative watermark": (lambda: CacheConfig(watermark=-0.1), "cache.watermark"),
    "tp not dividing kv heads": (
        lambda: EngineConfig(model=ModelConfig(num_kv_heads=2), tp_size=3),
        "engine.tp_size",
    ),
    "zero tp": (lambda: EngineConfig(tp_size=0), "engine.tp_size"),
    "zero prefill budget": (
        lambda: EngineConfig(max_prefill_tokens=0),
        "engine.max_prefill_tokens",
    ),
    "unknown backend": (
        lambda: EngineConfig(attention_backend="flash"),
        "engine.attention_backend",
    ),
    "bad device": (lambda: EngineConfig(device="nonsense"), "engine.device"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_error_names_the_key(case):
    make, key = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value).startswith(key + ":"), str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVChaosError)


@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_kv_bytes_per_token(dtype, nbytes):
    m = ModelConfig(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    assert m.dtype_bytes == nbytes
    assert m.kv_bytes_per_token() == 2 * 3 * 2 * 64 * nbytes


def test_engine_rejects_non_protocol_block_manager():
    with pytest.raises(
        TypeError, match=r"object does not declare kvchaos_protocol = 2: protocol v1"
    ):
        Engine(EngineConfig(model=MODEL), block_manager=object())
    declares = type("Declares", (), {"kvchaos_protocol": 2})()
    with pytest.raises(TypeError, match="Declares does not implement kvchaos.engine.protocols.KV"):
        Engine(EngineConfig(model=MODEL), block_manager=declares)
