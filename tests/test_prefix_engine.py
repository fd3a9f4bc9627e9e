"""The engine with the reference prefix cache (cache.prefix_caching): a hit's positions are read
from the cache, never recomputed, and the outputs equal those of the engine that recomputes
everything; the last prompt token is always computed; a readmission hits its own blocks; LRU
eviction and revival; an answer over the cap is the manager's error, naming the call."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_model import tiny_model

from kvchaos.engine import CacheConfig, Engine, EngineConfig
from kvchaos.engine.boundary import ManagerError
from kvchaos.engine.prefix_manager import PrefixCachingManager

BS = 4
MODEL = tiny_model()


def config(caching: bool, num_blocks: int = 40) -> EngineConfig:
    cache = CacheConfig(
        block_size=BS, num_blocks=num_blocks, max_blocks_per_seq=16, max_num_seqs=4,
        prefix_caching=caching,
    )  # fmt: skip
    return EngineConfig(model=MODEL, cache=cache, seed=5, attention_backend="torch")


def serve(eng: Engine, prompts: list[tuple[str, list[int]]], new: int = 5) -> dict:
    """One request after another (each finished before the next): id -> output tokens, and the
    prefill tokens each step computed."""
    out = {}
    for rid, prompt in prompts:
        eng.add_request(rid, prompt, new)
        got, prefilled = [], 0
        while eng.has_unfinished():
            o = eng.step()
            prefilled += o.stats.prefill_tokens
            got += [o.tokens[rid]] if rid in o.tokens else []
        out[rid] = (got, prefilled)
    return out


def hits(eng: Engine) -> int:
    return eng.counters["hit_tokens"]


PROMPT = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 11]  # 11 tokens: 2 full blocks + 3


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_outputs():
    cached, plain = Engine(config(True)), Engine(config(False))
    assert isinstance(cached.bm.manager, PrefixCachingManager)
    reqs = [("a", PROMPT), ("b", PROMPT), ("c", PROMPT[:9] + [30, 31])]
    got, want = serve(cached, reqs), serve(plain, reqs)
    assert [got[r][0] for r in "abc"] == [want[r][0] for r in "abc"]
    # b: floor((11 - 1) / 4) * 4 = 8 tokens hit; c shares the first 2 blocks too
    assert [got[r][1] for r in "abc"] == [11, 3, 3]
    assert hits(cached) == 16 and cached.counters["admissions"] == 3
    assert "admissions" not in plain.counters  # no cache, no hit counters


def test_an_aligned_prompt_recomputes_its_last_block():
    eng = Engine(config(True))
    got = serve(eng, [("a", PROMPT[:8]), ("b", PROMPT[:8])])
    assert got["b"][1] == 4  # the cap len - 1 = 7 leaves one whole block: 4 tokens recomputed
    assert hits(eng) == 4


def test_a_readmission_after_preemption_hits_its_own_blocks():
    cached, plain = Engine(config(True)), Engine(config(False))
    outs = []
    for eng in (cached, plain):
        eng.add_request("a", PROMPT, 8)
        for _ in range(4):
            eng.step()
        eng.scheduler.preempt(eng.seqs["a"])
        toks = []
        while eng.has_unfinished():
            toks += [t for r, t in eng.step().tokens.items()]
        outs.append(list(eng.seqs["a"].tokens))
    assert outs[0] == outs[1]
    assert hits(cached) >= 12  # 11 prompt + 3 output tokens known: 3 full blocks back


def test_lru_evicts_the_oldest_freed_blocks_and_a_survivor_is_revived():
    eng = Engine(config(True, num_blocks=8))  # 8 blocks: a's 3 blocks, then pressure
    serve(eng, [("a", PROMPT)], new=1)
    serve(eng, [("b", [50] * 4)], new=1)  # 2 blocks from the never-used end of the queue
    before = hits(eng)
    serve(eng, [("a2", PROMPT)], new=1)
    assert hits(eng) - before == 8  # a's blocks were still cached: revived
    serve(eng, [("big", [40 + i % 9 for i in range(29)])], new=1)  # 8 blocks: evicts everything
    before = hits(eng)
    serve(eng, [("a3", PROMPT)], new=1)
    assert hits(eng) == before  # evicted: computed again
    eng.bm.manager.pool.check()


class OverAnswering(PrefixCachingManager):
    """Matches on every known token, ignoring the cap (as older vLLM releases left it to the
    scheduler)."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        return super().admit(seq_id, token_ids, num_new_tokens, len(token_ids))


def test_an_answer_over_the_cap_is_the_managers_error():
    cfg = config(True)
    eng = Engine(cfg, OverAnswering(cfg.cache.num_blocks, BS))
    serve(eng, [("a", PROMPT[:8])])
    with pytest.raises(ManagerError) as caught:  # the whole prompt cached: it answers 8 > 7
        serve(eng, [("b", PROMPT[:8])])
    assert caught.value.call == "admit" and caught.value.error.rule == "hit_over_cap"
    assert str(caught.value).startswith("admit('b', [7, 3, 9, 1, 4, 4, 2, 8], 8, 7) answered 8:")
    assert eng.counters["hits_capped"] == 0 and not eng.seqs["b"].holds


def test_prefix_caching_is_on_by_default_and_in_the_config_hash():
    on, off = EngineConfig(), config(False)
    assert on.cache.prefix_caching and on.to_dict()["cache"]["prefix_caching"] is True
    assert (
        off.config_hash()
        != replace(off, cache=replace(off.cache, prefix_caching=True)).config_hash()
    )


@pytest.mark.parametrize("name", ["shared", "multiturn", "samples", "segments"])
def test_prefix_workloads_pass_with_the_cache_on_and_report_a_hit_rate(name, tmp_path):
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    sc = load_scenario(f"scenarios/prefix-{name}-clean.toml")
    assert sc.engine["cache"]["prefix_caching"] is True
    r = run_scenario(sc, 0, report_dir=tmp_path)
    assert r.verdict == "PASS", r.summary
    pc = r.results["metrics"]["prefix_cache"]
    assert pc["hit_tokens"] > 0 and 0 < pc["hit_rate"] < 1
    publish(r)
    assert "prefix cache</th><td>hit rate" in (r.run_dir / "report.html").read_text()


class RollbackForgetsCache(PrefixCachingManager):
    """A non-atomic admission that wants a block of lookahead: takes blocks one by one (allocate
    evicts cached entries on the way) and gives them back on running out, the evicted entries
    lost: a refusal that changed the cache."""

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        pool, taken = self.pool, []
        try:
            for _ in range(-(-min(num_new_tokens, len(token_ids)) // self.block_size) + 1):
                taken.append(pool.allocate())
        finally:
            for b in taken:
                pool.free(b)
        return super().admit(seq_id, token_ids, num_new_tokens, max_computed)


def test_a_refusal_that_evicted_cache_entries_is_recorded_and_judged():
    cfg = config(True, num_blocks=4)
    eng = Engine(cfg, RollbackForgetsCache(4, BS))
    events = []
    eng.seams.on_event = lambda kind, data: events.append((kind, data))
    serve(eng, [("a", PROMPT[:8])], new=1)  # its 2 blocks cached, then free
    eng.add_request("b", [20 + i for i in range(15)], 1)  # fits the estimate (4), not lookahead
    eng.step()
    refusals = [d for k, d in events if k == "refusal"]
    assert refusals and "prefix cache: 2 entries gone" in refusals[0]["changed"]
