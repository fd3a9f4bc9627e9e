"""The CUDA path: engine vs oracle in every dtype with the Triton backend, real pinned staging, the
staging stall on CUDA, NVML telemetry, and the kernel and staging benchmarks. Each `gpu` test skips
on a machine without CUDA and says so. Where the GPU code can run on the CPU it does here too: the
engine's Triton backend against the oracle through the Triton interpreter (in a subprocess, since
TRITON_INTERPRET is read when the kernels are defined).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig  # noqa: E402
from kvchaos.harness.run.oracle import Oracle  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")
MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=97,
    max_position=512,
)
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
    ),
    pytest.mark.skipif(
        INTERPRETING, reason="TRITON_INTERPRET is set: these tests are for the compiled path"
    ),
]


def gpu(fn):
    for m in needs_cuda:
        fn = m(fn)
    return fn


def engine_vs_oracle(
    device: str,
    dtype: str,
    backend: str = "auto",
    num_requests: int = 6,
    max_new=(4, 12),
    seed: int = 0,
) -> dict:
    """Staggered requests (prompts across block boundaries, chunked prefill) through the engine;
    every request's logits checked against the contiguous-cache oracle."""
    cfg = EngineConfig(
        model=dataclasses.replace(MODEL, dtype=dtype),
        device=device,
        attention_backend=backend,
        cache=CacheConfig(block_size=16, num_blocks=64, max_blocks_per_seq=8, max_num_seqs=8),
        max_prefill_tokens=48,
        seed=seed,
    )
    eng = Engine(cfg)
    rng = random.Random(seed)
    reqs = sorted(
        (
            rng.randrange(6),
            f"r{i}",
            [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 40))],
            rng.randint(*max_new),
        )
        for i in range(num_requests)
    )
    logits: dict[str, list[torch.Tensor]] = {}
    step = 0
    while reqs or eng.has_unfinished():
        while reqs and reqs[0][0] <= step:
            _, rid, prompt, n = reqs.pop(0)
            eng.add_request(rid, prompt, n)
        for rid, row in eng.step().logits.items():
            logits.setdefault(rid, []).append(row)
        step += 1
    oracle = Oracle(eng.model)
    results = [
        oracle.check(rid, eng.seqs[rid].tokens, eng.seqs[rid].prompt_len, torch.stack(rows))
        for rid, rows in logits.items()
    ]
    return {
        "backend": eng.decode_attention.__name__,
        "requests": len(results),
        "tokens": sum(r.checked for r in results),
        "max_abs_err": max(r.max_abs_err for r in results),
        "diverged": [r.request for r in results if r.diverged],
    }


def _check(r: dict, num_requests: int = 6) -> None:
    assert r["backend"] == "paged_decode_triton"
    assert r["requests"] == num_requests and r["tokens"] >= 2 * num_requests
    assert r["diverged"] == [], (
        f"diverged from the oracle: {r['diverged']} (max abs err {r['max_abs_err']:.3g})"
    )


@pytest.fixture(scope="module")
def interpreted():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "KVCHAOS_CPU_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_triton_backend_matches_oracle_interpreter(interpreted, dtype):
    _check(interpreted[dtype], num_requests=3)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_matches_oracle_cuda(dtype):
    _check(engine_vs_oracle("cuda", dtype))


@gpu
def test_duplicate_slot_writes_are_deterministic_cuda():
    """A spilled row writes over a neighbour's slot in the same step: the same inputs must leave the
    same pool every time (else a CUDA soak's replay reports false nondeterminism)."""
    from kvchaos.engine.attention import write_kv

    g = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 64, (4096,), generator=g).cuda()  # many collisions
    k = torch.randn(4096, 2, 16, generator=g).cuda()
    pools = []
    for _ in range(5):
        kc, vc = torch.zeros(16, 4, 2, 16, device="cuda"), torch.zeros(16, 4, 2, 16, device="cuda")
        write_kv(kc, vc, slots, k, k)
        pools.append(kc.cpu())
    assert all(torch.equal(pools[0], p) for p in pools[1:])
    assert not torch.are_deterministic_algorithms_enabled()


@gpu
def test_staging_is_pinned_and_reallocated_pinned_cuda():
    eng = Engine(EngineConfig(model=MODEL, device="cuda"))
    assert eng.staging.pinned and eng.staging.tensor.is_pinned()
    eng.add_request("a", list(range(20)), 4)
    eng.step()
    eng.staging.pid = -1  # as after a fork: not this process's buffer any more
    eng.step()
    assert eng.counters["staging_reallocs"] == 1
    assert eng.staging.valid() and eng.staging.tensor.is_pinned()


@gpu
def test_invalidated_staging_is_pageable_cuda():
    pytest.importorskip("pydantic", reason="faults import the workload model, which needs pydantic")
    from kvchaos.faults import make_fault
    from kvchaos.faults.staging_stall import InvalidatedStaging

    eng = Engine(EngineConfig(model=MODEL, device="cuda"))
    buf = InvalidatedStaging(eng.staging.tensor.numel(), make_fault("staging_stall", True, {}, 0))
    assert not buf.tensor.is_pinned() and not buf.valid()


