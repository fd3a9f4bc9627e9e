"""kvchaos bench: the reference engine's performance, measured side by side with baselines in the
same run and reported as ratios (timings on a shared machine are noisy; a ratio against a baseline
measured alongside is not).

What is measured, and against what:
  - BlockPool single-block allocate+free pairs per second, against a bare Python list free pool
    (pop/append) and a short re-implementation of nano-vllm's BlockManager allocate/deallocate
    (deque free_block_ids + set used_block_ids + Block objects with ref_count).
  - BlockPool per-op time with 1,000,000 blocks against 1,000 blocks (O(1): ratio ~1), plain and
    with a fork still holding the freed block (decref does not free; the pool hands out another).
  - Prefix cache: reviving a cached free block from the middle of the free queue, 1M- vs 1k-block
    PrefixBlockPool (intrusive linked list), beside the same for nano-vllm's deque.remove.
  - Building a 1,000,000-block BlockManager, against building a bare list free pool.
  - Decode bookkeeping: 64 sequences appending one token per step through
    BlockManager.append_decode, against nano-vllm's per-sequence may_append (no prefix hashing).
  - Engine decode steps per second at batch 1 (default EngineConfig) and at batch 8 with 512-token
    contexts; the host bookkeeping share of a decode step (scheduling, block bookkeeping and table
    upload: (StepStats.host_s - prep_s) / latency_s), and the share of all host work before the
    model runs, building its input tensors included (host_s / latency_s).
  - Paged vs contiguous: the engine's decode step against a contiguous-cache decode step on the same
    Model weights, same batch and context, measured alternately so both see the same noise.
  - Asynchronous scheduling: the decode step with `async_scheduling` on against off, alternately.

Targets are reported, never asserted: `met` says whether this run met each one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from kvchaos.harness.bench.cold_start import bench_cold_start
from kvchaos.harness.bench.timing import perf
from kvchaos.harness.run.device import resolve_device
from kvchaos.harness.scenario import options


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
    cold_repeats=15,
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
    cold_repeats=3,
)


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
    import torch
    from rich.console import Console

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=132)
    device = resolve_device(device)
    saved_threads = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        return _run(quick, device, out_json, console)
    finally:
        torch.set_num_threads(saved_threads)


def _run(quick: bool, device: str, out_json: str | None, console) -> dict:
    # here, not at the top: `kvchaos bench --help` loads neither torch nor the engine
    import torch

    from kvchaos.harness.bench.blocks import (
        bench_build,
        bench_decode_bookkeeping,
        bench_pool_rates,
        bench_pool_scale,
    )
    from kvchaos.harness.bench.decode import bench_engine_b1, bench_paged_vs_contiguous
    from kvchaos.harness.bench.overhead import bench_harness_overhead
    from kvchaos.harness.bench.prefix import bench_revive_scale

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

        revive = bench_revive_scale(p["scale_repeats"])
        m["prefix_revive_1m_vs_1k"] = _metric(
            "revive cached free block, 1M vs 1k pool",
            "ns/op",
            revive["pool_1000000"],
            revive["pool_1000"],
            "1k-block pool",
            10,
            "<=",
            "ratio",
            higher_is_better=False,
            note="PrefixBlockPool.touch from the middle of the free queue",
        )
        m["nanovllm_revive_1m_vs_1k"] = _metric(
            "nano-vllm deque.remove revive, 1M vs 1k",
            "ns/op",
            revive["deque_1000000"],
            revive["deque_1000"],
            "1k-block deque",
            higher_is_better=False,
            note="free_block_ids.remove of a block in the middle, as nano-vllm's cache hit",
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

    # a config change's cost on the decode step, against the same engine without it
    from kvchaos.harness.bench.async_step import bench_async_step
    from kvchaos.harness.bench.offload_step import bench_offload_step

    agrees = {}
    for key, what, fn, on, off, base in (
        ("async_scheduling", "async scheduling", bench_async_step, "async_step_s",
         "sync_step_s", "the same engine, synchronous"),
        ("offload_tier", "host KV tier", bench_offload_step, "tier_step_s",
         "one_tier_step_s", "the same engine, one tier (plain manager)"),
    ):  # fmt: skip
        with console.status(f"bench: {what}") if console.is_terminal else nullcontext():
            got = fn(device, p["b8_steps"], p["b8_warmup"])
        agrees[f"{key}_tokens_agree"] = got["tokens_agree"]
        m[f"{key}_b8_ctx128"] = _metric(
            f"{what} on vs off, decode step B=8 ctx 128",
            "ms/step",
            got[on] * 1e3,
            got[off] * 1e3,
            base,
            1.1,
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
        m["call_log"] = _metric(
            "built-in suite checked, call log on vs off",
            "s",
            ov["checking"],
            ov["unlogged"],
            "the same, without the call log",
            1.1,
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

    with console.status("bench: cold start") if console.is_terminal else nullcontext():
        cold = bench_cold_start(p["cold_repeats"])
        m["cold_start_help"] = _metric(
            "kvchaos --help, a fresh process, vs python -c pass",
            "s",
            cold["help"],
            cold["python"],
            "python -c pass",
            3.0,
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
            **agrees,  # async_scheduling_ / offload_tier_tokens_agree
            "contiguous_attention": "torch SDPA over [:t+1] of per-layer [B, T, Hkv, D] caches, "
            "read in place, with the paged path's GQA formulation (query group as queries)",
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
    options.add(parser, "device", default="cpu", lead="the engine benchmarks")
    parser.add_argument(
        "--out",
        type=options.PATH,
        default="reports/bench.json",
        metavar="PATH",
        help="where to write the JSON report (default: reports/bench.json)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        run_bench(quick=args.quick, device=args.device, out_json=args.out)
    except ValueError as e:
        print(f"kvchaos bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvchaos bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
