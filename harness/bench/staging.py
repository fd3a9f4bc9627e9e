"""Staging of the per-step block-table upload on CUDA: per-step engine latency with the table staged
in pinned host memory and copied with non_blocking=True (the reference engine), in pinned and
write-combined memory (cudaHostAlloc's flag), and in pageable host memory (the staging-stall
fault's CUDA form: the driver bounces the copy through its own buffer and the host waits for it).
Strategies alternate every few steps on one engine, so all see the same batch, contexts and
machine noise. Also the bare upload: how long the host is blocked
by the copy call, and when the copy is complete.

On the CPU there is no host-to-device copy at all, so that comparison does not apply (`measure`
says so instead of reporting a number). What does apply there is the staging-stall fault's real
cost, which `page_faults` measures: the staging copy into a pinned (mlock'ed) buffer, a pageable
one whose pages stay, and a pageable one whose pages were dropped before the copy (MADV_DONTNEED,
as the fault does), with the kernel's minor-fault count across each copy.

  python -m kvchaos.harness.bench.staging [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from kvchaos.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvchaos.engine.engine import Engine
from kvchaos.engine.staging import StagingBuffer
from kvchaos.harness.run.device import resolve_device
from kvchaos.harness.scenario.options import PATH

NOT_APPLICABLE = (
    "not applicable: no CUDA device. On the CPU the block table never crosses to a device, "
    "so pinned and pageable staging are the same host copy"
)
# "default": the scenarios' table size; "large": serving size (256 sequences x 2048 blocks, 2 MiB)
TABLES = {"default": (16, 32), "large": (256, 2048)}
# the page-fault cost's tables: the soak's and the small stalls' (200 x 512, 400 KiB), the ramp's
# (256 x 4096, 4 MiB)
FAULT_TABLES = {"default": (16, 32), "staged": (200, 512), "large": (256, 4096)}
STRATEGIES = {
    "pinned": lambda n: StagingBuffer(n, pinned=True),
    "pageable": lambda n: StagingBuffer(n, pinned=False),
    # the article's remediation: pinned and write-combined (cudaHostAlloc's flag, through ctypes:
    # torch has none); the host only writes it, and reads of it bypass the cache (slow)
    "write_combined": lambda n: StagingBuffer(n, pinned=True, write_combined=True),
}


def decode_engine(
    device: str,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    batch: int = 8,
    prompt_len: int = 32,
    max_new: int = 400,
) -> Engine:
    """An engine with `batch` sequences all decoding (prefill done)."""
    bs = 16
    cache = CacheConfig(
        block_size=bs,
        num_blocks=batch * -(-(prompt_len + max_new) // bs) + 8,
        max_blocks_per_seq=max_blocks_per_seq,
        max_num_seqs=max_num_seqs,
    )
    eng = Engine(
        EngineConfig(
            model=ModelConfig(), cache=cache, device=device, max_prefill_tokens=batch * prompt_len
        )
    )
    vocab = eng.config.model.vocab_size
    for i in range(batch):
        eng.add_request(f"r{i}", [(7 * i + j) % vocab for j in range(prompt_len)], max_new)
    while eng.scheduler.waiting or any(s.uncomputed > 1 for s in eng.scheduler.running):
        eng.step()
    return eng


def alternate(
    engine: Engine, strategies: dict, rounds: int = 10, steps_per_round: int = 12, warm: int = 2
) -> dict:
    """Per strategy: the engine's per-step latency (StepStats.latency_s, which ends in a device
    sync) and host time, over `rounds` blocks of steps, the strategies' order swapped each round."""
    numel = engine.staging.tensor.numel()
    lat = {k: [] for k in strategies}
    host = {k: [] for k in strategies}
    names = list(strategies)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            engine.staging = strategies[name](numel)
            for i in range(steps_per_round):
                st = engine.step().stats
                if i >= warm:  # the first steps after a swap pay for the new buffer
                    lat[name].append(st.latency_s)
                    host[name].append(st.host_s)
    return {
        k: {
            "steps": len(lat[k]),
            "median_us": round(statistics.median(lat[k]) * 1e6, 1),
            "p90_us": round(statistics.quantiles(lat[k], n=10)[-1] * 1e6, 1),
            "host_median_us": round(statistics.median(host[k]) * 1e6, 1),
        }
        for k in strategies
    }


