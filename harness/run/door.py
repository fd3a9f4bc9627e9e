"""A manager that fails the check before any run (user_code.validate_manager's smoke sequence)
is judged as what it is, a manager with a bug: it gets a run like any other, a FAIL. Its history
holds the smoke calls it was made (a calls event, as a run's call log), the call that
raised or answered what the protocol does not allow (sut_error), and the run's end; the checkers
judge it (manager_calls names the call) and the reports follow (an incident). The run's scenario
is the check's tiny pool with a small workload: its replay line runs the check again, and a
manager that passes it then runs that workload."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections import Counter
from pathlib import Path

from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.check.metrics import run_metrics
from kvchaos.harness.history.log import History
from kvchaos.harness.history.results import write_results
from kvchaos.harness.run.runner import RunResult, git_commit, make_run_dir
from kvchaos.harness.run.user_code import SmokeFailure
from kvchaos.harness.scenario.inputs import replay_command
from kvchaos.harness.scenario.spec import Scenario, parse_scenario

DOOR_SCENARIO = "door-check"  # the scenario name of such a run


def door_scenario(pool: tuple) -> Scenario:
    """The check's tiny pool (num_blocks, block_size, max_num_seqs, max_blocks_per_seq) as a
    scenario: requests of at most a row's tokens, each fitting the pool on its own."""
    num_blocks, bs, seqs, width = pool
    most = max(1, width * bs // 2)  # prompt + output within a row
    return parse_scenario(
        {
            "scenario": {
                "name": DOOR_SCENARIO,
                "description": "the check before any run: the smoke sequence on a tiny pool "
                "(kvchaos.harness.run.user_code); a manager that passes it runs this workload",
                "seeds": [0],
            },
            "engine": {
                "cache": {
                    "num_blocks": num_blocks,
                    "block_size": bs,
                    "max_num_seqs": seqs,
                    "max_blocks_per_seq": width,
                }
            },
            "workload": {
                "num_requests": 4,
                "prompt_len": {"dist": "uniform", "min": 1, "max": most},
                "output_len": {"dist": "uniform", "min": 1, "max": most},
            },
            "expect": {"outcome": "clean"},
        },
        f"<{DOOR_SCENARIO}>",
        "cpu",
    )


def door_run(
    failure: SmokeFailure, report_dir: Path | str | None, index: bool = True, batch=None
) -> RunResult:
    """The FAIL run of a manager that failed the smoke sequence: its record (scenario.toml,
    history.jsonl, results.json) and its reports (incidents, report.html; index: the report
    index too) written under report_dir (None: nothing on disk); batch: as for publish."""
    from kvchaos.harness.report.render import publish

    return publish(_recorded(failure, report_dir), index=index, batch=batch)


def _recorded(failure: SmokeFailure, report_dir: Path | str | None) -> RunResult:
    t0 = time.perf_counter()
    sc = door_scenario(failure.pool)
    run_dir = make_run_dir(report_dir, sc, 0) if report_dir is not None else None
    history = History(run_dir / "history.jsonl" if run_dir else None, keep=True)
    cfg = sc.engine_config(device="cpu", seed=0)
    history.append(
        {
            "e": "run_start",
            "step": 0,
            "scenario": sc.name,
            "seed": 0,
            "config": cfg.to_dict(),
            "config_hash": cfg.config_hash(),
            "commit": git_commit(),
            "device": "cpu",
            "time": dt.datetime.now().isoformat(timespec="seconds"),
            "block_manager": failure.spec,
            "capabilities": list(failure.capabilities),
            "telemetry": {},
            "plan": [],
        }
    )
    last = len(failure.calls) - 1  # snapshots are reads: logged when one is the call that failed
    logged = [
        c["logged"]
        for i, c in enumerate(failure.calls)
        if c["logged"][0] != "snapshot" or i == last
    ]
    history.append({"e": "calls", "step": 0, "calls": logged})
    history.append(
        {
            "e": "sut_error",
            "step": 0,
            "call": failure.call,
            "args": list(failure.args_),
            "error": failure.error,
            "message": failure.message,
            "traceback": failure.traceback,
        }
    )
    made = Counter(c["call"].split("(")[0] for c in failure.calls)
    history.append(
        {
            "e": "run_end",
            "step": 0,
            "reason": "error",
            "counters": {},
            "manager_calls": dict(sorted(made.items())),
            "fault_verify": {},
            "telemetry": {},
        }
    )
    history.close()
    events = history.events
    checks, v = evaluate(sc, events, {}, None)
    results = {
        "scenario": sc.name,
        "seed": 0,
        "verdict": v.verdict,
        "summary": f"the check before any run: {v.summary}",
        "exit_code": v.exit_code,
        "commit": git_commit(),
        "config_hash": cfg.config_hash(),
        "device": "cpu",
        "block_manager": failure.spec,
        "block_manager_protocol": 2,
        "tp_mode": cfg.tp_mode,
        "world_size": cfg.tp_size,
        "steps": 0,
        "wall_s": round(time.perf_counter() - t0, 3),
        "reason": "sut_error",
        "error": None,
        "expectation": sc.expect.model_dump(),
        "time_to_detect_steps": v.time_to_detect,
        "credits": v.credit_rows(),
        "fault_verify": {},
        "checkers": [c.to_dict() for c in checks],
        "history_digest": history.digest(),
        "python_hash_seed": os.environ.get("PYTHONHASHSEED") or "random",
        "metrics": run_metrics(events),
        "exercised": v.exercised,
        "replay": replay_command(sc, 0, "cpu", failure.spec, None, run_dir),
    }
    if run_dir is not None:
        write_results(run_dir, results)
    return RunResult(
        scenario=sc.name,
        seed=0,
        verdict=v.verdict,
        run_dir=run_dir,
        summary=results["summary"],
        findings=[f for c in checks for f in c.findings],
        results=results,
        events=events,
    )
