"""kvchaos bench: the reference engine's performance, measured side by side with baselines in the
same run and reported as ratios (timings on a shared machine are noisy; a ratio against a baseline
measured alongside is not).

What is measured, and against what:
  - BlockPool single-block allocate+free pairs per second, against a bare Python list free pool
    (pop/append) and a short re-implementation of nano-vllm's BlockManager allocate/deallocate
    (deque free_block_ids + set used_block_ids + Block objects with ref_count).
  - BlockPool per-op time with 1,000,000 blocks against 1,000 blocks (O(1): ratio ~1), plain and
    with a fork still referencing the freed block (decref does not free; the pool hands out another).
  - Building a 1,000,000-block BlockManager, against building a bare list free pool.
  - Decode bookkeeping: 64 sequences appending one token per step through
    BlockManager.append_decode, against nano-vllm's per-sequence may_append (no prefix hashing).
  - Engine decode steps per second at batch 1 (default EngineConfig) and at batch 8 with 512-token
    contexts; the host bookkeeping share of a decode step (scheduling, block bookkeeping and table
    upload: (StepStats.host_s - prep_s) / latency_s), and the share of all host work before the
    model runs, building its input tensors included (host_s / latency_s).
  - Paged vs contiguous: the engine's decode step against a contiguous-cache decode step on the same
    Model weights, same batch and context, measured alternately so both see the same noise.

Targets are reported, never asserted: `met` says whether this run met each one.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from kvchaos.engine.block_manager import BlockManager, BlockPool
from kvchaos.engine.config import CacheConfig, EngineConfig
from kvchaos.engine.engine import Engine

perf = time.perf_counter


# -- baselines ---------------------------------------------------------------------------------
class _NanoBlock:
    """nano-vllm's Block (prefix-cache fields kept, as reset() touches them)."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class _NanoSeq:
    __slots__ = ("num_tokens", "block_table")

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.block_table: list[int] = []


class NanoVllmBlockManager:
    """nano-vllm's BlockManager allocate/deallocate style, re-implemented for comparison: a deque of
    free ids (allocate takes the head, free appends to the tail), a set of used ids, Block objects
    with ref counts. may_append is its decode path without prefix-cache hashing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [_NanoBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self, block_id: int) -> _NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def allocate_one(self) -> int:
        block_id = self.free_block_ids[0]
        self._allocate_block(block_id)
        return block_id

    def free_one(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._deallocate_block(block_id)

    def allocate(self, seq: _NanoSeq) -> None:
        for _ in range(-(-seq.num_tokens // self.block_size)):
            seq.block_table.append(self.allocate_one())

    def may_append(self, seq: _NanoSeq) -> None:
        if seq.num_tokens % self.block_size == 1:  # the newest token opened a block
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            seq.block_table.append(block_id)


# -- timing helpers ----------------------------------------------------------------------------
class _NoGC:
    """Timed regions run with the cyclic GC off (as timeit does)."""

    def __enter__(self):
        gc.collect()
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.was:
            gc.enable()


def _round_robin(fns: dict, repeats: int) -> dict[str, float]:
    """Run every timing function once per repeat, in rotating order so all see the same noise;
    return each one's median."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(fns[n]())
    return {n: statistics.median(v) for n, v in times.items()}


def _metric(
    label: str,
    unit: str,
    measured: float,
    baseline: float | None = None,
    baseline_name: str | None = None,
    target: float | None = None,
    target_op: str | None = None,
    target_on: str = "measured",
    higher_is_better: bool = True,
    note: str = "",
) -> dict:
    """One row. ratio is always measured / baseline; the target applies to `target_on`."""
    ratio = measured / baseline if baseline else None
    met = None
    if target is not None:
        v = measured if target_on == "measured" else ratio
        met = bool(v >= target) if target_op == ">=" else bool(v <= target)
    return dict(
        label=label,
        unit=unit,
        measured=measured,
        baseline=baseline,
        baseline_name=baseline_name,
        ratio=ratio,
        target=target,
        target_op=target_op,
        target_on=target_on,
        met=met,
        higher_is_better=higher_is_better,
        note=note,
    )


