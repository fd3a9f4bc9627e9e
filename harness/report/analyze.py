"""Re-check a stored run without re-running the engine: read RUN_DIR/history.jsonl, run the checkers
again (with the options of RUN_DIR/scenario.toml), recompute the verdict with the fault evidence of
the run_end event, and rewrite results.json, the incident-NNN.md files, report.html and the index of
the folder above. Exits with the verdict's exit code."""

from __future__ import annotations

from pathlib import Path

from kvchaos.engine.errors import KVChaosError
from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.check.localize import carry_calls
from kvchaos.harness.check.metrics import run_metrics
from kvchaos.harness.check.performance import judge_performance
from kvchaos.harness.check.verdict import EXIT_CODES, current, truth_problem
from kvchaos.harness.history.log import check_history, deterministic_digest, read_history
from kvchaos.harness.history.results import read_results
from kvchaos.harness.report.index import update_index
from kvchaos.harness.report.render import write_reports
from kvchaos.harness.report.view import RunView
from kvchaos.harness.scenario.inputs import replay_command
from kvchaos.harness.scenario.options import PATH

# -- kvchaos analyze ------------------------------------------------------------------------


def _scenario_of(run_dir: Path, name: str | None):
    from kvchaos.harness.scenario.spec import load_scenario

    stored = run_dir / "scenario.toml"
    if stored.is_file():
        return load_scenario(stored)
    if not name:
        raise KVChaosError(
            f"{run_dir}: no scenario.toml and no scenario name in the history: cannot re-check it"
        )
    try:
        return load_scenario(name)
    except KVChaosError as e:
        raise KVChaosError(f"{run_dir}: no scenario.toml in it, and {e}") from None


def analyze(run_dir: Path | str, plots: bool = True, index: bool = True) -> dict:
    """Re-check a stored run and rewrite its results and reports; returns the new results.
    index=False leaves the folder above's index alone (a batch rebuilds it once, at its end)."""
    run_dir = Path(run_dir)
    if not (run_dir / "history.jsonl").exists():
        why = "no history.jsonl in it" if run_dir.is_dir() else "not a folder"
        raise KVChaosError(
            f"{run_dir}: not a run folder ({why if run_dir.exists() else 'no such folder'}; "
            "`kvchaos run` makes them under --report-dir)"
        )
    check_history(run_dir / "history.jsonl")
    stored = read_results(run_dir)
    events = read_history(run_dir / "history.jsonl")
    v = RunView(events)
    sc = _scenario_of(run_dir, v.start.get("scenario") or stored.get("scenario"))
    errs = v.by.get("error", [])
    error = {k: errs[0].get(k, "") for k in ("error", "message", "traceback")} if errs else None
    # a run whose worker died or hung inside a call into the manager ends there: a finding
    ended_by_manager = any(e.get("how") for e in v.by.get("sut_error", []))
    if v.end is None and error is None and not ended_by_manager:
        error = {
            "error": "Truncated",
            "message": "history.jsonl has no run_end event: the run was cut short",
            "traceback": "",
        }
    verify = v.end.get("fault_verify") if v.end else {}
    if v.end and (problem := truth_problem(sc, verify)):  # what the verdict is judged from
        raise KVChaosError(
            f"{run_dir / 'history.jsonl'}: run_end: {problem}: the ground truth is partial, so "
            "which findings the faults explain cannot be judged"
        )
    checks, verdict = evaluate(sc, events, verify, error)
    seed = v.start.get("seed", stored.get("seed"))
    device = v.start.get("device", stored.get("device", "cpu"))
    results = {
        **stored,
        "scenario": sc.name,
        "seed": seed,
        "verdict": verdict.verdict,
        "summary": verdict.summary,
        "exit_code": verdict.exit_code,
        "commit": v.start.get("commit", stored.get("commit")),
        "config_hash": v.start.get("config_hash", stored.get("config_hash")),
        "device": device,
        "steps": v.last_step,
        "reason": v.end.get("reason", "?")
        if v.end
        else ("sut_error" if ended_by_manager else "error"),
        "error": stored.get("error") if stored.get("error") and error else error,
        "expectation": sc.expect.model_dump(),
        "time_to_detect_steps": verdict.time_to_detect,
        "fault_verify": verify,
        "checkers": [c.to_dict() for c in checks],
        "history_digest": deterministic_digest(events),
        "metrics": run_metrics(events),
        "performance": judge_performance(events),
        "exercised": verdict.exercised,
        "credits": verdict.credit_rows(),
        "replay": stored.get("replay") or replay_command(sc, seed, device, run_dir=run_dir),
        "analyzed_from": current(stored.get("verdict")),
    }
    results.pop("report_error", None)
    carry_calls(stored.get("checkers", []), results["checkers"])
    write_reports(run_dir, results, events, plots=plots)
    if index:
        update_index(run_dir.parent)
    return results


def add_arguments(p) -> None:
    p.add_argument(
        "run_dir",
        type=PATH,
        metavar="RUN_DIR",
        help="a run folder (holds history.jsonl), e.g. reports/latest",
    )
    p.add_argument(
        "--no-plots", action="store_true", help="skip the matplotlib figure in report.html"
    )


def main(args) -> int:
    r = analyze(Path(args.run_dir), plots=not args.no_plots)
    run_dir = Path(args.run_dir)
    was = r.get("analyzed_from")
    change = (
        f" (stored verdict was {was})"
        if was and was != r["verdict"]
        else (" (same as stored)" if was else "")
    )
    print(f"{run_dir}: {r['verdict']}{change}: {r['summary']}")
    fired = [c["checker"] for c in r["checkers"] if c["valid"] is False]
    held = [c["checker"] for c in r["checkers"] if c["valid"] is True]
    unknown = [c["checker"] for c in r["checkers"] if c["valid"] is None and c.get("error")]
    idle = [c["checker"] for c in r["checkers"] if c["valid"] is None and not c.get("error")]
    print(
        f"  checkers fired: {', '.join(fired) or '-'}; held: {', '.join(held) or '-'}"
        + (f"; could not decide: {', '.join(unknown)}" if unknown else "")
        + (f"; not judged: {', '.join(idle)}" if idle else "")
    )
    for inc in r["incidents"]:
        print(f"  {inc['file']} [{inc['severity']}] {inc['title']}")
    print(f"  report: {run_dir / 'report.html'}")
    return EXIT_CODES[r["verdict"]]
