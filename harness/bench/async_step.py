"""The cost of a config change on the engine's decode step: the same engine with it and without,
same weights and requests, stepped alternately (who goes first flips every step) so both see the
same noise; their tokens must agree. bench_async_step: `async_scheduling` on and off (the host
tier's row, harness/bench/offload_step.py, steps its pair the same way)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import replace

from kvchaos.engine.config import CacheConfig, EngineConfig
from kvchaos.engine.engine import Engine
from kvchaos.harness.bench.timing import NoGC, perf


def paired_steps(
    device: str,
    steps: int,
    warmup: int,
    change: Callable[[EngineConfig], EngineConfig],
    batch: int = 8,
    context: int = 128,
    prefix_caching: bool = True,
) -> tuple[float, float, bool]:
    """(median step of the engine as configured, of the changed one, their tokens agreed)."""
    total = context + warmup + steps + 2
    cc = CacheConfig(
        num_blocks=max(256, batch * -(-total // 16)),
        max_blocks_per_seq=max(32, -(-total // 16)),
        max_num_seqs=max(16, batch),
        prefix_caching=prefix_caching,
    )
    cfg = EngineConfig(device=device, cache=cc, max_prefill_tokens=batch * context)
    engines = [Engine(cfg), Engine(change(cfg))]
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
    return statistics.median(times[0]), statistics.median(times[1]), agree


def bench_async_step(
    device: str, steps: int, warmup: int, batch: int = 8, context: int = 128
) -> dict[str, float]:
    sync, async_, agree = paired_steps(
        device, steps, warmup, lambda c: replace(c, async_scheduling=True), batch, context
    )
    return {"sync_step_s": sync, "async_step_s": async_, "tokens_agree": agree}
