"""The runner: scenario + seed -> engine, workload, faults -> run -> history -> checkers -> verdict.
History first, check after: everything is on disk before any checker reads it."""

from __future__ import annotations

import datetime as dt
import functools
import gc
import os
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.engine.boundary import ManagerError, describe
from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.check.metrics import run_metrics
from kvchaos.harness.check.performance import judge_performance
from kvchaos.harness.check.verdict import VerdictName
from kvchaos.harness.history.log import History
from kvchaos.harness.history.results import write_results
from kvchaos.harness.report.paths import make_report_dir
from kvchaos.harness.run.device import resolve_device
from kvchaos.harness.run.live import LiveRun
from kvchaos.harness.run.provenance import kvchaos_version, manager_version
from kvchaos.harness.run.user_code import load_object
from kvchaos.harness.scenario.inputs import replay_command
from kvchaos.harness.scenario.managers import REFERENCE, reference_spec
from kvchaos.harness.scenario.spec import Scenario, ScenarioError
from kvchaos.harness.scenario.toml_writer import dumps

DEFAULT_REPORT_DIR = Path("reports")


@functools.cache
def settle_heap() -> None:
    """Keep what the process holds at its first run (torch's modules and the rest: some 200k
    objects, as long-lived as the process) out of every later garbage collection. Runs allocate
    a great deal, and each full collection would scan all of that again; what runs allocate is
    still collected."""
    gc.collect()
    gc.freeze()


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(kw_only=True)
class RunResult:
    scenario: str
    seed: int
    verdict: VerdictName
    run_dir: Path | None
    summary: str
    findings: list = field(default_factory=list)
    results: dict = field(default_factory=dict)
    events: list = field(default_factory=list, repr=False)  # the history, for the reports


def new_run_dir(report_dir: Path, name: str, seed: int) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    leaf = f"{stamp}-{name}-s{seed}"
    base = report_dir / leaf
    # defence in depth, for a name its validator never saw: one folder, right in report_dir
    if Path(leaf).name != leaf or base.resolve().parent != Path(report_dir).resolve():
        raise ScenarioError(
            f"scenario name {name[:60]!r}: its run folder would not be in {report_dir}"
        )
    make_report_dir(report_dir)
    d, n = base, 1
    while d.exists():
        n += 1
        d = base.with_name(f"{base.name}-{n}")
    d.mkdir(parents=True)
    return d


def make_run_dir(report_dir: Path | str, sc: Scenario, seed: int) -> Path:
    """A new run folder holding the scenario as resolved (defaults filled in): what replay and
    analyze read, written before anything can fail."""
    run_dir = new_run_dir(Path(report_dir), sc.name, seed)
    (run_dir / "scenario.toml").write_text(
        dumps(sc.model_dump(mode="json", exclude_none=True)), encoding="utf-8"
    )
    return run_dir


