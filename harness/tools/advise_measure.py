"""Paged attention step times measured on this machine at each block size, for the advisor: the
engine's own decode (paged_decode_torch on the CPU, the Triton kernel paged_decode_triton on a
GPU) over contexts drawn from the traffic's histogram, at the model's heads and head_dim.

What is timed: one layer's decode for SAMPLE contexts at the histogram's quantiles (fewer when
their tokens pass TOKEN_BUDGET), sorted and batched BATCH at a time (as a scheduler batches
similar lengths, so a batch pads little), each block table a seeded permutation of its pool. The
block sizes take turns, round after round (a neighbour's load falls on all of them alike), and
each batch's time is the floor of its RUNS rounds after WARMUP: load only ever adds time.
On the CPU the time is the process's CPU time (time.process_time: the wall time of a shared box
is mostly other jobs'), torch on the threads harness/run/device.py gives it (one by default)."""

from __future__ import annotations

import time

from kvchaos.harness.tools.advise_model import Shape, Traffic

SAMPLE = 32
BATCH = 8
TOKEN_BUDGET = 8192  # context tokens a block size's pool holds: KV of a 7B layer, 128 MB at fp16
RUNS, WARMUP = 9, 2
KERNEL_DTYPES = ("float32", "float16", "bfloat16")  # what the engine's kernels take


def contexts(t: Traffic, sample: int = SAMPLE) -> list[int]:
    """Lengths at the histogram's quantiles (i + 0.5) / k, k shrunk until they fit the budget."""
    k = sample
    while True:
        lens = sorted(t.quantile((i + 0.5) / k) for i in range(k))
        if k == 1 or sum(lens) <= TOKEN_BUDGET:
            return lens
        k -= 1


def _timer(device):
    import torch

    if device.type == "cuda":

        def cuda_ms(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3

        return cuda_ms

    def cpu_s(fn) -> float:  # the process's CPU time: a box shared with other jobs steals wall time
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    return cpu_s


def _batch_call(lens: list[int], b: int, shape: Shape, dtype, device, gen, kernel):
    """A call of the kernel over one batch of contexts at block size b."""
    import torch

    rows = [-(-n // b) for n in lens]
    pool = sum(rows)
    k = torch.randn(pool, b, shape.kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(pool, b, shape.kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    ids = torch.randperm(pool, generator=gen).to(torch.int32)
    table = torch.full((len(lens), max(rows)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(rows):
        table[i, :n] = ids[at : at + n]
        at += n
    q = torch.randn(len(lens), shape.heads, shape.head_dim, generator=gen).to(device, dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    table = table.to(device)
    scale, longest = shape.head_dim**-0.5, max(lens)
    return lambda: kernel(q, k, v, table, seq, scale, longest)


def measure(
    t: Traffic,
    shape: Shape,
    sizes,
    device: str = "cpu",
    seed: int = 0,
    runs: int = RUNS,
    triton: bool | None = None,
    sample: int = SAMPLE,
    warmup: int = WARMUP,
) -> tuple[dict[int, float], str]:
    """{block size: seconds of one layer's decode over the sample}, and how it was measured.
    triton: the Triton kernel (None: on a GPU; on the CPU it takes TRITON_INTERPRET=1)."""
    import torch

    from kvchaos.engine.attention import paged_decode_torch

    dev = torch.device(device)
    if triton if triton is not None else dev.type == "cuda":
        from kvchaos.engine.triton_decode import paged_decode_triton as kernel

        name = "the Triton kernel paged_decode_triton"
    else:
        kernel, name = paged_decode_torch, "the torch path paged_decode_torch"
    dtype_name = shape.dtype if shape.dtype in KERNEL_DTYPES else "bfloat16"
    dtype = getattr(torch, dtype_name)
    lens = contexts(t, sample)
    batches = [lens[i : i + BATCH] for i in range(0, len(lens), BATCH)]
    timer = _timer(dev)
    calls = {}
    for b in sizes:
        gen = torch.Generator().manual_seed(seed)
        calls[b] = [_batch_call(x, b, shape, dtype, dev, gen, kernel) for x in batches]
        for call in calls[b] * warmup:
            call()
    floor = {b: [float("inf")] * len(batches) for b in sizes}
    for _ in range(runs):
        for b in sizes:
            for i, call in enumerate(calls[b]):
                floor[b][i] = min(floor[b][i], timer(call))
    out = {b: sum(floor[b]) for b in sizes}
    asked = "" if dtype_name == shape.dtype else f" (the kernels take no {shape.dtype})"
    clock = "CUDA events" if dev.type == "cuda" else "CPU time"
    note = (
        f"measured on {dev} ({clock}): {name}, one layer's decode over {len(lens)} contexts at the "
        f"histogram's quantiles (mean {sum(lens) / len(lens):.1f}) in {len(batches)} batches of "
        f"<= {BATCH}, {shape.heads} query / {shape.kv_heads} KV heads, head_dim "
        f"{shape.head_dim}, {dtype_name}{asked}, the floor of {runs} rounds"
    )
    return out, note