# -- block manager benchmarks ------------------------------------------------------------------
def bench_pool_rates(n: int, repeats: int, num_blocks: int = 65536) -> dict[str, float]:
    """Single-block allocate+free pairs per second: BlockPool, bare list, nano-vllm style."""
    pool = BlockPool(num_blocks)
    free_list = list(range(num_blocks - 1, -1, -1))
    nano = NanoVllmBlockManager(num_blocks, 16)
    loop = range(n)

    def ours() -> float:
        a, d = pool.allocate, pool.decref
        t = perf()
        for _ in loop:
            d(a())
        return perf() - t

    def bare() -> float:
        p, ap = free_list.pop, free_list.append
        t = perf()
        for _ in loop:
            ap(p())
        return perf() - t

    def nanovllm() -> float:
        a, d = nano.allocate_one, nano.free_one
        t = perf()
        for _ in loop:
            d(a())
        return perf() - t

    with _NoGC():
        med = _round_robin({"blockpool": ours, "list": bare, "nanovllm": nanovllm}, repeats)
    assert len(pool.free) == num_blocks and len(nano.used_block_ids) == 0
    return {k: n / v for k, v in med.items()}


def bench_pool_scale(
    n: int, repeats: int, small: int = 1_000, large: int = 1_000_000
) -> dict[str, float]:
    """Nanoseconds per pool operation at two pool sizes, each half full (blocks held by other
    sequences). `plain`: allocate, decref (frees). `shared`: allocate, incref (a fork shares it),
    decref (still referenced, not freed), allocate another, decref it, decref the first (the fork
    lets go): the pool hands out blocks while a shared prefix still references some."""
    pools = {}
    for size in (small, large):
        p = BlockPool(size)
        for _ in range(size // 2):
            p.allocate()
        pools[size] = p
    loop = range(n)

    def plain(p: BlockPool):
        def run() -> float:
            a, d = p.allocate, p.decref
            t = perf()
            for _ in loop:
                d(a())
            return (perf() - t) / (2 * n) * 1e9

        return run

    def shared(p: BlockPool):
        def run() -> float:
            a, i, d = p.allocate, p.incref, p.decref
            t = perf()
            for _ in loop:
                b = a()
                i(b)
                d(b)
                c = a()
                d(c)
                d(b)
            return (perf() - t) / (6 * n) * 1e9

        return run

    # The shared variant really re-uses blocks while the prefix holds one: check it once.
    p = pools[small]
    b = p.allocate()
    p.incref(b)
    p.decref(b)
    c = p.allocate()
    assert c != b and p.ref[b] == 1, "a block still referenced by a fork was handed out again"
    p.decref(c)
    p.decref(b)

    with _NoGC():
        med = _round_robin(
            {
                "plain_small": plain(pools[small]),
                "plain_large": plain(pools[large]),
                "shared_small": shared(pools[small]),
                "shared_large": shared(pools[large]),
            },
            repeats,
        )
    for size, p in pools.items():
        assert len(p.free) == size - size // 2
    return med


def bench_build(num_blocks: int, repeats: int) -> dict[str, float]:
    """Seconds to build a num_blocks BlockManager (default table shape), and a bare list free pool,
    median of `repeats` builds after one warm-up build of each."""
    cc = CacheConfig()

    def ours() -> float:
        t = perf()
        bm = BlockManager(num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq)
        dt = perf() - t
        del bm  # freeing a million ints is not part of the build
        return dt

    def bare() -> float:
        t = perf()
        free = list(range(num_blocks - 1, -1, -1))
        dt = perf() - t
        del free
        return dt

    with _NoGC():
        ours(), bare()  # warm-up
        return _round_robin({"blockmanager": ours, "list": bare}, repeats)


def bench_decode_bookkeeping(
    steps: int, repeats: int, num_seqs: int = 64, block_size: int = 16, prompt: int = 100
) -> dict[str, float]:
    """Microseconds per sequence per decode step of pure block bookkeeping: every sequence appends
    one token per step. Prompt lengths are staggered so block boundaries do not all coincide."""
    width = -(-(prompt + num_seqs + steps) // block_size) + 1
    num_blocks = num_seqs * width
    ids = [f"seq-{i}" for i in range(num_seqs)]

    def ours() -> float:
        bm = BlockManager(num_blocks, block_size, num_seqs, width)
        for i, s in enumerate(ids):
            bm.append(s, prompt + i)
        step = bm.append_decode
        t = perf()
        for _ in range(steps):
            step(ids)
        dt = perf() - t
        assert bm.num_tokens[ids[-1]] == prompt + num_seqs - 1 + steps
        return dt / (steps * num_seqs) * 1e6

    def nanovllm() -> float:
        bm = NanoVllmBlockManager(num_blocks, block_size)
        seqs = [_NanoSeq(prompt + i) for i in range(num_seqs)]
        for s in seqs:
            bm.allocate(s)
        may_append = bm.may_append
        t = perf()
        for _ in range(steps):
            for s in seqs:
                s.num_tokens += 1  # the token the last step produced
                may_append(s)
        dt = perf() - t
        assert len(seqs[-1].block_table) == -(-seqs[-1].num_tokens // block_size)
        return dt / (steps * num_seqs) * 1e6

    with _NoGC():
        return _round_robin({"blockmanager": ours, "nanovllm": nanovllm}, repeats)


# -- engine benchmarks -------------------------------------------------------------------------
def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    return device


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _prefill_until_decode(engine: Engine, batch: int) -> None:
    for _ in range(10_000):
        st = engine.step().stats
        if st.prefill_tokens == 0 and st.decode_tokens == batch:
            return
    raise RuntimeError("the engine never reached steady-state decode")


def bench_engine_b1(device: str, steps: int, warmup: int, prompt: int = 16) -> dict[str, float]:
    """Decode steps of the default engine at batch 1: per-step wall time (median) and host share.
    A default table row holds 512 tokens, so requests follow one another; only pure decode steps
    are timed (each request's prefill and its first decode step are not)."""
    cfg = EngineConfig(device=device)
    engine = Engine(cfg)
    rng = random.Random(0)
    max_new = cfg.cache.max_tokens_per_seq - prompt
    wall, lat, host, prep = [], [], [], []
    k = 0
    while len(wall) < steps:
        engine.add_request(f"b1-{k}", _prompt(rng, prompt, cfg.model.vocab_size), max_new)
        k += 1
        _prefill_until_decode(engine, 1)
        with _NoGC():
            while engine.has_unfinished() and len(wall) < steps:
                t = perf()
                st = engine.step().stats
                dt = perf() - t
                assert st.decode_tokens == 1 and st.prefill_tokens == 0
                if warmup > 0:
                    warmup -= 1
                    continue
                wall.append(dt)
                lat.append(st.latency_s)
                host.append(st.host_s)
                prep.append(st.prep_s)
    engine.close()
    return {"step_s": statistics.median(wall), "requests": k, **_host_shares(lat, host, prep)}


def _host_shares(lat: list[float], host: list[float], prep: list[float]) -> dict[str, float]:
    mean_lat = statistics.fmean(lat)
    return {
        "host_share": statistics.fmean(host) / mean_lat,
        "bookkeeping_share": (statistics.fmean(host) - statistics.fmean(prep)) / mean_lat,
    }


class ContiguousDecoder:
    """The baseline: the same Model, per-layer contiguous K/V [B, T, Hkv, D] preallocated; a decode
    step writes the new K/V at position t and runs plain batched SDPA over [:t+1]."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        cfg = model.cfg
        self.model, self.batch = model, batch
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [
            torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.groups = cfg.num_heads // cfg.num_kv_heads
        self.t = 0
        try:
            q = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
            self.gqa = True
        except (TypeError, RuntimeError):
            self.gqa = False

    def _sdpa(self, q, k, v, causal: bool):
        if not self.gqa:
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.model.scale)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=self.model.scale, enable_gqa=True
        )

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        b, n = self.batch, len(prompts[0])
        dev = self.model.device
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.arange(n, device=dev).repeat(b)

        def attend(layer, q, k, v):
            q, k, v = (x.view(b, n, x.shape[1], x.shape[2]) for x in (q, k, v))
            self.k[layer][:, :n] = k
            self.v[layer][:, :n] = v
            o = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            return o.transpose(1, 2).reshape(b * n, q.shape[2], q.shape[3])

        hidden = self.model.forward(tokens, positions, attend)
        self.t = n
        return self.model.logits(hidden.view(b, n, -1)[:, -1])

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
        """One decode step for the whole batch at position t: next tokens (greedy) and logits."""
        t, dev = self.t, self.model.device
        tok = torch.tensor(tokens, device=dev)
        positions = torch.full((self.batch,), t, dtype=torch.long, device=dev)

        def attend(layer, q, k, v):
            kc, vc = self.k[layer], self.v[layer]
            kc[:, t] = k
            vc[:, t] = v
            # The paged path's GQA formulation (a KV head's query group as its queries), so the
            # ratio measures paging alone: [B, Hkv, G, D] against [B, Hkv, t+1, D] read in place.
            b, h, d = q.shape
            hkv = kc.shape[2]
            o = F.scaled_dot_product_attention(
                q.view(b, hkv, h // hkv, d),
                kc[:, : t + 1].transpose(1, 2),
                vc[:, : t + 1].transpose(1, 2),
                scale=self.model.scale,
            )
            return o.reshape(b, h, d)

        logits = self.model.logits(self.model.forward(tok, positions, attend))
        self.t = t + 1
        return logits.argmax(-1).tolist(), logits


def bench_paged_vs_contiguous(
    device: str, steps: int, warmup: int, batch: int = 8, context: int = 512
) -> dict[str, float]:
    """Steady-state decode at batch x context: the engine's step and the contiguous baseline's step,
    alternated (who goes first flips every step) on the same inputs; the logits are compared too."""
    total = context + warmup + steps + 2
    cc = CacheConfig(
        num_blocks=max(512, batch * -(-total // 16)),
        max_blocks_per_seq=max(64, -(-total // 16)),
        max_num_seqs=max(16, batch),
    )
    # The whole batch prefills in one step, so every sequence decodes at the same context length.
    cfg = EngineConfig(device=device, cache=cc, max_prefill_tokens=batch * context)
    engine = Engine(cfg)
    rng = random.Random(1)
    prompts = [_prompt(rng, context, cfg.model.vocab_size) for _ in range(batch)]
    ids = [f"b{i}" for i in range(batch)]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, total - context)
    _prefill_until_decode(engine, batch)  # one prefill step, then the first decode step
    contig = ContiguousDecoder(engine.model, batch, total)
    first = contig.prefill(prompts).argmax(-1).tolist()
    first_agree = first == [engine.seqs[i].tokens[context] for i in ids]
    contig.step(
        [engine.seqs[i].tokens[context] for i in ids]
    )  # catch up with the engine's first decode

    eng_t, con_t, lat, host, prep = [], [], [], [], []
    max_err = 0.0

    def engine_step():
        t = perf()
        out = engine.step()
        return perf() - t, out

    def contig_step(inputs):
        _sync(device)
        t = perf()
        toks, logits = contig.step(inputs)
        return perf() - t, toks, logits

    with _NoGC():
        for k in range(warmup + steps):
            inputs = [engine.seqs[i].tokens[-1] for i in ids]
            if k % 2 == 0:
                te, out = engine_step()
                tc, _, logits = contig_step(inputs)
            else:
                tc, _, logits = contig_step(inputs)
                te, out = engine_step()
            st = out.stats
            assert st.decode_tokens == batch and st.prefill_tokens == 0
            got = torch.stack([out.logits[i] for i in ids])
            max_err = max(max_err, float((got - logits.float().cpu()).abs().max()))
            if k >= warmup:
                eng_t.append(te)
                con_t.append(tc)
                lat.append(st.latency_s)
                host.append(st.host_s)
                prep.append(st.prep_s)
    engine.close()
    return {
        "engine_step_s": statistics.median(eng_t),
        "contiguous_step_s": statistics.median(con_t),
        "max_abs_logit_err": max_err,
        "first_token_agrees": first_agree,
        **_host_shares(lat, host, prep),
    }


# -- the whole bench ---------------------------------------------------------------------------
FULL = dict(
    pool_n=200_000,
    pool_repeats=15,
    scale_n=100_000,
    scale_repeats=11,
    build_repeats=7,
    decode_steps=1_000,
    decode_repeats=15,
    b1_steps=1_000,
    b1_warmup=30,
    b8_steps=400,
    b8_warmup=10,
    overhead_repeats=3,
    overhead_scenarios=None,
)
QUICK = dict(
    pool_n=5_000,
    pool_repeats=3,
    scale_n=2_000,
    scale_repeats=3,
    build_repeats=1,
    decode_steps=40,
    decode_repeats=3,
    b1_steps=10,
    b1_warmup=2,
    b8_steps=6,
    b8_warmup=2,
    overhead_repeats=1,
    overhead_scenarios=["table-overflow-detect"],
)


def bench_harness_overhead(
    repeats: int, names: list[str] | None = None, device: str = "cpu"
) -> dict[str, float]:
    """The built-in suite (seed 0) driven three ways: the engine alone (workload and faults, no
    harness); with the harness's checking (history, snapshots, oracle, checkers and verdict, the
    history kept in memory); and as `kvchaos run` does it, with each run's folder written (history,
    results, incidents, report.html) and the report index rebuilt once at the end."""
    import tempfile

    from kvchaos.harness.judge.history import History
    from kvchaos.harness.judge.runner import _Run, run_scenario
    from kvchaos.harness.judge.scenario import builtin_scenarios
    from kvchaos.harness.report.index import update_index
    from kvchaos.harness.report.render import publish

    scs = [s for s in builtin_scenarios() if names is None or s.name in names]
    with tempfile.TemporaryDirectory() as tmp:

        def harness() -> float:
            t = perf()
            for sc in scs:
                publish(run_scenario(sc, 0, device=device, report_dir=tmp), index=False)
            update_index(tmp)
            return perf() - t

        def checking() -> float:
            t = perf()
            for sc in scs:
                run_scenario(sc, 0, device=device, report_dir=None)
            return perf() - t

        def alone() -> float:
            t = perf()
            for sc in scs:
                run = _Run(sc, 0, device, History(None, keep=False), observe=False)
                run.arm()
                run.run()
            return perf() - t

        return _round_robin({"harness": harness, "checking": checking, "alone": alone}, repeats)


def run_bench(
    quick: bool = False,
    device: str = "cpu",
    out_json: str | None = None,
    console=None,
    threads: int | None = 1,
) -> dict:
    """Run every benchmark, print a table, write JSON (when out_json is given); return the report.

    threads: torch intra-op threads while benchmarking on the CPU (restored afterwards; None keeps
    torch's setting). One by default: the default model's tensors are tiny, so a second thread
    buys nothing, and on a shared machine an OpenMP barrier waiting for a busy core turns a 1 ms
    step into a 50 ms one."""
    from rich.console import Console

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=132)
    device = _resolve_device(device)
    saved_threads = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        return _run(quick, device, out_json, console)
    finally:
        torch.set_num_threads(saved_threads)


def _run(quick: bool, device: str, out_json: str | None, console) -> dict:
    p = QUICK if quick else FULL
    t_start = perf()
    m: dict[str, dict] = {}

    with console.status("bench: block pool") if console.is_terminal else nullcontext():
        rates = bench_pool_rates(p["pool_n"], p["pool_repeats"])
        m["pool_alloc_free_per_s"] = _metric(
            "BlockPool alloc+free pairs/s vs list pool",
            "pairs/s",
            rates["blockpool"],
            rates["list"],
            "bare list pop/append",
            3_500_000,
            ">=",
        )
        m["pool_vs_nanovllm"] = _metric(
            "BlockPool alloc+free pairs/s vs nano-vllm",
            "pairs/s",
            rates["blockpool"],
            rates["nanovllm"],
            "nano-vllm BlockManager style",
        )

        scale = bench_pool_scale(p["scale_n"], p["scale_repeats"])
        m["pool_scale_1m_vs_1k"] = _metric(
            "per-op time, 1M- vs 1k-block pool",
            "ns/op",
            scale["plain_large"],
            scale["plain_small"],
            "1k-block pool",
            1.2,
            "<=",
            "ratio",
            higher_is_better=False,
        )
        m["pool_scale_1m_vs_1k_shared"] = _metric(
            "per-op time, 1M vs 1k, fork holds block",
            "ns/op",
            scale["shared_large"],
            scale["shared_small"],
            "1k-block pool",
            1.2,
            "<=",
            "ratio",
            higher_is_better=False,
        )

        build = bench_build(1_000_000, p["build_repeats"])
        m["build_1m_blockmanager_s"] = _metric(
            "build 1M-block BlockManager vs list",
            "s",
            build["blockmanager"],
            build["list"],
            "bare list(range(1M))",
            0.1,
            "<=",
            higher_is_better=False,
        )

        dec = bench_decode_bookkeeping(p["decode_steps"], p["decode_repeats"])
        m["decode_bookkeeping_us"] = _metric(
            "decode bookkeeping, 64 seqs vs nano-vllm",
            "us/seq/step",
            dec["blockmanager"],
            dec["nanovllm"],
            "nano-vllm may_append",
            0.15,
            "<=",
            higher_is_better=False,
        )

    with console.status("bench: engine") if console.is_terminal else nullcontext():
        b1 = bench_engine_b1(device, p["b1_steps"], p["b1_warmup"])
        m["engine_decode_b1_steps_per_s"] = _metric(
            "engine decode steps/s, B=1", "steps/s", 1.0 / b1["step_s"], target=1000, target_op=">="
        )
        m["engine_bookkeeping_share_b1"] = _metric(
            "host bookkeeping share of decode step, B=1",
            "fraction",
            b1["bookkeeping_share"],
            target=0.10,
            target_op="<=",
            higher_is_better=False,
        )
        m["engine_host_share_b1"] = _metric(
            "all host work share (+ input tensors), B=1",
            "fraction",
            b1["host_share"],
            higher_is_better=False,
        )

        pc = bench_paged_vs_contiguous(device, p["b8_steps"], p["b8_warmup"])
        m["engine_decode_b8_ctx512_steps_per_s"] = _metric(
            "engine decode steps/s, B=8 ctx 512 vs contig",
            "steps/s",
            1.0 / pc["engine_step_s"],
            1.0 / pc["contiguous_step_s"],
            "contiguous-cache decode",
        )
        m["engine_bookkeeping_share_b8_ctx512"] = _metric(
            "host bookkeeping share, B=8 ctx 512",
            "fraction",
            pc["bookkeeping_share"],
            target=0.10,
            target_op="<=",
            higher_is_better=False,
        )
        m["engine_host_share_b8_ctx512"] = _metric(
            "all host work share (+ input tensors), B=8",
            "fraction",
            pc["host_share"],
            higher_is_better=False,
        )
        m["paged_vs_contiguous_b8_ctx512"] = _metric(
            "paged vs contiguous step, B=8 ctx 512",
            "ms/step",
            pc["engine_step_s"] * 1e3,
            pc["contiguous_step_s"] * 1e3,
            "contiguous-cache decode",
            1.3,
            "<=",
            "ratio",
            higher_is_better=False,
        )

    with console.status("bench: harness overhead") if console.is_terminal else nullcontext():
        ov = bench_harness_overhead(p["overhead_repeats"], p["overhead_scenarios"], device)
        m["harness_checking_suite"] = _metric(
            "built-in suite: oracle+checkers+history vs alone",
            "s",
            ov["checking"],
            ov["alone"],
            "engine + workload + faults alone",
            1.5,
            "<=",
            "ratio",
            higher_is_better=False,
        )
        m["harness_overhead_suite"] = _metric(
            "built-in suite: + run folders, reports vs alone",
            "s",
            ov["harness"],
            ov["alone"],
            "engine + workload + faults alone",
            1.5,
            "<=",
            "ratio",
            higher_is_better=False,
        )

    report = {
        "meta": {
            "quick": quick,
            "device": device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": perf() - t_start,
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "params": p,
            "gc_disabled_while_timing": True,
            "ratio": "measured / baseline; the target applies to target_on (measured or ratio)",
        },
        "metrics": m,
        "checks": {
            "paged_vs_contiguous_max_abs_logit_err": pc["max_abs_logit_err"],
            "paged_vs_contiguous_first_token_agrees": pc["first_token_agrees"],
            "contiguous_attention": "torch SDPA over [:t+1] of per-layer [B, T, Hkv, D] caches, read in place, "
            "with the paged path's GQA formulation (query group as queries)",
        },
    }
    _print_table(report, console)
    if out_json:
        path = Path(out_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        console.print(f"wrote {path}")
    return report


def _num(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _with_unit(v: float, unit: str) -> str:
    if unit == "fraction":
        return f"{v * 100:.1f}%"
    return f"{_num(v)} {unit}"


def _print_table(report: dict, console) -> None:
    from rich.table import Table

    meta = report["meta"]
    table = Table(
        title=f"kvchaos bench ({'quick' if meta['quick'] else 'full'}, device {meta['device']}, "
        f"{meta['elapsed_s']:.1f} s)"
    )
    for col, just in (
        ("metric", "left"),
        ("measured", "right"),
        ("baseline", "right"),
        ("ratio", "right"),
        ("target", "right"),
        ("met", "center"),
    ):
        table.add_column(col, justify=just)
    for r in report["metrics"].values():
        base = "—" if r["baseline"] is None else _with_unit(r["baseline"], r["unit"])
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        if r["target"] is None:
            target, met = "—", "—"
        else:
            t = (
                f"{r['target']:g}x"
                if r["target_on"] == "ratio"
                else _with_unit(r["target"], r["unit"])
            )
            target = f"{'ratio ' if r['target_on'] == 'ratio' else ''}{r['target_op']} {t}"
            met = "[green]yes[/]" if r["met"] else "[red]no[/]"
        table.add_row(r["label"], _with_unit(r["measured"], r["unit"]), base, ratio, target, met)
    console.print(table)
    console.print(
        f"[dim]ratio = measured / baseline. paged vs contiguous max |logit diff|: "
        f"{report['checks']['paged_vs_contiguous_max_abs_logit_err']:.2e}[/]"
    )


# -- CLI ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="tiny repeat counts: runs in a few seconds"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="device for the engine benchmarks (default: cpu)",
    )
    parser.add_argument(
        "--out",
        default="reports/bench.json",
        metavar="PATH",
        help="where to write the JSON report (default: reports/bench.json)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        run_bench(quick=args.quick, device=args.device, out_json=args.out)
    except RuntimeError as e:
        print(f"kvchaos bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvchaos bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