def run_scenario(
    sc: Scenario,
    seed: int,
    device: str | None = "cpu",
    report_dir: Path | str | None = DEFAULT_REPORT_DIR,
    block_manager=None,
    block_manager_spec: str | None = None,
    timeout_s: float | None = None,
    tp_mode: str | None = None,
    world_size: int | None = None,
    cluster=None,
    run_dir: Path | None = None,
    on_history=None,
) -> RunResult:
    """Run one scenario with one seed. report_dir=None keeps nothing on disk. tp_mode / world_size
    override the scenario's engine.tp_mode / tp_size; cluster: a distributed Cluster to reuse.
    Writes the run's record (scenario.toml, history.jsonl, results.json); reports are the caller's:
    kvchaos.harness.report.render.publish(result). run_dir: a folder make_run_dir made already
    (an isolated run's parent makes it, to find the history should the worker die);
    on_history(history): called once the history is open (the worker flushes it when stopped)."""
    settle_heap()
    tp = {k: v for k, v in (("tp_mode", tp_mode), ("tp_size", world_size)) if v is not None}
    device = resolve_device(device)
    if run_dir is None and report_dir is not None:
        run_dir = make_run_dir(report_dir, sc, seed)
    history = History(run_dir / "history.jsonl" if run_dir else None, keep=True)
    if on_history is not None:
        on_history(history)
    if (
        block_manager is not None and not block_manager_spec
    ):  # name it, for the history and the replay line
        block_manager_spec = (
            f"{block_manager.__module__}:{getattr(block_manager, '__qualname__', '?')}"
        )
    t0 = time.perf_counter()
    error = None
    reason = "error"
    run = None
    try:
        if block_manager is None and block_manager_spec:
            block_manager = load_object(block_manager_spec)
        run = LiveRun(sc, seed, device, history, block_manager, tp, cluster)
        history.append(start_event(run, sc, seed, device, block_manager_spec))
        run.arm()
        reason = run.run(time.monotonic() + timeout_s if timeout_s else None)
    except KeyboardInterrupt:
        reason = "interrupted"
        error = {
            "error": "KeyboardInterrupt",
            "message": "interrupted by the user",
            "traceback": "",
        }
    except BaseException as ex:  # the block manager's exception is a finding; any other, ERROR
        error = _failure(history, ex, run.engine.step_count if run else 0)
        reason = reason if error else "sut_error"
    verify = {}
    if run is not None:
        try:
            verify = run.finish(reason)
        except KeyboardInterrupt:  # Ctrl-C while checking: the run's record is still written
            reason = "interrupted"
            error = error or {
                "error": "KeyboardInterrupt",
                "message": "interrupted by the user",
                "traceback": "",
            }
            history.append({"e": "error", "step": run.engine.step_count, **error})
        except Exception as ex:
            error = error or _failure(history, ex, run.engine.step_count)
        try:
            run.engine.close()  # real ranks: ends the run on them, or names the rank that failed
        except Exception as ex:
            error = error or _failure(history, ex, run.engine.step_count)
    history.close()
    events = history.events
    checks, v = evaluate(sc, events, verify, error)
    checked = [c.to_dict() for c in checks]
    localized = None
    if v.verdict == "FAIL" and run is not None and device == "cpu" and cluster is None:
        localized = localize_findings(
            sc, seed, device, block_manager, block_manager_spec, tp, events, checked
        )
    results = {
        "scenario": sc.name,
        "seed": seed,
        "verdict": v.verdict,
        "summary": v.summary,
        "exit_code": v.exit_code,
        "commit": git_commit(),
        "kvchaos_version": kvchaos_version(),
        "config_hash": run.cfg.config_hash() if run else None,
        "device": device,
        "block_manager": block_manager_spec
        or (reference_spec(run.cfg.cache) if run else REFERENCE),
        "manager_version": manager_version(block_manager_spec, block_manager),
        # what the manager speaks (always 2 now; 1 in folders recorded under v1, before 0.2)
        "block_manager_protocol": run.engine.protocol if run else None,
        "tp_mode": run.cfg.tp_mode if run else tp.get("tp_mode"),
        "world_size": run.cfg.tp_size if run else tp.get("tp_size"),
        "steps": run.engine.step_count if run else 0,
        "wall_s": round(time.perf_counter() - t0, 3),
        "reason": reason,
        "error": error,
        "expectation": sc.expect.model_dump(),
        "time_to_detect_steps": v.time_to_detect,
        "credits": v.credit_rows(),
        "fault_verify": verify,
        "checkers": checked,
        "localization": localized,
        "history_digest": history.digest(),
        # what orders the manager's sets and dicts of strings: fixed in an isolated worker
        "python_hash_seed": os.environ.get("PYTHONHASHSEED") or "random",
        "metrics": run_metrics(events),
        "performance": judge_performance(events),  # warnings, never the verdict
        "exercised": v.exercised,
        "replay": replay_command(sc, seed, device, block_manager_spec, tp, run_dir),
    }
    if (
        run_dir is not None
    ):  # the judge's record; the caller renders reports (kvchaos.harness.report.render.publish)
        write_results(run_dir, results)
    findings = [f for c in checks for f in c.findings]
    return RunResult(
        scenario=sc.name,
        seed=seed,
        verdict=v.verdict,
        run_dir=run_dir,
        summary=v.summary,
        findings=findings,
        results=results,
        events=events,
    )


def start_event(run: LiveRun, sc: Scenario, seed: int, device: str, spec: str | None) -> dict:
    """The history's first event: what the run is."""
    cfg = run.cfg
    return {
        "e": "run_start",
        "step": 0,
        "scenario": sc.name,
        "seed": seed,
        "config": cfg.to_dict(),
        "config_hash": cfg.config_hash(),
        "commit": git_commit(),
        "device": device,
        "time": dt.datetime.now().isoformat(timespec="seconds"),
        "block_manager": spec or reference_spec(cfg.cache),
        "capabilities": sorted(run.engine.capabilities),
        "telemetry": run.telemetry.status(),
        "plan": [a.to_dict() for a in run.plan.actions],
    }


def localize_findings(
    sc, seed, device, block_manager, spec, tp, events, checks, budget_steps: int | None = None
) -> dict:
    """Name the call behind each kind of finding (a deterministic replay; run/explain.py):
    the findings' dicts gain "call". What it named, or why not, for results.json."""
    from kvchaos.harness.run.explain import DEFAULT_BUDGET_STEPS, explain, summary

    findings = [f for c in checks for f in c["findings"]]
    out = explain(
        sc, seed, device, block_manager, tp,
        lambda run: start_event(run, sc, seed, device, spec), events, findings,
        budget_steps or DEFAULT_BUDGET_STEPS,
    )  # fmt: skip
    return {
        "replayed_steps": out["replayed_steps"],
        "budget_steps": out["budget_steps"],
        "note": out["note"],
        "lines": summary(out),
    }


def _failure(history: History, ex: BaseException, step: int) -> dict | None:
    """Record an exception that ended the run. One escaping a call into the block manager is a
    finding against it (a "sut_error" event; the run goes on to its verdict, a FAIL); any other is
    the harness's own failure: an "error" event, and the returned error makes the run ERROR."""
    if isinstance(ex, ManagerError):
        history.append(
            {
                "e": "sut_error",
                "step": step,
                "call": describe(ex.call, ex.args_),
                "args": [repr(a) for a in ex.args_],
                "error": type(ex.error).__name__,
                "message": str(ex.error),
                "traceback": ex.traceback,
            }
        )
        return None
    error = {"error": type(ex).__name__, "message": str(ex), "traceback": traceback.format_exc()}
    history.append({"e": "error", "step": step, **error})
    return error
