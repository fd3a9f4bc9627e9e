"""The host tier's costs and savings. bench_offload_step: the decode step of the same engine
(the plain manager) with `[engine.offload]` on and off, same weights and requests, stepped
alternately (who goes first flips every step); their tokens must agree. tier_saving: the peak
device blocks a think-time workload holds with the tier and without it (same scenario, same
seed), from the runs' own step events."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from kvchaos.engine.config import CacheConfig, EngineConfig, OffloadConfig
from kvchaos.engine.engine import Engine
from kvchaos.harness.bench.timing import NoGC, perf

SAVING_SCENARIO = "offload-memory-clean"  # sessions with think time, a pool with room for all


def bench_offload_step(
    device: str, steps: int, warmup: int, batch: int = 8, context: int = 128
) -> dict[str, float]:
    total = context + warmup + steps + 2
    cc = CacheConfig(
        num_blocks=max(256, batch * -(-total // 16)),
        max_blocks_per_seq=max(32, -(-total // 16)),
        max_num_seqs=max(16, batch),
        prefix_caching=False,  # the manager offering "offload"
    )
    cfg = EngineConfig(device=device, cache=cc, max_prefill_tokens=batch * context)
    tier = replace(cfg, offload=OffloadConfig(host_blocks=2 * cc.num_blocks))
    engines = [Engine(cfg), Engine(tier)]
    rng = random.Random(2)
    prompts = [[rng.randrange(cfg.model.vocab_size) for _ in range(context)] for _ in range(batch)]
    for e in engines:
        for i, p in enumerate(prompts):
            e.add_request(f"a{i}", p, total - context)
        e.step()  # the whole batch prefills in one step
    times: list[list[float]] = [[], []]
    agree = True
    with NoGC():
        for k in range(warmup + steps):
            outs = [None, None]
            for j in (0, 1) if k % 2 == 0 else (1, 0):
                t = perf()
                outs[j] = engines[j].step()
                if k >= warmup:
                    times[j].append(perf() - t)
            agree = agree and outs[0].tokens == outs[1].tokens
    for e in engines:
        e.close()
    return {
        "one_tier_step_s": statistics.median(times[0]),
        "tier_step_s": statistics.median(times[1]),
        "tokens_agree": agree,
    }


def peak_device_blocks(events: list[dict], num_blocks: int) -> int:
    """The most device blocks in use at any step (the step events' free counts)."""
    return max((num_blocks - e["free_blocks"] for e in events if e.get("e") == "step"), default=0)


def tier_saving(name: str = SAVING_SCENARIO, seed: int = 0) -> dict:
    """Peak device blocks with the scenario's tier and with its [engine.offload] removed."""
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    sc = load_scenario(name)
    one = sc.model_copy(update={"engine": {k: v for k, v in sc.engine.items() if k != "offload"}})
    out = {}
    for key, s in (("with_tier", sc), ("without_tier", one)):
        r = run_scenario(s, seed, report_dir=None)
        n = s.engine_config().cache.num_blocks
        out[key] = peak_device_blocks(r.events, n)
        used = [n - e["free_blocks"] for e in r.events if e.get("e") == "step"]
        out[f"{key}_mean"] = round(sum(used) / max(1, len(used)), 1)
        out[f"{key}_verdict"] = r.verdict
        concurrency = [e["running"] for e in r.events if e.get("e") == "step"]
        out[f"{key}_max_running"] = max(concurrency, default=0)
    out["requests"] = sc.workload.num_requests
    out["saving"] = 1 - out["with_tier"] / max(1, out["without_tier"])
    out["mean_saving"] = 1 - out["with_tier_mean"] / max(1.0, out["without_tier_mean"])
    return out
