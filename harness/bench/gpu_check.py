"""The prepared GPU check: one command on a CUDA machine (H100/H200 class) that finishes inside its
budget (default 450 s: under 8 minutes with start-up and the summaries) and leaves a JSON and a
Markdown summary.

Stages, each in its own process under its own time limit, so one that fails, hangs or crashes the
CUDA context loses nothing else:
  env           GPU, driver, torch/triton versions, which optional packages are present, NVML telemetry
  gpu_tests     pytest -m gpu (JUnit XML kept as gpu-tests.xml)
  scenarios     every built-in scenario on CUDA in float32, float16 and bfloat16 against the oracle
                (needs pydantic: without it the stage says so and the rest goes on)
  bench_kernel  the Triton paged-decode kernel vs a device-to-device copy and SDPA (kvchaos.harness.bench.kernel)
  staging       per-step latency with pinned vs pageable table staging (kvchaos.harness.bench.staging)
  soak          `kvchaos soak --budget 2m --device cuda`, when kvchaos.harness.tools.soak is there

Writes gpu-check.json, gpu-check.md, gpu-check.log and gpu-tests.xml into --out (the JSON and the
Markdown are rewritten after every stage); scenario and soak run folders go under --work-dir.
Exit codes: 0 every stage ok; 1 a stage failed, errored or timed out; 3 no CUDA device;
4 nothing failed but some stage could not run (a missing package or module, the budget spent).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_FAILED, EXIT_NO_CUDA, EXIT_INCOMPLETE = 1, 3, 4
NO_CUDA = "no CUDA device: the GPU check needs one; on this machine run `make test`"
STAGES = ("env", "gpu_tests", "scenarios", "bench_kernel", "staging", "soak")
# Nominal limits (s); all six sum to more than the budget only if every stage hangs, and then each
# later stage still keeps its floor (FLOOR) because limits are cut from what the budget has left.
LIMITS = {
    "env": 40,
    "gpu_tests": 100,
    "scenarios": 110,
    "bench_kernel": 75,
    "staging": 40,
    "soak": 165,
}
FLOOR = {"env": 15, "gpu_tests": 30, "scenarios": 30, "bench_kernel": 30, "staging": 15, "soak": 60}
DTYPES = ("float32", "float16", "bfloat16")
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


# -- the stages (each runs in a child process: `python -m kvchaos.harness.bench.gpu_check --stage NAME ...`) ----------
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
    from kvchaos.harness.judge.telemetry import Telemetry, _nvml

    tel = Telemetry(ctx["device"])
    info["telemetry"] = {**tel.status(), "sample": tel.sample()}
    if "nv" in _nvml():
        info["driver"] = _text(_nvml()["nv"].nvmlSystemGetDriverVersion())
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
    proc = _run(cmd, ctx["limit_s"] - 10, env=ctx["env"])
    if proc is None:
        return {
            "status": TIMEOUT,
            "summary": "pytest ran past its time limit",
            "details": _junit(xml),
        }
    res = _junit(xml)
    res["exit_code"], res["output_tail"] = proc.returncode, _tail(proc.stdout + proc.stderr, 3000)
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
        from kvchaos.harness.judge.history import read_history
        from kvchaos.harness.judge.runner import resolve_device, run_scenario
        from kvchaos.harness.judge.scenario import builtin_scenarios, load_scenario
        from kvchaos.harness.report.render import publish
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
            "summary": "soak: not available (harness/soak.py is not in this checkout)",
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
    help_ = _run(base + ["--help"], 30, env=ctx["env"])
    if help_ is None or help_.returncode != 0:
        return {
            "status": UNAVAILABLE,
            "summary": "soak: `kvchaos soak --help` failed",
            "details": {
                "output_tail": _tail((help_.stdout + help_.stderr) if help_ else "timed out", 2000)
            },
        }
    report_dir = Path(ctx["work"]) / "soak"
    cmd = base + ["--budget", "2m" if budget == 120 else f"{budget}s", "--device", ctx["device"]]
    if "--report-dir" in help_.stdout:
        cmd += ["--report-dir", str(report_dir)]
    t_wall = time.time()
    proc = _run(
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
        details["summary_md"] = _tail(summaries[-1].read_text(errors="replace"), 6000)
    if proc is None:
        return {
            "status": TIMEOUT,
            "summary": f"soak ran past its {budget} s budget and its grace",
            "details": details,
        }
    details.update(exit_code=proc.returncode, output_tail=_tail(proc.stdout + proc.stderr, 4000))
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


# -- helpers ---------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _tail(s: str, n: int) -> str:
    return s if len(s) <= n else "..." + s[-n:]


def _run(cmd: list[str], timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess | None:
    """Runs cmd in its own process group; on timeout kills the whole group and returns None."""
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _kill_group(p)
        return None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _kill_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _junit(path: Path) -> dict:
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
                ).append({"test": name, "message": msg, "text": _tail(el.text or "", 1500)})
        el = case.find("skipped")
        if el is not None:
            res["skips"].append({"test": name, "reason": (el.get("message") or "")[:200]})
    return res


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# -- orchestration ---------------------------------------------------------------------------------------
def run_stage_child(args) -> int:
    """In the child process: run one stage, write its result to WORK/stage-NAME.json."""
    result_path = Path(args.work_dir) / f"stage-{args.stage}.json"
    env = dict(os.environ)

    def save(r: dict) -> None:
        result_path.write_text(json.dumps(r, indent=1, default=str))

    ctx = {
        "device": args.device,
        "out": args.out,
        "work": args.work_dir,
        "limit_s": args.limit_s,
        "env": env,
        "started": time.monotonic(),
        "scenarios": args.scenario or [],
        "dtypes": args.dtypes.split(","),
        "quick": args.quick,
        "save": save,
    }
    if args.device == "cpu":
        try:
            from kvchaos.harness.judge.runner import resolve_device

            resolve_device("cpu")
        except ImportError:
            pass
    try:
        r = STAGE_FUNCS[args.stage](ctx)
    except Exception as e:
        r = {
            "status": ERROR,
            "summary": f"{type(e).__name__}: {e}",
            "details": {"traceback": traceback.format_exc()},
        }
    save(r)
    return 0


def run_check(args) -> dict:
    out, work = Path(args.out), Path(args.work_dir or Path(args.out) / "work")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGE_FUNCS]
    if unknown:
        raise ValueError(f"--stages: unknown {unknown}; known: {', '.join(STAGES)}")
    limits = {**LIMITS, **dict(_limit(v) for v in args.stage_limit or [])}
    device = "cpu" if args.cpu_dry_run else "cuda"
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    report = {
        "check": "kvchaos gpu-check",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "budget_s": args.budget_s,
        "commit": _commit(),
        "out": str(out),
        "work_dir": str(work),
        "stages": {},
    }
    log = open(out / "gpu-check.log", "w", encoding="utf-8")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    for i, name in enumerate(stages):
        later_floor = sum(FLOOR[s] for s in stages[i + 1 :])
        limit = min(limits[name], deadline - time.monotonic() - later_floor)
        if limit < min(FLOOR[name], limits[name]) / 2:
            report["stages"][name] = {
                "status": SKIPPED,
                "summary": f"budget spent ({limit:.0f} s left for it)",
                "wall_s": 0,
            }
            _write(report, out)
            continue
        _say(f"[gpu-check] {name}: up to {limit:.0f} s")
        res_path = work / f"stage-{name}.json"
        res_path.unlink(missing_ok=True)
        cmd = (
            [
                sys.executable,
                "-m",
                "kvchaos.harness.bench.gpu_check",
                "--stage",
                name,
                "--out",
                str(out),
                "--work-dir",
                str(work),
                "--device",
                device,
                "--limit-s",
                str(limit),
                "--dtypes",
                args.dtypes,
            ]
            + [a for s in args.scenario or [] for a in ("--scenario", s)]
            + (["--quick"] if args.quick else [])
        )
        stage_env = (
            dict(env, TRITON_INTERPRET="1") if name == "bench_kernel" and args.cpu_dry_run else env
        )
        t0 = time.monotonic()
        proc = _run(cmd, limit, env=stage_env)
        wall = round(time.monotonic() - t0, 1)
        log.write(f"===== {name} ({wall} s) =====\n")
        if proc is not None:
            log.write(proc.stdout + proc.stderr + "\n")
        log.flush()
        try:
            res = json.loads(res_path.read_text())
        except (OSError, json.JSONDecodeError):
            res = {"status": ERROR, "summary": "the stage left no result"}
        if proc is None:
            res = {
                **res,
                "status": TIMEOUT,
                "summary": f"killed at its {limit:.0f} s limit; partial: {res.get('summary', '-')}",
            }
        elif res.get("status") == "running" or proc.returncode != 0:
            res = {
                **res,
                "status": ERROR,
                "summary": f"the stage process died (exit {proc.returncode}): "
                f"{_tail(proc.stderr.strip(), 300)}",
            }
        res["wall_s"] = wall
        report["stages"][name] = res
        _say(f"[gpu-check] {name}: {res['status']} ({wall} s) {res.get('summary', '')}")
        _write(report, out)
    log.close()
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    statuses = [s["status"] for s in report["stages"].values()]
    report["result"] = (
        "FAILED"
        if any(s in (FAILED, ERROR, TIMEOUT) for s in statuses)
        else "INCOMPLETE"
        if any(s != OK for s in statuses)
        else "OK"
    )
    _write(report, out)
    return report


def _limit(spec: str) -> tuple[str, float]:
    name, _, v = spec.partition("=")
    if name not in STAGE_FUNCS or not v:
        raise ValueError(
            f"--stage-limit {spec!r}: expected STAGE=SECONDS with a stage from {', '.join(STAGES)}"
        )
    return name, float(v)


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=5,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _write(report: dict, out: Path) -> None:
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))


def markdown(r: dict) -> str:
    st = r["stages"]
    env = st.get("env", {}).get("details", {})
    lines = [
        f"# kvchaos gpu-check: {r.get('result', 'RUNNING')}",
        "",
        f"{env.get('gpu', r['device'])}, torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
        f"driver {env.get('driver', '?')}; commit {r['commit']}; started {r['started']}; "
        f"budget {r['budget_s']} s, took {r.get('wall_s', '-')} s",
        "",
        "| stage | status | s | summary |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {n} | {s['status']} | {s.get('wall_s', '-')} | {str(s.get('summary', '')).replace('|', '/')} |"
        for n, s in st.items()
    ]
    b = st.get("bench_kernel", {}).get("details")
    if b and "timings" in b:
        sh = b["shape"]
        lines += [
            "",
            f"## Kernel benchmark ({b['device']}, {b['mode']})",
            "",
            f"batch {sh['batch']} x {sh['ctx']} tokens, {sh['num_heads']} heads over {sh['num_kv_heads']} KV "
            f"heads, head_dim {sh['head_dim']}, block {sh['block_size']}, {sh['dtype']}; "
            f"KV {b['kv_bytes'] / 2**20:.0f} MiB; "
            f"median of {b['runs']} runs, L2 flushed ({b['l2_flush_bytes'] / 2**20:.0f} MiB) before each",
            "",
            "| variant | median ms | GB/s | of copy bandwidth |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['median_ms']:.4g} | {v['gbps']} | {v['gbps'] / b['copy']['gbps']:.0%} |"
            for k, v in b["timings"].items()
        ]
        c = b["copy"]
        lines += [
            f"| device-to-device copy (read + write) | {c['median_ms']:.4g} | {c['gbps']} | 100% |",
            "",
            "| target | measured | wanted | met |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {t['name']} | {t['measured']} | {t['target']} | "
            f"{'-' if t['met'] is None else 'yes' if t['met'] else '**no**'}"
            f"{' (' + t['note'] + ')' if t['note'] else ''} |"
            for t in b["targets"]
        ]
        c = b["correctness"]
        lines += [
            "",
            f"Output vs SDPA: max abs err {c['paged_vs_sdpa_max_abs_err']:.3g} (paged), "
            f"{c['identity_vs_sdpa_max_abs_err']:.3g} (identity), tolerance {c['tol']}. num_splits auto "
            f"{b['num_splits_auto']}; sweep (median ms by num_splits): {b['splits_sweep_median_ms']}",
        ]
    runs = st.get("scenarios", {}).get("details", {}).get("runs")
    if runs:
        dts = list(dict.fromkeys(x["dtype"] for x in runs))
        lines += [
            "",
            "## Scenarios vs the oracle",
            "",
            "| scenario | " + " | ".join(dts) + " |",
            "|---" * (len(dts) + 1) + "|",
        ]
        by = {}
        for x in runs:
            err = x.get("oracle_max_abs_err")
            cell = x["verdict"] + (f" (err {err:.2g})" if err is not None else "")
            by.setdefault(x["scenario"], {})[x["dtype"]] = cell
        lines += [
            f"| {s} | " + " | ".join(v.get(d, "-") for d in dts) + " |" for s, v in by.items()
        ]
        tel = [x for x in runs if x.get("telemetry_samples")]
        if tel:
            lines += [
                "",
                f"Telemetry: {sum(x['telemetry_samples'] for x in tel)} samples in {len(tel)} runs; "
                f"GPU fields present: {all(x['telemetry_gpu'] for x in tel)}; peak GPU memory used "
                f"{max((x['peak_gpu_mem_mb'] or 0) for x in tel):.0f} MiB",
            ]
    sg = st.get("staging", {}).get("details", {})
    if sg.get("applicable"):
        lines += [
            "",
            "## Table staging: pinned vs pageable (per-step engine latency, median)",
            "",
            "| table | pinned us | pageable us | difference | bare upload host-blocked (pinned / pageable) us |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} ({t['table_bytes'] / 1024:.0f} KiB) | {t['pinned']['median_us']} | "
            f"{t['pageable']['median_us']} | "
            f"{t['pageable_minus_pinned_us']:+} us (x{t['pageable_over_pinned']}) | "
            f"{t['upload']['pinned']['host_blocked_us']} / {t['upload']['pageable']['host_blocked_us']} |"
            for k, t in sg["tables"].items()
        ]
    gt = st.get("gpu_tests", {}).get("details", {})
    if gt.get("failed") or gt.get("collection_errors"):
        lines += (
            ["", "## GPU test failures", ""]
            + [f"- `{f['test']}`: {f['message']}" for f in gt["failed"]]
            + [
                f"- could not collect `{f['test']}`: {f['message']}"
                for f in gt["collection_errors"]
            ]
        )
    soak = st.get("soak", {}).get("details", {})
    if soak.get("summary_md"):
        lines += ["", "## Soak", "", soak["summary_md"]]
    missing = {
        p: need for p, need in PACKAGES.items() if env.get("packages", {}).get(p, "?") is None
    }
    if missing:
        lines += ["", "## Missing packages", ""] + [
            f"- {p}: needed by {need}" for p, need in missing.items()
        ]
    not_ok = [n for n, s in st.items() if s["status"] != OK]
    if not_ok:
        lines += ["", "## Not measured in this run", ""] + [
            f"- {n}: {st[n]['status']}: {st[n].get('summary', '')}" for n in not_ok
        ]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default="reports/gpu-check",
        help="where the summaries go (default: reports/gpu-check)",
    )
    p.add_argument(
        "--work-dir", default=None, help="run folders and stage results (default: OUT/work)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="total time budget in seconds (default 450: under 8 minutes in all)",
    )
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}"
    )
    p.add_argument(
        "--stage-limit", action="append", metavar="STAGE=S", help="override one stage's time limit"
    )
    p.add_argument(
        "--scenario", action="append", help="only these scenarios (default: every built-in)"
    )
    p.add_argument(
        "--dtypes", default=",".join(DTYPES), help="model dtypes for the scenarios stage"
    )
    p.add_argument("--quick", action="store_true", help="the kernel benchmark at small shapes")
    p.add_argument(
        "--cpu-dry-run", action="store_true", help=argparse.SUPPRESS
    )  # the orchestration, tested on a CPU


def main(args) -> int:
    if not args.cpu_dry_run and not _cuda_available():
        print(f"kvchaos gpu-check: {NO_CUDA}", file=sys.stderr)
        return EXIT_NO_CUDA
    report = run_check(args)
    for n, s in report["stages"].items():
        print(f"  {n:<13} {s['status']:<13} {s.get('summary', '')}")
    print(
        f"gpu-check {report['result']} in {report['wall_s']} s: {Path(args.out) / 'gpu-check.md'}"
    )
    return {"OK": 0, "FAILED": EXIT_FAILED}.get(report["result"], EXIT_INCOMPLETE)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        prog="python -m kvchaos.harness.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--limit-s", type=float, default=60, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.stage:
        a.work_dir = a.work_dir or str(Path(a.out) / "work")
        sys.exit(run_stage_child(a))
    sys.exit(main(a))