def upload_times(numel: int, device: str, runs: int = 50) -> dict:
    """The bare copy staging -> device: host-blocked time of the copy call, and time to finish."""
    dst = torch.empty(numel, dtype=torch.int32, device=device)
    out = {}
    for name, make in STRATEGIES.items():
        buf = make(numel)
        blocked, done = [], []
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(buf.tensor, non_blocking=True)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            blocked.append(t1 - t0)
            done.append(time.perf_counter() - t0)
        out[name] = {
            "pinned": buf.tensor.is_pinned(),
            "write_combined": buf.write_combined,
            "host_blocked_us": round(statistics.median(blocked) * 1e6, 1),
            "complete_us": round(statistics.median(done) * 1e6, 1),
        }
    return out


def page_faults(runs: int = 40) -> dict:
    """Per table size: the staging copy's median time (us) and minor faults, pinned vs pageable
    vs pageable with its pages dropped before each copy. On CPU or CUDA alike: host memory."""
    out = {}
    for label, (seqs, width) in FAULT_TABLES.items():
        host = torch.arange(seqs * width, dtype=torch.int32)
        row = {"table_bytes": host.numel() * 4}
        for name, pinned, drop in (
            ("pinned", True, False),
            ("pageable", False, False),
            ("pageable_dropped", False, True),
        ):
            buf = StagingBuffer(host.numel(), pinned=pinned)
            buf.stage(host)  # resident, as a buffer in use is
            times, faults, dropped = [], [], 0
            for _ in range(runs):
                if drop:
                    dropped = buf.drop_pages(0, buf.page_count())
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                buf.stage(host)
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            row[name] = {
                "pinned": buf.pinned,
                "pages_dropped": dropped,
                "median_us": round(statistics.median(times) * 1e6, 1),
                "min_us": round(min(times) * 1e6, 1),
                "minflt_median": statistics.median(faults),
            }
        row["dropped_minus_pinned_us"] = round(
            row["pageable_dropped"]["median_us"] - row["pinned"]["median_us"], 1
        )
        out[label] = row
    return out


def measure(device: str | None = None, rounds: int = 10, steps_per_round: int = 12) -> dict:
    device = resolve_device(device)
    if not device.startswith("cuda"):
        return {"applicable": False, "reason": NOT_APPLICABLE}
    res = {"applicable": True, "device": torch.cuda.get_device_name(), "tables": {}}
    for label, (seqs, width) in TABLES.items():
        eng = decode_engine(device, seqs, width, max_new=rounds * 2 * steps_per_round + 16)
        per = alternate(eng, STRATEGIES, rounds, steps_per_round)
        p, q = per["pinned"], per["pageable"]
        res["tables"][label] = {
            "table_bytes": eng.staging.tensor.numel() * 4,
            "batch": len(eng.scheduler.running),
            **per,
            "pageable_minus_pinned_us": round(q["median_us"] - p["median_us"], 1),
            "pageable_over_pinned": round(q["median_us"] / p["median_us"], 3),
            "upload": upload_times(eng.staging.tensor.numel(), device),
        }
    return res


def print_page_faults(r: dict) -> None:
    print("staging copy, host memory: median us (minor faults), pinned / pageable / dropped")
    for label, t in r.items():
        p, q, d = t["pinned"], t["pageable"], t["pageable_dropped"]
        print(
            f"  {label} table ({t['table_bytes'] / 1024:.0f} KiB): {p['median_us']} "
            f"({p['minflt_median']:g}) / {q['median_us']} ({q['minflt_median']:g}) / "
            f"{d['median_us']} ({d['minflt_median']:g}, {d['pages_dropped']} pages dropped): "
            f"{t['dropped_minus_pinned_us']:+} us"
        )


def print_report(r: dict) -> None:
    if not r["applicable"]:
        print(f"staging: {r['reason']}")
        return
    print(
        f"staging on {r['device']}: per-step engine latency, median (host part), pinned vs pageable"
    )
    for label, t in r["tables"].items():
        up = t["upload"]
        p, q = t["pinned"], t["pageable"]
        print(
            f"  {label} table ({t['table_bytes'] / 1024:.0f} KiB, batch {t['batch']}): pinned "
            f"{p['median_us']} us ({p['host_median_us']}), "
            f"pageable {q['median_us']} us ({q['host_median_us']}), "
            f"write-combined {t['write_combined']['median_us']} us: "
            f"{t['pageable_minus_pinned_us']:+} us, x{t['pageable_over_pinned']}; "
            f"bare upload host-blocked {up['pinned']['host_blocked_us']} "
            f"vs {up['pageable']['host_blocked_us']} us"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        prog="python -m kvchaos.harness.bench.staging",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--json", type=PATH, metavar="FILE")
    a = ap.parse_args()
    result = measure()
    print_report(result)
    result["page_faults"] = page_faults()
    print_page_faults(result["page_faults"])
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    sys.exit(0)
