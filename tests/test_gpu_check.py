"""The GPU check, the kernel bench and the staging measurement on a machine without CUDA: they
refuse clearly; the kernel bench's code path runs through the Triton interpreter; the check's stage
orchestration (time limits, failures, budget, summaries) runs as a CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvchaos.harness.bench import gpu_check, gpu_stages
from kvchaos.harness.bench.staging import (
    NOT_APPLICABLE,
    StagingBuffer,
    alternate,
    decode_engine,
    measure,
)

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "KVCHAOS_CPU_THREADS": "1",
}
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: the refusal does not apply"
)


def run(args: list[str], timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@no_cuda
def test_gpu_check_refuses_without_cuda(tmp_path):
    p = run(["-m", "kvchaos.harness.cli", "gpu-check", "--out", str(tmp_path / "gc")])
    assert p.returncode == gpu_check.EXIT_NO_CUDA
    assert p.stderr.strip() == f"kvchaos gpu-check: {gpu_check.NO_CUDA}"
    assert (
        gpu_check.NO_CUDA
        == "no CUDA device: the GPU check needs one; on this machine run `make test`"
    )
    assert not (tmp_path / "gc").exists()


@no_cuda
def test_script_refuses_without_cuda(tmp_path):
    script = ROOT / "scripts" / "gpu-check.sh"
    assert os.access(script, os.X_OK)
    p = subprocess.run(
        [str(script)],
        env={
            **ENV,
            "PYTHON": sys.executable,
            "OUT": str(tmp_path / "o"),
            "WORK": str(tmp_path / "w"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        p.returncode == gpu_check.EXIT_NO_CUDA
        and "no CUDA device: the GPU check needs one" in p.stderr
    )


@no_cuda
def test_bench_kernel_refuses_on_cpu():
    p = run(["-m", "kvchaos.harness.bench.kernel"])
    assert p.returncode == 3 and "needs CUDA" in p.stderr and "--interpret" in p.stderr


def test_bench_kernel_interpreter_smoke(tmp_path):
    out = tmp_path / "bk.json"
    p = run(
        ["-m", "kvchaos.harness.bench.kernel", "--interpret", "--runs", "2", "--json", str(out)],
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["mode"] == "interpreter-smoke" and r["device"].startswith("cpu")
    assert set(r["timings"]) == {
        "triton_paged",
        "triton_identity",
        "sdpa_contiguous",
        "torch_paged",
    }
    assert (
        r["correctness"]["ok"]
        and r["correctness"]["paged_vs_sdpa_max_abs_err"] <= r["correctness"]["tol"]
    )
    assert set(r["splits_sweep_median_ms"]) == {"1", "2"}
    assert (
        r["kv_bytes"] == 2 * 2 * 64 * 2 * 16 * 2
    )  # K+V x batch x ctx x kv heads x head_dim x bf16
    assert all(t["met"] is None for t in r["targets"])  # the interpreter measures nothing
    assert "interpreter: not a measurement" in " ".join(p.stdout.split())  # rich wraps lines


def test_staging_not_applicable_on_cpu():
    r = measure("cpu")
    assert r == {"applicable": False, "reason": NOT_APPLICABLE}


def test_staging_alternation_runs_both_strategies():
    torch.set_num_threads(1)
    eng = decode_engine("cpu", 16, 32, batch=3, max_new=40)
    assert all(s.uncomputed == 1 for s in eng.scheduler.running) and len(eng.scheduler.running) == 3
    made = []

    def make(tag):
        def f(n):
            made.append(tag)
            return StagingBuffer(n, pinned=False)

        return f

    r = alternate(eng, {"a": make("a"), "b": make("b")}, rounds=3, steps_per_round=4, warm=1)
    assert made == ["a", "b", "b", "a", "a", "b"]  # order swapped each round
    assert r["a"]["steps"] == r["b"]["steps"] == 9 and r["a"]["median_us"] > 0


def test_junit_summary(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">
      <testcase classname="tests.test_gpu" name="test_a"/>
      <testcase classname="tests.test_gpu" name="test_b">
        <failure message="assert 1 == 2">trace</failure></testcase>
      <testcase classname="tests.test_gpu" name="test_c">
        <skipped message="needs a CUDA GPU"/></testcase>
      <testcase classname="" name="tests.test_x">
        <error message="collection failure">No module named 'pydantic'</error>
      </testcase></testsuite></testsuites>""")
    r = gpu_stages.junit_summary(xml)
    assert (r["tests"], r["failures"], r["errors"], r["skipped"]) == (4, 1, 1, 1)
    assert [f["test"] for f in r["failed"]] == ["tests.test_gpu::test_b"]
    assert r["collection_errors"][0]["text"] == "No module named 'pydantic'"
    assert r["skips"][0]["reason"] == "needs a CUDA GPU"


