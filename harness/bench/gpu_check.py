"""The prepared GPU check: one command on a CUDA machine (H100/H200 class) that finishes inside its
budget (default 450 s: under 8 minutes with start-up and the summaries) and leaves a JSON and a
Markdown summary.

Stages, each in its own process under its own time limit, so one that fails, hangs or crashes the
CUDA context loses nothing else:
  env           GPU, driver, torch/triton versions, optional packages present, NVML telemetry
  gpu_tests     pytest -m gpu (JUnit XML kept as gpu-tests.xml)
  scenarios     every built-in scenario on CUDA in float32, float16 and bfloat16 against the oracle
                (needs pydantic: without it the stage says so and the rest goes on)
  bench_kernel  the Triton paged-decode kernel vs a device-to-device copy and SDPA (bench.kernel)
  staging       per-step latency with pinned vs pageable table staging (bench.staging)
  soak          `kvchaos soak --budget 2m --device cuda`, when kvchaos.harness.tools.soak is there

Writes gpu-check.json, gpu-check.md, gpu-check.log and gpu-tests.xml into --out (the JSON and the
Markdown are rewritten after every stage); scenario and soak run folders go under --work-dir.
Exit codes: 0 every stage ok; 1 a stage failed, errored or timed out; 3 no CUDA device;
4 nothing failed but some stage could not run (a missing package or module, the budget spent).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from kvchaos.harness.bench.child import ROOT, run_limited, tail
from kvchaos.harness.bench.gpu_stages import (
    ERROR,
    FAILED,
    OK,
    SKIPPED,
    STAGE_FUNCS,
    TIMEOUT,
)
from kvchaos.harness.bench.gpu_summary import write_summaries
from kvchaos.harness.scenario import inputs
from kvchaos.harness.scenario.options import PATH

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


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


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
            from kvchaos.harness.run.device import resolve_device

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
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGE_FUNCS]
    if unknown:  # before anything is written
        raise ValueError(f"--stages: unknown {unknown}; known: {', '.join(STAGES)}")
    out, work = Path(args.out), Path(args.work_dir or Path(args.out) / "work")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    limits = {**LIMITS, **dict(args.stage_limit or [])}
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
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # kvchaos is importable here: so it is there
    for i, name in enumerate(stages):
        later_floor = sum(FLOOR[s] for s in stages[i + 1 :])
        limit = min(limits[name], deadline - time.monotonic() - later_floor)
        if limit < min(FLOOR[name], limits[name]) / 2:
            report["stages"][name] = {
                "status": SKIPPED,
                "summary": f"budget spent ({limit:.0f} s left for it)",
                "wall_s": 0,
            }
            write_summaries(report, out)
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
        proc = run_limited(cmd, limit, env=stage_env)
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
                f"{tail(proc.stderr.strip(), 300)}",
            }
        res["wall_s"] = wall
        report["stages"][name] = res
        _say(f"[gpu-check] {name}: {res['status']} ({wall} s) {res.get('summary', '')}")
        write_summaries(report, out)
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
    write_summaries(report, out)
    return report


def _limit(spec: str) -> tuple[str, float]:
    name, _, v = spec.partition("=")
    if name not in STAGE_FUNCS or not v:
        raise ValueError(f"{spec!r}: expected STAGE=SECONDS with a stage from {', '.join(STAGES)}")
    return name, inputs.seconds(v)


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        type=PATH,
        default="reports/gpu-check",
        help="where the summaries go (default: reports/gpu-check)",
    )
    p.add_argument(
        "--work-dir",
        type=PATH,
        default=None,
        help="run folders and stage results (default: OUT/work)",
    )
    p.add_argument(
        "--budget-s",
        type=inputs.flag(inputs.seconds),
        default=450,
        help="total time budget in seconds (default 450: under 8 minutes in all)",
    )
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}"
    )
    p.add_argument(
        "--stage-limit",
        action="append",
        type=inputs.flag(_limit),
        metavar="STAGE=S",
        help="override one stage's time limit",
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
