"""Real tensor-parallel ranks against the in-process simulation: engine steps per second on the same
workload and config, the ratio, and where a distributed step's time goes (per rank: scheduling,
each kind of collective, compute).

    python -m kvchaos.harness.bench.distributed [--world-size 2] [--repeats 3]
        [--out reports/bench-distributed.json]

The two engines run alternately, `repeats` times each, so both see the same neighbours on a shared
machine; steps/s is the median. The followers are launched once, before timing. Both runs must
produce the same tokens (checked). A collective's time includes waiting for the slowest rank to
reach it: the follower's `bcast` (the step's header and batch) is mostly waiting for rank 0 to
schedule the step, and the per-layer `gather` absorbs any imbalance between the ranks' compute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvchaos.engine.cluster import Cluster
from kvchaos.engine.config import CacheConfig, EngineConfig
from kvchaos.engine.distributed import DistEngine
from kvchaos.engine.engine import Engine
from kvchaos.harness.scenario.options import PATH

WORKLOADS = {  # name: (requests, prompt length range, new tokens)
    "batch 1": (1, (32, 32), 96),
    "batch 16": (16, (16, 128), 64),
}
COLLECTIVES = ("bcast", "table", "ack", "gather")


def _drive(engine, n: int, prompt: tuple[int, int], new: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        engine.add_request(
            f"r{i}",
            [rng.randrange(engine.config.model.vocab_size) for _ in range(rng.randint(*prompt))],
            new,
        )
    stats, tokens = [], []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        out = engine.step()
        stats.append(out.stats)
        tokens.append(out.tokens)
    return time.perf_counter() - t0, stats, tokens


def _summary(wall: float, stats: list) -> dict:
    lat, host = sum(s.latency_s for s in stats), sum(s.host_s for s in stats)
    wait = sum(s.wait_s for s in stats)  # on the other ranks, before the model runs
    return {
        "steps": len(stats),
        "wall_s": wall,
        "steps_per_s": len(stats) / wall,
        "step_ms": wall / len(stats) * 1e3,
        "host_s": host,
        "model_s": lat - host - wait,
    }


def bench(world: int = 2, repeats: int = 3, device: str = "cpu") -> dict:
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=256, max_blocks_per_seq=16, max_num_seqs=16),
        tp_size=world,
        device=device,
        attention_backend="torch",
    )
    report = {
        "meta": {
            "world_size": world,
            "repeats": repeats,
            "device": device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "threads_per_rank": 1,
            "load_avg_before": os.getloadavg(),
            "config": cfg.to_dict(),
        },
        "workloads": {},
    }
    t_start = time.perf_counter()
    with Cluster() as cluster:
        warm = DistEngine(cfg, cluster=cluster)  # launches the followers, outside the timing
        _drive(warm, 1, (8, 8), 4)
        warm.close()
        for name, (n, prompt, new) in WORKLOADS.items():
            sim_runs, dist_runs = [], []
            for _ in range(repeats):
                wall, stats, sim_tokens = _drive(Engine(cfg), n, prompt, new)
                sim_runs.append(_summary(wall, stats))
                eng = DistEngine(cfg, cluster=cluster)
                wall, stats, dist_tokens = _drive(eng, n, prompt, new)
                eng.close()
                run = _summary(wall, stats)
                r0 = eng.rank_timers[0]
                coll0 = sum(r0[k] for k in COLLECTIVES)
                # rank 0's host_s is its own scheduling: the collectives before the model are wait_s
                run["ranks"] = [
                    {
                        "schedule_s": run["host_s"],
                        "compute_s": r0["compute"],
                        **{f"{k}_s": r0[k] for k in COLLECTIVES},
                        "collectives_s": coll0,
                    }
                ]
                for t in eng.rank_timers[1:]:
                    run["ranks"].append(
                        {
                            "compute_s": t["compute"],
                            **{f"{k}_s": t[k] for k in COLLECTIVES},
                            "collectives_s": sum(t[k] for k in COLLECTIVES),
                        }
                    )
                run["identical_tokens"] = dist_tokens == sim_tokens
                dist_runs.append(run)
            sim = statistics.median(r["steps_per_s"] for r in sim_runs)
            dist = statistics.median(r["steps_per_s"] for r in dist_runs)
            mid = sorted(dist_runs, key=lambda r: r["steps_per_s"])[len(dist_runs) // 2]
            report["workloads"][name] = {
                "requests": n,
                "prompt_len": list(prompt),
                "new_tokens": new,
                "steps": mid["steps"],
                "collectives_per_step": 3 + cfg.model.num_layers,
                "simulated_steps_per_s": sim,
                "distributed_steps_per_s": dist,
                "ratio": dist / sim,
                "identical_tokens": all(r["identical_tokens"] for r in dist_runs),
                "distributed_median_run": mid,
                "simulated_runs": sim_runs,
                "distributed_runs": dist_runs,
            }
    report["meta"]["elapsed_s"] = time.perf_counter() - t_start
    report["meta"]["load_avg_after"] = os.getloadavg()
    return report


def print_report(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    m = report["meta"]
    t = Table(
        title=f"kvchaos: {m['world_size']} real ranks (gloo) vs the in-process simulation, "
        f"{m['cpus']} CPUs, {m['elapsed_s']:.0f} s"
    )
    for col in (
        "workload",
        "steps",
        "simulated steps/s",
        "distributed steps/s",
        "ratio",
        "same tokens",
    ):
        t.add_column(col, justify="left" if col == "workload" else "right")
    for name, w in report["workloads"].items():
        t.add_row(
            name,
            str(w["steps"]),
            f"{w['simulated_steps_per_s']:.1f}",
            f"{w['distributed_steps_per_s']:.1f}",
            f"{w['ratio']:.2f}x",
            "yes" if w["identical_tokens"] else "[red]NO[/]",
        )
    console.print(t)
    kinds = ("schedule", "compute", *COLLECTIVES)
    b = Table(title="where a distributed step's time goes (ms per step, median run)")
    b.add_column("workload / rank")
    for k in (*kinds, "collectives"):
        b.add_column(k, justify="right")
    for name, w in report["workloads"].items():
        run = w["distributed_median_run"]
        for r, times in enumerate(run["ranks"]):
            cells = [
                f"{times[f'{k}_s'] / run['steps'] * 1e3:.3f}" if f"{k}_s" in times else "-"
                for k in (*kinds, "collectives")
            ]
            b.add_row(f"{name} / rank {r}", *cells)
    console.print(b)
    console.print(
        "[dim]bcast (the step's header and batch) on a follower: mostly waiting for rank 0 to "
        "schedule the step; gather: the per-layer all_gather of attention outputs, including "
        "waiting for the slower rank; table: the block-table updates (isend on rank 0, recv on "
        "the others); ack: the all_gather of table versions and crcs.[/]"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size", type=int, default=2, metavar="N", help="real ranks (default 2)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each engine per workload (default 3)"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)"
    )
    parser.add_argument(
        "--out",
        type=PATH,
        default="reports/bench-distributed.json",
        metavar="PATH",
        help="where to write the JSON report (default: reports/bench-distributed.json)",
    )


def main(args: argparse.Namespace | None = None) -> int:
    if args is None:
        ap = argparse.ArgumentParser(
            prog="python -m kvchaos.harness.bench.distributed", description=__doc__.splitlines()[0]
        )
        add_arguments(ap)
        args = ap.parse_args()
    torch.set_num_threads(1)  # as the follower ranks run
    report = bench(args.world_size, args.repeats, args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"written: {out}")
    return 0 if all(w["identical_tokens"] for w in report["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
