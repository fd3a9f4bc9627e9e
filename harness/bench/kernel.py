"""The Triton paged-decode kernel on CUDA, against a device-to-device copy of the same bytes and
against torch's scaled_dot_product_attention on contiguous KV, all measured in the same run.

Timing: CUDA events around each call, after warm-up; before every timed call a buffer several
times the L2 is written (so the KV bytes come from HBM, not from the last run's L2) and the GPU is
kept busy for a moment (so the host's launch time is not counted); the median of many runs.
Achieved bandwidth = KV bytes read / kernel time. Copy bandwidth = bytes read + written / copy time,
the rate this GPU's memory actually sustains, so the kernel's share of it is a like-for-like ratio.

Targets (reported, never asserted; stated for the full shape: batch 64, 4096-token contexts, 32
query heads over 8 KV heads (GQA 4), head_dim 128, bf16, block 16):
  - the paged kernel reaches >= 70% of the copy bandwidth
  - paged (random permuted block ids) takes <= 1.15x the same kernel on an identity table

  python -m kvchaos.harness.bench.kernel [--quick] [--json FILE]   # needs CUDA
  python -m kvchaos.harness.bench.kernel --interpret               # CPU smoke: Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvchaos.harness.scenario.options import PATH

EXIT_NO_CUDA = 3
NO_CUDA = (
    "bench_kernel needs CUDA: no CUDA device here. `--interpret` runs a tiny-shape smoke of the "
    "same code path through the Triton interpreter on the CPU (it measures nothing)."
)
SHAPES = {
    "full": dict(
        batch=64,
        ctx=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype="bfloat16",
    ),
    "quick": dict(
        batch=16,
        ctx=1024,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype="bfloat16",
    ),
    "tiny": dict(
        batch=2, ctx=64, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16"
    ),
}
COPY_FRACTION_TARGET = 0.70
PAGED_OVER_IDENTITY_TARGET = 1.15
TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class CudaTimer:
    def __init__(self, device: torch.device) -> None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
        self.flush_bytes = max(4 * l2, 256 * 2**20)
        self.flush = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=device)
        self.device = device

    def __call__(self, fn, runs: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(self.device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(runs)
        ]
        for start, end in events:
            self.flush.zero_()
            if hasattr(torch.cuda, "_sleep"):
                # ~0.5 ms of GPU time (1e6 cycles at ~2 GHz), longer than the host takes to launch
                # fn (tens of us, two kernels and allocations for a split run): fn is queued before
                # its start event
                torch.cuda._sleep(1_000_000)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in events]


class CpuTimer:
    """The interpreter smoke's timer: wall time, no flush. Its numbers measure nothing."""

    flush_bytes = 0

    def __call__(self, fn, runs: int, warmup: int) -> list[float]:
        import time

        for _ in range(warmup):
            fn()
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def _stats(ms: list[float], nbytes: int) -> dict:
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    med = statistics.median(ms)
    return {
        "median_ms": round(med, 5),
        "p10_ms": round(q[0], 5),
        "p90_ms": round(q[-1], 5),
        "runs": len(ms),
        "gbps": round(nbytes / (med * 1e-3) / 1e9, 1),
    }


