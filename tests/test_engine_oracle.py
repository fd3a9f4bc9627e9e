"""The paged engine against the contiguous-cache oracle on seeded random workloads.

Every logit row the engine emits (StepOutput.logits) is collected per request; after the run each
request, finished or cancelled, is replayed by kvchaos.harness.run.oracle.Oracle (teacher
forcing on the engine's own tokens) and must not diverge. Workloads cover staggered arrivals,
chunked prefill, preemption on a small pool, forks that share blocks (copy-on-write) and cancels
in every state.
Block accounting is checked after every step and, at the end, every block must be free.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from tiny_model import tiny_model

from kvchaos.engine import CacheConfig, Engine, EngineConfig, State
from kvchaos.harness.run.oracle import Oracle

MODEL = tiny_model(97, 256)


def make_engine(
    num_blocks=64,
    block_size=4,
    max_blocks_per_seq=16,
    max_num_seqs=8,
    max_prefill_tokens=16,
    tp_size=1,
    seed=0,
    model=MODEL,
    **cache_kw,
) -> Engine:
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks_per_seq,
        max_num_seqs=max_num_seqs,
        **{"prefix_caching": False, **cache_kw},  # the plain manager's pool and table, inspected
    )
    return Engine(
        EngineConfig(
            model=model,
            cache=cache,
            seed=seed,
            attention_backend="torch",
            max_prefill_tokens=max_prefill_tokens,
            tp_size=tp_size,
        )
    )


def make_workload(seed: int, n: int, prompt=(1, 24), out=(1, 10), span=20, vocab=MODEL.vocab_size):
    """[(arrival step, id, prompt, max_new_tokens)], sorted by arrival."""
    rng = random.Random(seed)
    reqs = [
        (
            rng.randrange(span),
            f"r{i}",
            [rng.randrange(vocab) for _ in range(rng.randint(*prompt))],
            rng.randint(*out),
        )
        for i in range(n)
    ]
    return sorted(reqs, key=lambda r: r[0])


def check_accounting(engine: Engine) -> None:
    """free + referenced == total; ref counts == holders; running sequences hold exactly the blocks
    of their computed tokens, nobody else holds any; table rows mirror block lists."""
    bm = engine.bm
    snap = bm.snapshot()
    n, bs, w = snap.num_blocks, bm.block_size, snap.table_width
    holders = [0] * n
    for bl in snap.seq_blocks.values():
        for b in bl:
            holders[b] += 1
    assert holders == snap.ref_counts
    assert len(snap.free) == len(set(snap.free)) == sum(1 for r in snap.ref_counts if r == 0)
    assert all(snap.ref_counts[b] == 0 for b in snap.free)
    running = {s.id for s in engine.scheduler.running}
    assert set(snap.seq_blocks) <= running
    for s in engine.seqs.values():
        if s.id in snap.seq_blocks:
            assert s.state is State.RUNNING
            assert len(snap.seq_blocks[s.id]) == -(-s.num_computed // bs)
            r = snap.seq_rows[s.id]
            bl = snap.seq_blocks[s.id]
            assert snap.table[r * w : (r + 1) * w] == bl + [-1] * (w - len(bl))
        else:
            assert s.num_computed == 0 or s.state is not State.RUNNING
    assert {s.id for s in engine.scheduler.waiting} | running == {
        s.id for s in engine.seqs.values() if not s.done
    }
    assert not ({s.id for s in engine.scheduler.waiting} & running)


class Driver:
    """Submits a workload on schedule, steps the engine, records every logit row per request."""

    def __init__(self, engine: Engine, workload, hook=None, max_steps=2000) -> None:
        self.engine, self.workload, self.hook, self.max_steps = (
            engine,
            list(workload),
            hook,
            max_steps,
        )
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.steps = 0

    def run(self) -> "Driver":
        eng, pending = self.engine, list(self.workload)
        t = 0
        while pending or eng.has_unfinished():
            while pending and pending[0][0] <= t:
                _, rid, prompt, max_new = pending.pop(0)
                eng.add_request(rid, prompt, max_new)
            if self.hook is not None:
                self.hook(self, t)
            if eng.has_unfinished():
                out = eng.step()
                self.steps += 1
                for rid, row in out.logits.items():
                    assert out.tokens[rid] == eng.seqs[rid].tokens[-1] == int(row.argmax())
                    self.logits[rid].append(row)
                for rid in out.finished:
                    assert eng.seqs[rid].state is State.FINISHED
                check_accounting(eng)
            t += 1
            assert t < self.max_steps, "the engine made no progress"
        return self

    def check_oracle(self) -> int:
        """Every request is done and matches the oracle; returns how many logit rows it checked."""
        eng = self.engine
        oracle = Oracle(eng.model)
        checked = 0
        for s in eng.seqs.values():
            assert s.done, f"{s.id} is {s.state}"
            rows = self.logits.get(s.id, [])
            assert len(rows) == s.num_generated
            if s.state is State.FINISHED:
                assert s.num_generated == s.max_new_tokens
            logits = torch.stack(rows) if rows else torch.empty(0, MODEL.vocab_size)
            res = oracle.check(s.id, s.tokens, s.prompt_len, logits)
            assert res.first_divergence is None, res.to_dict()
            assert res.max_abs_err < 1e-4, res.to_dict()
            checked += res.checked
        return checked


def assert_all_free(engine: Engine) -> None:
    bm = engine.bm
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(r == 0 for r in bm.pool.ref) and bm.blocks == {}
    assert bm.num_free_rows == bm.table.rows
    assert bm.table.host.tolist() == [-1] * (bm.table.rows * bm.table.width)


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_random_workload_matches_oracle(seed):
    eng = make_engine(num_blocks=96, max_prefill_tokens=8, seed=seed)
    d = Driver(eng, make_workload(seed, 14, prompt=(1, 30), out=(1, 12), span=25)).run()
    assert all(s.state is State.FINISHED for s in eng.seqs.values())
    assert d.check_oracle() == sum(s.max_new_tokens for s in eng.seqs.values())
    assert_all_free(eng)


def test_chunked_prefill_of_long_prompts_matches_oracle():
    # prompts many times the per-step budget, block_size not dividing the budget
    eng = make_engine(num_blocks=80, block_size=3, max_blocks_per_seq=24, max_prefill_tokens=5)
    d = Driver(eng, make_workload(7, 5, prompt=(20, 50), out=(2, 6), span=3)).run()
    assert d.check_oracle() > 0
    assert_all_free(eng)


def test_preemption_on_small_pool_matches_oracle():
    eng = make_engine(num_blocks=12, block_size=4, max_blocks_per_seq=12, max_prefill_tokens=12)
    d = Driver(eng, make_workload(3, 10, prompt=(6, 20), out=(8, 16), span=6)).run()
    assert eng.counters["preemptions"] > 0
    assert all(s.state is State.FINISHED for s in eng.seqs.values())
    d.check_oracle()
    assert_all_free(eng)


def fork_hook(plan):
    """plan: {step: [(parent, child, max_new, extra_tokens)]}; forks a parent that is still live."""

    def hook(driver: Driver, t: int) -> None:
        eng = driver.engine
        for parent, child, max_new, extra in plan.get(t, []):
            p = eng.seqs.get(parent)
            if p is not None and not p.done:
                eng.fork(parent, child, max_new, extra)

    return hook


def test_forks_share_prefix_and_copy_on_write():
    eng = make_engine(num_blocks=64, block_size=4, max_prefill_tokens=16)
    work = [
        (0, "a", [5, 6, 7, 8, 9, 10, 11], 12),
        (0, "b", list(range(20, 33)), 10),
        (2, "c", [1, 2, 3], 8),
    ]
    plan = {
        3: [("a", "a.1", 6, []), ("a", "a.2", 5, [40, 41])],
        5: [("b", "b.1", 7, [3]), ("a.1", "a.1.1", 4, [])],
        6: [("c", "c.1", 3, [9, 9, 9, 9, 9])],
    }
    d = Driver(eng, work, hook=fork_hook(plan)).run()
    assert {"a.1", "a.2", "b.1", "a.1.1", "c.1"} <= set(eng.seqs)
    assert eng.counters["cow_copies"] > 0
    # a child is its parent's tokens at the fork (plus extra), then its own continuation
    a, a2 = eng.seqs["a"], eng.seqs["a.2"]
    n = a2.prompt_len - 2
    assert a2.tokens[:n] == a.tokens[:n] and a2.tokens[n : n + 2] == [40, 41]
    d.check_oracle()
    assert_all_free(eng)


def test_fork_of_waiting_and_preempted_parent():
    # Parents holding no blocks: the child queues with the parent's tokens and prefills them itself.
    eng = make_engine(
        num_blocks=10, block_size=4, max_blocks_per_seq=10, max_num_seqs=3, max_prefill_tokens=8
    )
    work = make_workload(11, 8, prompt=(6, 14), out=(6, 12), span=2)
    forked = {State.WAITING: [], State.PREEMPTED: []}

    def hook(driver, t):
        for s in list(eng.seqs.values()):
            if (
                s.state in forked
                and s.parent is None
                and len(forked[s.state]) < 2
                and all(f"{s.id}.f" != c for cs in forked.values() for c in cs)
            ):
                child = f"{s.id}.f"
                eng.fork(s.id, child, 3, [1])
                forked[s.state].append(child)
                c = eng.seqs[child]
                assert c.state is State.WAITING and child not in eng.bm.blocks
                assert c.tokens == s.tokens + [1] and c.prompt_len == len(s.tokens) + 1

    d = Driver(eng, work, hook=hook).run()
    assert forked[State.WAITING] and forked[State.PREEMPTED], forked
    d.check_oracle()
    assert_all_free(eng)


PHASES = ("waiting", "prefill", "decode", "preempted", "fork-shared", "parent-shared")


def cancel_everywhere_hook(rng: random.Random, cancelled: dict, forks: list):
    """Cancels, with probability, one request in each phase of its life not yet covered; forks some
    running requests so that cancels also hit sequences sharing blocks (child and parent side)."""

    def phase_of(eng: Engine, s) -> str:
        bm = eng.bm
        if s.state is State.RUNNING and s.id in bm.blocks:
            mine = set(bm.blocks[s.id])
            if s.parent is not None and mine & set(bm.blocks.get(s.parent, ())):
                return "fork-shared"
            if any(
                c.parent == s.id and mine & set(bm.blocks.get(c.id, ())) for c in eng.seqs.values()
            ):
                return "parent-shared"
        return s.phase

    def hook(driver: Driver, t: int) -> None:
        eng = driver.engine
        live = [s for s in eng.seqs.values() if not s.done]
        if t % 3 == 1:
            cands = [s for s in live if s.state is State.RUNNING and s.parent is None]
            if cands:
                p = rng.choice(cands)
                child = f"{p.id}.{t}"
                eng.fork(
                    p.id,
                    child,
                    rng.randint(2, 6),
                    [rng.randrange(MODEL.vocab_size)] * rng.randint(0, 3),
                )
                forks.append(child)
                return  # let the fork share blocks for at least one step
        for s in live:
            ph = phase_of(eng, s)
            if ph in PHASES and ph not in cancelled and rng.random() < 0.5:
                free_before = eng.bm.num_free_blocks
                held = set(eng.bm.blocks.get(s.id, ()))
                assert eng.cancel(s.id) is True
                assert eng.cancel(s.id) is False  # idempotent
                assert s.state is State.CANCELLED and s.id not in eng.bm.blocks
                alone = {b for b in held if eng.bm.pool.ref[b] == 0}
                assert eng.bm.num_free_blocks == free_before + len(alone)
                if ph in ("fork-shared", "parent-shared"):
                    assert len(alone) < len(held), "shared blocks must stay with the other side"
                check_accounting(eng)
                cancelled[ph] = s.id

    return hook


def run_cancel_workload(seed: int):
    eng = make_engine(
        num_blocks=16,
        block_size=4,
        max_blocks_per_seq=10,
        max_num_seqs=6,
        max_prefill_tokens=6,
        seed=seed,
    )
    rng = random.Random(1000 + seed)
    cancelled, forks = {}, []
    d = Driver(
        eng,
        make_workload(seed, 24, prompt=(3, 16), out=(4, 14), span=40),
        hook=cancel_everywhere_hook(rng, cancelled, forks),
    ).run()
    return eng, d, cancelled, forks


@pytest.mark.parametrize("seed", range(4))
def test_cancel_in_every_state_leaks_nothing_and_matches_oracle(seed):
    eng, d, cancelled, forks = run_cancel_workload(seed)
    assert set(cancelled) == set(PHASES), f"phases covered: {sorted(cancelled)}"
    assert eng.counters["preemptions"] > 0 and forks
    # the survivors of a cancelled parent / child still finish and match the oracle
    assert any(s.state is State.FINISHED for s in eng.seqs.values())
    d.check_oracle()
    assert_all_free(eng)


@pytest.mark.parametrize("seed", range(8))
def test_mixed_random_configs(seed):
    """Everything at once on a configuration drawn from the seed: block sizes 1..5, a pool from
    barely one request up, prefill budgets down to one token a step, few rows, random forks and
    cancels."""
    rng = random.Random(seed)
    bs = rng.randint(1, 5)
    max_tokens = 20 + 10 + 3 + 4  # prompt + output, and a fork's extra tokens + output
    req_blocks = -(-max_tokens // bs)
    eng = make_engine(
        num_blocks=rng.randint(req_blocks, 3 * req_blocks),
        block_size=bs,
        max_blocks_per_seq=req_blocks,
        max_num_seqs=rng.randint(2, 6),
        max_prefill_tokens=rng.choice([1, 2, 3, 7, 12, 32]),
        seed=seed,
        watermark=rng.choice([0.0, 0.0, 0.1]),
    )
    work = make_workload(
        seed, rng.randint(6, 14), prompt=(1, 20), out=(1, 10), span=rng.randint(1, 30)
    )

    def hook(driver, t):
        for s in [s for s in eng.seqs.values() if not s.done]:
            r = rng.random()
            if r < 0.04:
                assert eng.cancel(s.id) is True
            elif r < 0.08 and s.parent is None:
                eng.fork(
                    s.id,
                    f"{s.id}.{t}",
                    rng.randint(1, 4),
                    [rng.randrange(MODEL.vocab_size)] * rng.randint(0, 3),
                )

    d = Driver(eng, work, hook=hook).run()
    d.check_oracle()
    assert_all_free(eng)


def run_for_determinism(seed: int, tp_size: int = 1):
    eng = make_engine(
        num_blocks=16,
        block_size=4,
        max_blocks_per_seq=10,
        max_num_seqs=6,
        max_prefill_tokens=6,
        seed=seed,
        tp_size=tp_size,
    )
    rng = random.Random(seed)
    d = Driver(
        eng,
        make_workload(seed, 16, prompt=(3, 16), out=(4, 14), span=30),
        hook=cancel_everywhere_hook(rng, {}, []),
    ).run()
    return eng, d


def test_same_seed_same_run_bit_for_bit():
    e1, d1 = run_for_determinism(5)
    e2, d2 = run_for_determinism(5)
    assert e1.counters == e2.counters and e1.counters["preemptions"] > 0
    assert d1.steps == d2.steps
    assert {k: (s.tokens, s.state) for k, s in e1.seqs.items()} == {
        k: (s.tokens, s.state) for k, s in e2.seqs.items()
    }
    assert d1.logits.keys() == d2.logits.keys()
    for rid in d1.logits:
        assert torch.equal(torch.stack(d1.logits[rid]), torch.stack(d2.logits[rid])), rid
    # and a different seed is a different model: the same prompts give other tokens
    e3, _ = run_for_determinism(6)
    assert any(e3.seqs[k].tokens != s.tokens for k, s in e1.seqs.items() if k in e3.seqs)


def test_tensor_parallel_ranks_match_single_rank():
    e1, d1 = run_for_determinism(9, tp_size=1)
    e2, d2 = run_for_determinism(9, tp_size=2)
    assert len(e2.ranks.ranks) == 2 and e2.counters["stale_rank_computes"] == 0
    assert {k: s.tokens for k, s in e1.seqs.items()} == {k: s.tokens for k, s in e2.seqs.items()}
    for rid in d1.logits:
        torch.testing.assert_close(
            torch.stack(d2.logits[rid]), torch.stack(d1.logits[rid]), atol=1e-5, rtol=1e-5
        )
    d2.check_oracle()
    assert_all_free(e2)


def test_batched_oracle_checks_equal_one_by_one_and_pinpoint_a_corrupt_row():
    """check_many pads requests of different lengths into shared passes: each result must match
    check() on that request alone (to float rounding: other matmul shapes), and a wrong row in one
    request must not leak into another."""
    eng = Driver(make_engine(), make_workload(11, 9, prompt=(1, 30), out=(1, 12))).run()
    oracle = Oracle(eng.engine.model)
    items = [
        (s.id, s.tokens, s.prompt_len, torch.stack(eng.logits[s.id]))
        for s in eng.engine.seqs.values()
        if eng.logits.get(s.id)
    ]
    lens = {len(it[1]) for it in items}
    assert len(items) >= 6 and len(lens) >= 4  # several lengths: several padded groups
    alone = [oracle.check(*it) for it in items]
    for got, one in zip(oracle.check_many(items), alone):
        assert (got.request, got.checked, got.first_divergence) == (one.request, one.checked, None)
        assert got.max_abs_err == pytest.approx(one.max_abs_err, abs=1e-6)
    victim = max(range(len(items)), key=lambda i: items[i][3].shape[0])
    bad = items[victim][3].clone()
    bad[-1, 0] += 1.0
    items[victim] = (*items[victim][:3], bad)
    got = oracle.check_many(items + [(items[0][0], items[0][1], items[0][2], items[0][3][:0])])
    assert got[victim].first_divergence == bad.shape[0] - 1
    assert all(r.first_divergence is None for i, r in enumerate(got[:-1]) if i != victim)
    assert got[-1].checked == 0  # no rows: nothing to check


def test_a_live_request_checked_in_pieces_equals_one_whole_check():
    """A live request is checked as it grows, each time feeding only its new tokens against the
    contiguous cache of the earlier ones: the results equal one check of the whole, and a wrong
    row in a later piece is found at its index in the whole."""
    eng = Driver(make_engine(), make_workload(11, 9, prompt=(1, 30), out=(6, 12))).run()
    seqs = [s for s in eng.engine.seqs.values() if len(eng.logits.get(s.id, [])) >= 6]
    assert len(seqs) >= 3
    whole = Oracle(eng.engine.model)
    pieces = Oracle(eng.engine.model)
    for s in seqs:
        rows = torch.stack(eng.logits[s.id])
        bad = rows.clone()
        bad[-1, 3] += 1.0  # in the last piece
        for cut in (1, 3, rows.shape[0] - 1):
            part = pieces.check_many([(s.id, s.tokens, s.prompt_len, rows[:cut])], keep={s.id})[0]
            assert part.first_divergence is None and part.checked == cut
        assert pieces.past[s.id].checked == rows.shape[0] - 1
        got = pieces.check_many([(s.id, s.tokens, s.prompt_len, bad)])[0]
        one = whole.check(s.id, s.tokens, s.prompt_len, bad)
        assert got.first_divergence == one.first_divergence == rows.shape[0] - 1
        assert got.checked == one.checked == rows.shape[0]
        assert got.max_abs_err == pytest.approx(one.max_abs_err, abs=1e-5)
        assert s.id not in pieces.past  # its last check: the cache is dropped


def test_a_live_request_with_nothing_new_costs_no_pass():
    eng = Driver(make_engine(), make_workload(11, 4, prompt=(1, 30), out=(6, 12))).run()
    s = next(s for s in eng.engine.seqs.values() if len(eng.logits.get(s.id, [])) >= 6)
    rows = torch.stack(eng.logits[s.id])
    oracle = Oracle(eng.engine.model)
    first = oracle.check_many([(s.id, s.tokens, s.prompt_len, rows[:4])], keep={s.id})[0]
    passes = []
    real = oracle._forward
    oracle._forward = lambda *a: passes.append(1) or real(*a)
    again = oracle.check_many([(s.id, s.tokens, s.prompt_len, rows[:4])], keep={s.id})[0]
    assert not passes and (again.checked, again.max_abs_err) == (first.checked, first.max_abs_err)
    last = oracle.check_many([(s.id, s.tokens, s.prompt_len, rows)])[0]
    assert passes and last.checked == rows.shape[0] and s.id not in oracle.past


def test_requests_sharing_a_prompt_prefix_reuse_the_oracles_own_kv_with_the_same_results():
    """A prefix the oracle computed for one request is not computed again for another starting
    with the very same tokens; the results equal a fresh oracle's, and a wrong row of the second
    request is still found."""
    engine = make_engine()
    common = [random.Random(3).randrange(MODEL.vocab_size) for _ in range(20)]
    engine.add_request("a", common + [1, 2], 4)
    engine.add_request("b", common + [3], 4)
    logits = defaultdict(list)
    while engine.has_unfinished():
        for rid, row in engine.step().logits.items():
            logits[rid].append(row)
    items = [
        (r, engine.seqs[r].tokens, engine.seqs[r].prompt_len, torch.stack(logits[r])) for r in "ab"
    ]
    shared, fresh = Oracle(engine.model), Oracle(engine.model)
    shared.check_many(items[:1])
    fed = []
    real = shared._forward
    shared._forward = lambda batch, *a: fed.append(batch.shape[1]) or real(batch, *a)
    got, want = shared.check_many(items[1:])[0], fresh.check_many(items[1:])[0]
    assert fed == [len(items[1][1]) - 1 - 16]  # 16 of the 20 common tokens taken, none computed
    assert (got.checked, got.first_divergence) == (want.checked, None)
    assert got.max_abs_err == pytest.approx(want.max_abs_err, abs=1e-5)
    bad = items[1][3].clone()
    bad[0, 5] += 1.0
    assert shared.check_many([(*items[1][:3], bad)])[0].first_divergence == 0


def test_the_scheduler_owns_its_queues_and_calls_only_public_methods():
    """As nano-vllm's: the queues are the scheduler's, and it reaches the engine and the manager
    through their public names only (read from its source)."""
    import ast
    import inspect

    from kvchaos.engine import scheduler

    eng = make_engine(num_blocks=12, max_prefill_tokens=8)
    assert not hasattr(eng, "running") and not hasattr(eng, "waiting")
    for i in range(4):  # other prompts (no cache hits), 6 blocks each: more than 12 in all
        eng.add_request(f"r{i}", list(range(1 + 20 * i, 12 + 20 * i)), 12)
    assert [s.id for s in eng.scheduler.waiting] == ["r0", "r1", "r2", "r3"]
    preempted = []
    while eng.has_unfinished():
        preempted += eng.step().stats.preempted
    assert preempted and eng.counters["preemptions"] == len(preempted)  # the small pool preempts
    tree = ast.parse(inspect.getsource(scheduler))
    reached = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("engine", "bm", "table"):
                reached.add(node.attr)
    assert reached and not [a for a in reached if a.startswith("_")], reached