@gpu
def test_the_planted_buffer_drops_its_pages_and_its_device_copy_still_lands_cuda():
    """The real cost on CUDA: the planted buffer's host pages dropped and faulted back in by the
    staging copy (the kernel's count), then its non_blocking device copy from pageable memory,
    which holds the host until done and lands the table whole."""
    pytest.importorskip("pydantic", reason="faults import the workload model, which needs pydantic")
    import resource

    from kvchaos.faults import make_fault
    from kvchaos.faults.staging_stall import InvalidatedStaging

    host = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB, 256 pages
    buf = InvalidatedStaging(host.numel(), make_fault("staging_stall", True, {}, 0))
    assert buf.drop_pages(0, buf.page_count()) == buf.page_count() == 256
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    staged = buf.stage(host)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before >= 256
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(staged, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)


@gpu
def test_a_copy_from_pageable_staging_waits_for_the_stream_cuda():
    """From pinned memory the host-to-device copy is queued and the call returns at once; from
    pageable memory the driver first waits for the stream: the host is held until the work queued
    before the copy is done (why a staging buffer that is not pinned stalls the step). A
    property of the calls, not a timing: is the work queued ahead done when the copy returns?"""
    from kvchaos.engine.staging import StagingBuffer

    n = 1 << 16
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    done_at_return = {}
    for pinned in (True, False):
        buf = StagingBuffer(n, pinned=pinned)
        assert buf.tensor.is_pinned() == pinned
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device work queued ahead of the copy
        ahead = torch.cuda.Event()
        ahead.record()
        dst.copy_(buf.tensor, non_blocking=True)
        done_at_return[pinned] = ahead.query()
        torch.cuda.synchronize()
    assert done_at_return == {True: False, False: True}


@gpu
def test_write_combined_staging_is_pinned_and_uploads_cuda():
    """The article's remediation: pinned, write-combined (cudaHostAlloc through ctypes)."""
    from kvchaos.engine.staging import StagingBuffer

    buf = StagingBuffer(1000, pinned=True, write_combined=True)
    assert buf.pinned and buf.write_combined and buf.tensor.is_pinned(), buf.why
    host = torch.arange(1000, dtype=torch.int32)
    dev = buf.stage(host).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), host)


@gpu
@pytest.mark.timing  # judged by latency: measured time
@pytest.mark.parametrize(
    "name,expect_realloc",
    [
        ("staging-stall-detect", False),
        ("staging-stall-clean", True),
        ("staging-stall-from-start-detect", False),
        ("staging-stall-from-start-clean", True),
    ],
)
def test_staging_stall_scenario_cuda(tmp_path, name, expect_realloc):
    pytest.importorskip("pydantic", reason="scenario files need pydantic")
    from kvchaos.harness.history.log import read_history
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    sc = load_scenario(name)
    r = run_scenario(sc, sc.scenario.seeds[0], device="cuda", report_dir=tmp_path)
    assert r.verdict == "PASS", r.summary
    ev = read_history(r.run_dir / "history.jsonl")
    if not expect_realloc:
        assert any(c["checker"] == "latency" and c["valid"] is False for c in r.results["checkers"])
    assert any(e["e"] == "engine" and e["kind"] == "staging_realloc" for e in ev) == expect_realloc
    start = next(e for e in ev if e["e"] == "run_start")
    assert start["telemetry"]["available"], start["telemetry"]["reason"]
    samples = [e["telemetry"] for e in ev if e["e"] == "step" and "telemetry" in e]
    assert samples and all(s["gpu_mem_used_mb"] > 0 for s in samples)


@gpu
def test_nvml_telemetry_has_gpu_fields():
    from kvchaos.harness.run.telemetry import Telemetry

    tel = Telemetry("cuda")
    assert tel.available, tel.reason
    torch.ones(1, device="cuda")
    s = tel.sample()
    assert s["gpu_mem_used_mb"] > 0 and s["rss_mb"] > 0
    ranges = {
        "gpu_util_pct": (0, 100),
        "sm_clock_mhz": (1, 10_000),
        "temp_c": (1, 119),
        "power_w": (0, 2000),
    }
    for name, (
        lo,
        hi,
    ) in ranges.items():  # a board (or a sandbox) may not report some: named, not faked
        assert name in tel.unsupported or lo <= s[name] <= hi, (name, s.get(name))
    assert "torch_alloc_mb" in s and tel.status()["gpu"]


@gpu
def test_bench_kernel_quick_cuda():
    from kvchaos.harness.bench.kernel import bench

    r = bench("quick", runs=10, warmup=2, sweep=False, torch_paged=False)
    assert r["correctness"]["ok"], r["correctness"]
    assert r["copy"]["gbps"] > 10 and all(t["gbps"] > 0 for t in r["timings"].values())
    assert r["l2_flush_bytes"] >= 256 * 2**20


@gpu
def test_staging_measure_cuda():
    from kvchaos.harness.bench.staging import measure

    r = measure("cuda", rounds=2, steps_per_round=6)
    assert r["applicable"]
    for t in r["tables"].values():
        assert t["pinned"]["steps"] == t["pageable"]["steps"] == 8
        assert t["upload"]["pinned"]["pinned"] and not t["upload"]["pageable"]["pinned"]


if __name__ == "__main__":  # the interpreter run behind `interpreted`
    torch.set_num_threads(1)
    print(
        json.dumps(
            {
                dt: engine_vs_oracle("cpu", dt, backend="triton", num_requests=3, max_new=(2, 5))
                for dt in DTYPES
            }
        )
    )
