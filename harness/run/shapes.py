"""Workload shapes that real prefix-cache bugs need ([workload.shapes]), on any manager: each a
count of rounds, its requests drawn from their own random stream (a plan without the section is
what it always was). Ids s<kind><round>...; each round waits on the one before it.

  boilerplate   the same boilerplate blocks after two different prefixes, the free queue cycled
                between them: A = P1 + B, fillers that allocate the whole pool, C = P2 + B, then
                D = P1 + B looks B up again along A's chain (nano-vllm 44a51af's stale hash index)
  prefill_aborts  a prompt longer than one prefill chunk, cancelled after its first chunk; then
                a request with the same prompt looks up what it keyed (vllm#34587's window)
  pressure_hits a cached source, holders whose decode fills the pool, then requests repeating the
                source's whole blocks one after another: admissions with hits on a nearly full
                pool, some refused (the revived hit takes more than the estimate counted)
  whole_blocks  a prompt of exactly whole blocks, then the same prompt again once it finished:
                a fully cached prompt (the hit capped below the last token)
"""

from __future__ import annotations

import random

from kvchaos.faults.plan import Action, Plan

KINDS = ("boilerplate", "prefill_aborts", "pressure_hits", "whole_blocks")


def add_shapes(plan: Plan, shapes, seed: int, cache, chunk: int) -> None:
    """shapes: the [workload.shapes] section; cache (the engine's CacheConfig) and chunk (its
    max_prefill_tokens): what the shapes are cut to."""
    bs, num_blocks, seqs = cache.block_size, cache.num_blocks, cache.max_num_seqs
    row = cache.max_tokens_per_seq
    rng = random.Random(f"{seed}/shapes")
    last: list[str | None] = [None]  # the previous round's last request

    def add(req, prompt, out, when="finished", after=None) -> None:
        after = after if after is not None else last[0]
        plan.add(Action(1, "submit", req, list(prompt), out, when=when, after=after))

    def tokens(n: int) -> list[int]:
        return plan.prompt(n, rng)

    blocks = max(1, min(4, row // bs // 4))  # a boilerplate / source: whole blocks
    for i in range(shapes.boilerplate):
        p1, p2, b = tokens(bs), tokens(bs), tokens(blocks * bs)  # two prefixes, one block each
        a, c, d = f"sb{i}a", f"sb{i}c", f"sb{i}d"
        add(a, p1 + b, 2)
        prev = _fillers(f"sb{i}f", num_blocks * bs, row, add, tokens, a)
        add(c, p2 + b, 2, after=prev)
        add(d, p1 + b + tokens(bs), 2, after=c)
        last[0] = d
    for i in range(shapes.prefill_aborts):
        n = min(row - 4, 2 * chunk + bs // 2 + 1)
        src, a, b = tokens(n), f"sa{i}a", f"sa{i}b"
        add(a, src, 4)
        plan.add(Action(1, "cancel", a, when="prefill", origin="workload"))
        add(b, src[: chunk + bs] + tokens(bs), 4, after=a)
        last[0] = b
    for i in range(shapes.pressure_hits):
        # a cached source; holders whose decode grows past the pool; a chain of requests
        # repeating the source, each once the one before finished, so each revives its cached
        # blocks from the free queue (more than the scheduler's estimate counts) as the pool fills
        src, s = tokens(blocks * bs), f"sp{i}s"
        add(s, src, 2)
        holders = [f"sp{i}h{j}" for j in range(max(1, seqs - 2))]
        for h in holders:
            add(h, tokens(bs), row - bs - 1, after=s)
        prev = holders[-1]
        for j in range(6):
            q = f"sp{i}b{j}"
            add(
                q,
                src + tokens(chunk + rng.randint(1, bs)),
                2,
                when="decode" if j == 0 else "finished",
                after=prev,
            )
            prev = q
        last[0] = prev
    for i in range(shapes.whole_blocks):
        src = tokens(rng.randint(2, max(2, row // bs // 2)) * bs)
        a, b = f"sw{i}a", f"sw{i}b"
        add(a, src, 2)
        add(b, src, 2, after=a)
        last[0] = b


def _fillers(prefix: str, total: int, row: int, add, tokens, after: str) -> str:
    """Requests of fresh tokens allocating `total` tokens' blocks one after another (each waits
    on the one before: the free queue cycles through the pool). Returns the last one's id."""
    size, prev, j = max(2, min(row - 2, total // 3)), after, 0
    while total > 0:
        n = min(size, max(2, total))
        add(f"{prefix}{j}", tokens(n), 1, after=prev)
        prev, total, j = f"{prefix}{j}", total - n, j + 1
    return prev