def make_inputs(shape: dict, device: torch.device, seed: int = 0) -> dict:
    """KV pools of exactly the KV bytes, an identity table and a random permuted one over the same
    pools, and the contiguous [B, Hkv, T, D] KV that the random table addresses."""
    b, t, h, hkv, d, bs = (
        shape[k] for k in ("batch", "ctx", "num_heads", "num_kv_heads", "head_dim", "block_size")
    )
    if t % bs:
        raise ValueError(f"ctx {t} must be a multiple of block_size {bs}")
    dt = getattr(torch, shape["dtype"])
    g = torch.Generator(device=device).manual_seed(seed)
    nb = b * t // bs
    kv = torch.randn(2, nb, bs, hkv, d, generator=g, device=device, dtype=dt)
    identity = torch.arange(nb, device=device, dtype=torch.int32).view(b, t // bs)
    paged = torch.randperm(nb, generator=g, device=device).to(torch.int32).view(b, t // bs)
    contig = [kv[i][paged.long()].view(b, t, hkv, d).transpose(1, 2).contiguous() for i in (0, 1)]
    return {
        "q": torch.randn(b, h, d, generator=g, device=device, dtype=dt),
        "kv": kv,
        "identity": identity,
        "paged": paged,
        "lens": torch.full((b,), t, dtype=torch.int32, device=device),
        "k_contig": contig[0],
        "v_contig": contig[1],
        "scale": d**-0.5,
    }


def _copy_into(dst: torch.Tensor, src: torch.Tensor):
    """The copy baseline: dst lives only as long as the timing closure does."""
    return lambda: dst.copy_(src)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence on contiguous [B, Hkv, T, D] KV: each KV head's G query heads
    are G queries of that head, so K/V are read once (no repeat for GQA)."""
    b, h, d = q.shape
    hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), k, v, scale=scale).reshape(
        b, h, d
    )


def bench(
    mode: str = "full",
    runs: int | None = None,
    warmup: int | None = None,
    sweep: bool = True,
    torch_paged: bool = True,
    seed: int = 0,
) -> dict:
    import triton

    from kvchaos.engine.attention import paged_decode_torch
    from kvchaos.engine.triton_decode import auto_splits, paged_decode_triton

    interp = _interpreting()
    if interp:
        device, timer = torch.device("cpu"), CpuTimer()
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        timer = CudaTimer(device)
    else:
        raise RuntimeError(NO_CUDA)
    shape = SHAPES["tiny" if interp else mode]
    runs = runs or (3 if interp else 100 if mode == "full" else 50)
    warmup = warmup if warmup is not None else (1 if interp else 10)
    x = make_inputs(shape, device, seed)
    q, kv, lens, scale = x["q"], x["kv"], x["lens"], x["scale"]
    kbytes = kv.numel() * kv.element_size()

    def triton_fn(table, splits=None):
        return lambda: paged_decode_triton(q, kv[0], kv[1], table, lens, scale, num_splits=splits)

    fns = {
        "triton_paged": triton_fn(x["paged"]),
        "triton_identity": triton_fn(x["identity"]),
        "sdpa_contiguous": lambda: sdpa_decode(q, x["k_contig"], x["v_contig"], scale),
    }
    results = {name: _stats(timer(fn, runs, warmup), kbytes) for name, fn in fns.items()}
    if torch_paged:  # gathers (copies) every block through the table: reference only, fewer runs

        def fn():
            return paged_decode_torch(
                q, kv[0], kv[1], x["paged"], lens, scale, max_seq_len=shape["ctx"]
            )

        results["torch_paged"] = _stats(timer(fn, max(3, runs // 10), min(warmup, 2)), kbytes)
    copy = _stats(
        timer(_copy_into(torch.empty_like(kv), kv), runs, warmup), 2 * kbytes
    )  # read + write

    chunks = triton.cdiv(shape["ctx"], max(shape["block_size"], 16 if interp else 32))
    auto = auto_splits(q, shape["batch"] * shape["num_kv_heads"], chunks)
    sweep_ms = {}
    if sweep:
        for n in (1, 2) if interp else (1, 2, 4, 8, 16):
            sweep_ms[str(n)] = _stats(timer(triton_fn(x["paged"], n), runs, warmup), kbytes)[
                "median_ms"
            ]

    ref = sdpa_decode(q, x["k_contig"], x["v_contig"], scale).float()
    ref_id = sdpa_decode(
        q,
        *(kv[i].view(shape["batch"], shape["ctx"], *kv.shape[3:]).transpose(1, 2) for i in (0, 1)),
        scale,
    ).float()
    err_paged = (fns["triton_paged"]().float() - ref).abs().max().item()
    err_id = (fns["triton_identity"]().float() - ref_id).abs().max().item()
    tol = TOL[shape["dtype"]]

    frac = results["triton_paged"]["gbps"] / copy["gbps"]
    paged_ratio = results["triton_paged"]["median_ms"] / results["triton_identity"]["median_ms"]
    at_shape = mode == "full" and not interp
    note = (
        "interpreter: not a measurement" if interp else None if at_shape else "not the target shape"
    )
    targets = [
        {
            "name": "triton paged bandwidth / copy bandwidth",
            "measured": round(frac, 3),
            "target": f">= {COPY_FRACTION_TARGET}",
            "met": None if interp else frac >= COPY_FRACTION_TARGET,
            "note": note,
        },
        {
            "name": "triton paged / identity table time",
            "measured": round(paged_ratio, 3),
            "target": f"<= {PAGED_OVER_IDENTITY_TARGET}",
            "met": None if interp else paged_ratio <= PAGED_OVER_IDENTITY_TARGET,
            "note": note,
        },
        {
            "name": "sdpa contiguous / triton paged time",
            "measured": round(
                results["sdpa_contiguous"]["median_ms"] / results["triton_paged"]["median_ms"], 3
            ),
            "target": "comparison",
            "met": None,
            "note": note,
        },
    ]
    return {
        "bench": "triton_paged_decode",
        "mode": "interpreter-smoke" if interp else mode,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": shape,
        "kv_bytes": kbytes,
        "l2_flush_bytes": timer.flush_bytes,
        "runs": runs,
        "warmup": warmup,
        "timings": results,
        "copy": copy,
        "num_splits_auto": auto,
        "splits_sweep_median_ms": sweep_ms,
        "correctness": {
            "paged_vs_sdpa_max_abs_err": err_paged,
            "identity_vs_sdpa_max_abs_err": err_id,
            "tol": tol,
            "ok": err_paged <= tol and err_id <= tol,
        },
        "targets": targets,
    }


def print_report(r: dict) -> None:
    rows = [
        (
            name,
            t["median_ms"],
            f"{t['p10_ms']:.4g}-{t['p90_ms']:.4g}",
            t["gbps"],
            f"{t['gbps'] / r['copy']['gbps']:.0%}",
        )
        for name, t in r["timings"].items()
    ]
    c = r["copy"]
    rows.append(
        (
            "d2d copy (read+write)",
            c["median_ms"],
            f"{c['p10_ms']:.4g}-{c['p90_ms']:.4g}",
            c["gbps"],
            "100%",
        )
    )
    s = r["shape"]
    title = (
        f"{r['device']}: {r['mode']}, batch {s['batch']} x {s['ctx']} tokens, "
        f"{s['num_heads']}/{s['num_kv_heads']} heads, head_dim {s['head_dim']}, "
        f"block {s['block_size']}, "
        f"{s['dtype']}, KV {r['kv_bytes'] / 2**20:.1f} MiB, "
        f"median of {r['runs']}, L2 flush {r['l2_flush_bytes'] / 2**20:.0f} MiB"
    )
    tl = [
        f"{t['name']}: {t['measured']} (target {t['target']}) "
        f"{'' if t['met'] is None else 'MET' if t['met'] else 'NOT MET'}"
        f"{' - ' + t['note'] if t['note'] else ''}"
        for t in r["targets"]
    ]
    cr = r["correctness"]
    tl.append(
        f"correctness vs SDPA: paged {cr['paged_vs_sdpa_max_abs_err']:.3g}, identity "
        f"{cr['identity_vs_sdpa_max_abs_err']:.3g} (tol {cr['tol']}) "
        f"{'ok' if cr['ok'] else 'FAILED'}"
    )
    tl.append(
        f"num_splits auto {r['num_splits_auto']}; sweep (median ms): {r['splits_sweep_median_ms']}"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in rows:
            print("  {:<24} {:>10} ms  p10-p90 {:<20} {:>8} GB/s  {:>5} of copy".format(*row))
        print("\n".join(tl))
        return
    t = Table(title=title)
    for col in ("variant", "median ms", "p10-p90 ms", "GB/s", "of copy bw"):
        t.add_column(col)
    for row in rows:
        t.add_row(*map(str, row))
    con = Console()
    con.print(t)
    for line in tl:
        con.print(line, markup=False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="small shapes (batch 16, 1024-token contexts)"
    )
    p.add_argument(
        "--interpret",
        action="store_true",
        help="CPU smoke: tiny shapes through the Triton interpreter, in a subprocess; "
        "measures nothing",
    )
    p.add_argument("--json", type=PATH, metavar="FILE", help="also write the results here")
    p.add_argument(
        "--runs", type=int, default=None, help="timed runs per variant (default 100, quick 50)"
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the num_splits sweep")
    p.add_argument(
        "--no-torch-paged", action="store_true", help="skip the torch paged reference path"
    )


def main(args) -> int:
    if args.interpret and not _interpreting():
        # TRITON_INTERPRET is read when kernels are decorated: only a fresh process can set it.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "kvchaos.harness.bench.kernel", "--interpret"] + sys_args(args)
        try:
            return subprocess.run(cmd, env=env, timeout=300).returncode
        except subprocess.TimeoutExpired:
            print("bench_kernel --interpret: the interpreter smoke ran past 300 s", file=sys.stderr)
            return 1
    if not _interpreting() and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return EXIT_NO_CUDA
    r = bench(
        "quick" if args.quick else "full",
        runs=args.runs,
        sweep=not args.no_sweep,
        torch_paged=not args.no_torch_paged,
    )
    print_report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    if not r["correctness"]["ok"]:
        print(
            "bench_kernel: the kernel's output does not match SDPA: its timings mean nothing",
            file=sys.stderr,
        )
        return 1
    return 0


def sys_args(args) -> list[str]:
    out = ["--quick"] if args.quick else []
    out += ["--json", str(Path(args.json).resolve())] if args.json else []
    out += ["--runs", str(args.runs)] if args.runs else []
    out += ["--no-sweep"] if args.no_sweep else []
    out += ["--no-torch-paged"] if args.no_torch_paged else []
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        prog="python -m kvchaos.harness.bench.kernel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
