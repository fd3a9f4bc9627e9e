"""The GPU check's stages. Each runs in a child process
(`python -m kvchaos.harness.bench.gpu_check --stage NAME ...`), takes the context dict the child
builds and returns {"status", "summary", "details"}."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from kvchaos.harness.bench.child import run_limited, tail

SOAK_BUDGET_S = 120
SOAK_NEEDS = ("rich", "psutil")  # imported by the soak itself, with no fallback
PACKAGES = {  # distribution -> what needs it
    "pydantic": "scenarios (the scenarios stage, the staging-stall gpu test, soak)",
    "psutil": "soak; telemetry RSS/CPU (falls back to /proc)",
    "nvidia-ml-py": "GPU telemetry (NVML)",
    "rich": "soak; tables (plain text without it)",
    "jinja2": "HTML reports (soak, analyze)",
    "matplotlib": "report plots (soak, analyze)",
    "hypothesis": "stateful block-manager tests (CPU)",
    "pytest": "the gpu_tests stage",
}
OK, FAILED, ERROR, TIMEOUT, SKIPPED, UNAVAILABLE = (
    "ok",
    "failed",
    "error",
    "timeout",
    "skipped",
    "not available",
)


def stage_env(ctx: dict) -> dict:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "packages": {p: _version(p) for p in PACKAGES},
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"missing ({e})"
    if ctx["device"].startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            l2_mib=getattr(p, "L2_cache_size", 0) / 2**20,
        )
    from kvchaos.harness.run.telemetry import Telemetry, load_nvml

    tel = Telemetry(ctx["device"])
    info["telemetry"] = {**tel.status(), "sample": tel.sample()}
    if "nv" in load_nvml():
        info["driver"] = _text(load_nvml()["nv"].nvmlSystemGetDriverVersion())
    missing = [p for p, v in info["packages"].items() if v is None]
    summary = f"{info.get('gpu', 'cpu')}, torch {info['torch']}, triton {info['triton']}" + (
        f"; missing: {', '.join(missing)}" if missing else ""
    )
    return {"status": OK, "summary": summary, "details": info}


def stage_gpu_tests(ctx: dict) -> dict:
    xml = Path(ctx["out"]) / "gpu-tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        f"--junitxml={xml}",
    ]
    proc = run_limited(cmd, ctx["limit_s"] - 10, env=ctx["env"])
    if proc is None:
        return {
            "status": TIMEOUT,
            "summary": "pytest ran past its time limit",
            "details": junit_summary(xml),
        }
    res = junit_summary(xml)
    res["exit_code"], res["output_tail"] = proc.returncode, tail(proc.stdout + proc.stderr, 3000)
    ran = res["tests"] - res["skipped"] - len(res["collection_errors"])
    bad = res["failures"] + res["errors"] - len(res["collection_errors"])
    summary = f"{ran} gpu tests ran: {ran - bad} passed, {bad} failed; {res['skipped']} skipped"
    if res["collection_errors"]:
        summary += (
            f"; {len(res['collection_errors'])} test files could not be collected (see details)"
        )
    return {"status": FAILED if bad or ran == 0 else OK, "summary": summary, "details": res}


def stage_scenarios(ctx: dict) -> dict:
    try:
        from kvchaos.harness.history.log import read_history
        from kvchaos.harness.report.render import publish
        from kvchaos.harness.run.device import resolve_device
        from kvchaos.harness.run.runner import run_scenario
        from kvchaos.harness.scenario.spec import builtin_scenarios, load_scenario
    except ImportError as e:
        return {
            "status": UNAVAILABLE,
            "summary": f"scenarios cannot load: {e} (install pydantic; the kernel bench "
            "and gpu tests do not need it)",
        }
    device = resolve_device(ctx["device"])
    scs = [load_scenario(n) for n in ctx["scenarios"]] if ctx["scenarios"] else builtin_scenarios()
    deadline = ctx["started"] + ctx["limit_s"] - 5
    runs, per_run = [], []
    for sc in scs:
        for dtype in ctx["dtypes"]:
            row = {"scenario": sc.name, "dtype": dtype, "seed": sc.scenario.seeds[0]}
            left = deadline - time.monotonic()
            if left < 2 * max(per_run, default=3.0):
                runs.append({**row, "verdict": "NOT RUN", "summary": "stage time limit"})
                continue
            s = sc.model_copy(deep=True)
            s.engine = {**s.engine, "model": {**s.engine.get("model", {}), "dtype": dtype}}
            t0 = time.monotonic()
            r = publish(
                run_scenario(
                    s,
                    row["seed"],
                    device=device,
                    report_dir=Path(ctx["work"]) / "runs",
                    timeout_s=left - 1,
                )
            )
            per_run.append(time.monotonic() - t0)
            ev = read_history(r.run_dir / "history.jsonl")
            oracle = [e for e in ev if e["e"] == "oracle"]
            tel = [e["telemetry"] for e in ev if e["e"] == "step" and "telemetry" in e]
            runs.append(
                {
                    **row,
                    "verdict": r.verdict,
                    "summary": r.summary,
                    "steps": r.results["steps"],
                    "wall_s": r.results["wall_s"],
                    "backend": s.engine_config(device=device).resolved_backend(),
                    "oracle_checked": sum(o["checked"] for o in oracle),
                    "oracle_max_abs_err": max((o["max_abs_err"] for o in oracle), default=None),
                    "oracle_diverged": sum(o["first_divergence"] is not None for o in oracle),
                    "telemetry_samples": len(tel),
                    "telemetry_gpu": bool(tel) and "gpu_mem_used_mb" in tel[0],
                    "peak_gpu_mem_mb": max(
                        (t.get("gpu_mem_used_mb", 0) for t in tel), default=None
                    ),
                    "run_dir": str(r.run_dir),
                    "replay": r.results["replay"],
                }
            )
            ctx["save"]({"status": "running", "details": {"runs": runs}})
    done = [r for r in runs if r["verdict"] != "NOT RUN"]
    passed = sum(r["verdict"] == "PASS" for r in done)
    summary = f"{passed}/{len(done)} runs PASS ({len(scs)} scenarios x {', '.join(ctx['dtypes'])})"
    if len(done) < len(runs):
        summary += f"; {len(runs) - len(done)} not run (time limit)"
    status = FAILED if passed < len(done) else OK if len(done) == len(runs) else TIMEOUT
    return {"status": status, "summary": summary, "details": {"runs": runs}}


def stage_bench_kernel(ctx: dict) -> dict:
    from kvchaos.harness.bench.kernel import bench

    r = bench("quick" if ctx["quick"] else "full")
    (Path(ctx["out"]) / "bench-kernel.json").write_text(json.dumps(r, indent=1))
    t = r["timings"]
    met = [x for x in r["targets"] if x["met"] is not None]
    summary = (
        f"paged {t['triton_paged']['median_ms']:.4g} ms = {t['triton_paged']['gbps']} GB/s, "
        f"copy {r['copy']['gbps']} GB/s; targets met {sum(bool(x['met']) for x in met)}/{len(met)}"
        if met
        else f"paged {t['triton_paged']['median_ms']:.4g} ms (interpreter: no targets judged)"
    )
    if not r["correctness"]["ok"]:
        return {
            "status": FAILED,
            "summary": "kernel output differs from SDPA: " + summary,
            "details": r,
        }
    return {"status": OK, "summary": summary, "details": r}


def stage_staging(ctx: dict) -> dict:
    from kvchaos.harness.bench.staging import measure

    r = measure(ctx["device"])
    if not r["applicable"]:
        return {"status": UNAVAILABLE, "summary": r["reason"], "details": r}
    parts = [
        f"{k}: pageable {t['pageable_minus_pinned_us']:+} us/step (x{t['pageable_over_pinned']})"
        for k, t in r["tables"].items()
    ]
    return {"status": OK, "summary": "; ".join(parts), "details": r}


def stage_soak(ctx: dict) -> dict:
    if importlib.util.find_spec("kvchaos.harness.tools.soak") is None:
        return {
            "status": UNAVAILABLE,
            "summary": "soak: not available (kvchaos.harness.tools.soak is not in this checkout)",
        }
    missing = [
        m for m in SOAK_NEEDS if importlib.util.find_spec(m) is None
    ]  # pydantic: the --help below
    if missing:
        return {
            "status": UNAVAILABLE,
            "summary": f"soak: not available (it needs {', '.join(missing)})",
        }
    budget = max(20, min(SOAK_BUDGET_S, int(ctx["limit_s"]) - 30))
    base = [sys.executable, "-m", "kvchaos.harness.cli", "soak"]
    help_ = run_limited(base + ["--help"], 30, env=ctx["env"])
    if help_ is None or help_.returncode != 0:
        return {
            "status": UNAVAILABLE,
            "summary": "soak: `kvchaos soak --help` failed",
            "details": {
                "output_tail": tail((help_.stdout + help_.stderr) if help_ else "timed out", 2000)
            },
        }
    report_dir = Path(ctx["work"]) / "soak"
    cmd = base + ["--budget", "2m" if budget == 120 else f"{budget}s", "--device", ctx["device"]]
    if "--report-dir" in help_.stdout:
        cmd += ["--report-dir", str(report_dir)]
    t_wall = time.time()
    proc = run_limited(
        cmd,
        ctx["limit_s"] - (time.monotonic() - ctx["started"]) - 5,
        env=ctx["env"],
        cwd=ctx["work"],
    )
    details = {"command": " ".join(cmd[1:]), "budget_s": budget}
    summaries = sorted(
        (f for f in Path(ctx["work"]).rglob("soak-summary.md") if f.stat().st_mtime >= t_wall),
        key=lambda f: f.stat().st_mtime,
    )
    if summaries:
        details["summary_md"] = tail(summaries[-1].read_text(errors="replace"), 6000)
    if proc is None:
        return {
            "status": TIMEOUT,
            "summary": f"soak ran past its {budget} s budget and its grace",
            "details": details,
        }
    details.update(exit_code=proc.returncode, output_tail=tail(proc.stdout + proc.stderr, 4000))
    return {
        "status": OK if proc.returncode == 0 else FAILED,
        "summary": f"soak {budget} s on {ctx['device']}: exit {proc.returncode}",
        "details": details,
    }


STAGE_FUNCS = {
    "env": stage_env,
    "gpu_tests": stage_gpu_tests,
    "scenarios": stage_scenarios,
    "bench_kernel": stage_bench_kernel,
    "staging": stage_staging,
    "soak": stage_soak,
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def junit_summary(path: Path) -> dict:
    res = {
        "tests": 0,
        "failures": 0,
        "errors": 0,
        "skipped": 0,
        "failed": [],
        "skips": [],
        "collection_errors": [],
    }
    if not path.exists():
        return res
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] += int(suite.get(k, 0))
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or "")[:300]
                (
                    res["collection_errors"]
                    if not case.get("classname") or "collection" in msg
                    else res["failed"]
                ).append({"test": name, "message": msg, "text": tail(el.text or "", 1500)})
        el = case.find("skipped")
        if el is not None:
            res["skips"].append({"test": name, "reason": (el.get("message") or "")[:200]})
    return res