def test_dry_run_stage_failure_and_timeout_lose_nothing_else(tmp_path):
    """env is killed at a 1 s limit (torch alone takes longer to import); the scenario stage still
    runs both dtypes, staging still reports itself not applicable, and the summaries say it all."""
    out = tmp_path / "gc"
    p = run(
        [
            "-m",
            "kvchaos.harness.bench.gpu_check",
            "--cpu-dry-run",
            "--out",
            str(out),
            "--stages",
            "env,scenarios,staging",
            "--stage-limit",
            "env=1",
            "--scenario",
            "table-overflow-clean",
            "--dtypes",
            "float32,bfloat16",
        ]
    )
    assert p.returncode == gpu_check.EXIT_FAILED, p.stdout + p.stderr
    r = json.loads((out / "gpu-check.json").read_text())
    st = r["stages"]
    assert st["env"]["status"] == "timeout"
    assert st["scenarios"]["status"] == "ok", st["scenarios"]
    runs = st["scenarios"]["details"]["runs"]
    assert [(x["dtype"], x["verdict"]) for x in runs] == [("float32", "PASS"), ("bfloat16", "PASS")]
    assert all(x["oracle_checked"] > 0 and x["backend"] == "torch" for x in runs)
    assert (
        st["staging"]["status"] == "not available" and "not applicable" in st["staging"]["summary"]
    )
    assert r["result"] == "FAILED"
    md = (out / "gpu-check.md").read_text()
    assert md.startswith("# kvchaos gpu-check: FAILED")
    assert "| table-overflow-clean | PASS" in md and "| env | timeout |" in md
    assert "===== scenarios" in (out / "gpu-check.log").read_text()


def test_dry_run_budget_spent_skips_and_is_incomplete(tmp_path):
    out = tmp_path / "gc"
    p = run(
        [
            "-m",
            "kvchaos.harness.bench.gpu_check",
            "--cpu-dry-run",
            "--out",
            str(out),
            "--stages",
            "staging,soak",
            "--budget-s",
            "20",
        ]
    )
    assert p.returncode == gpu_check.EXIT_INCOMPLETE, p.stdout + p.stderr
    r = json.loads((out / "gpu-check.json").read_text())
    assert [s["status"] for s in r["stages"].values()] == ["skipped", "skipped"] and r[
        "result"
    ] == "INCOMPLETE"


def test_bad_stage_name_is_refused():
    p = run(
        [
            "-m",
            "kvchaos.harness.bench.gpu_check",
            "--cpu-dry-run",
            "--stages",
            "env,nope",
            "--out",
            "/tmp/kvchaos-unused",
        ]
    )
    assert p.returncode != 0 and "unknown ['nope']" in p.stderr


def test_soak_stage_without_rich_or_psutil_is_not_available(monkeypatch):
    """The soak imports rich and psutil with no fallback: without them the stage must say so,
    not fail."""
    real = gpu_stages.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_stages.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("rich", "psutil") else real(name, *a),
    )
    r = gpu_stages.stage_soak(
        {"limit_s": 100, "env": ENV, "device": "cpu", "work": "/tmp/kvchaos-unused", "started": 0.0}
    )
    assert r == {
        "status": "not available",
        "summary": "soak: not available (it needs rich, psutil)",
    }
