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
from dataclasses import dataclass
from pathlib import Path

from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.check.metrics import run_metrics
from kvchaos.harness.history.log import History
from kvchaos.harness.history.results import write_results
from kvchaos.harness.run.isolate import exit_status, main_not_rerun, start_server
from kvchaos.harness.run.runner import RunResult, git_commit, make_run_dir
from kvchaos.harness.run.user_code import SmokeFailure
from kvchaos.harness.scenario.inputs import replay_command
from kvchaos.harness.scenario.options import DEFAULT_CHECK_TIMEOUT_S
from kvchaos.harness.scenario.spec import Scenario, parse_scenario

DOOR_SCENARIO = "door-check"  # the scenario name of such a run

IMPORT_TIMEOUT_S = 600.0  # ... and its import (vLLM's takes half a minute on a loaded machine)


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


# -- the check before any run, in a worker of its own -------------------------------------
def validate_isolated(
    spec: str,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
    import_timeout_s: float = IMPORT_TIMEOUT_S,
) -> tuple[int, ...] | None:
    """door_check(spec).block_sizes: the block sizes the manager declares (None: any)."""
    return door_check(spec, timeout_s, import_timeout_s).block_sizes


@dataclass(frozen=True, kw_only=True)
class DoorPass:
    """What a manager that passed the check declares: block sizes (None: any), capabilities."""

    block_sizes: tuple[int, ...] | None
    capabilities: frozenset[str]


def door_check(
    spec: str,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
    import_timeout_s: float = IMPORT_TIMEOUT_S,
) -> DoorPass:
    """user_code.validate_manager(spec) in a fresh worker: a manager that hangs or ends the
    process in its smoke sequence is bad input (ValueError, one line), not a hung or dead
    kvchaos; one whose smoke call raises or answers wrongly, SmokeFailure (its FAIL run is the
    caller's: harness/run/door.py). timeout_s bounds the check once the manager's module is
    imported; the import has its own bound. Returns what it declares."""
    from kvchaos.harness.run.user_code import SmokeFailure

    ctx = start_server()
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_validate, args=(spec, os.getcwd(), dict(os.environ), theirs), name="kvchaos-check"
    )
    with main_not_rerun():
        proc.start()
    theirs.close()
    check = "the check before any run (a smoke sequence on a tiny pool)"
    try:
        said = _heard(ours, proc, import_timeout_s, f"{spec!r}: importing it")
        if said[0] == "loaded":
            said = _heard(ours, proc, timeout_s, f"{spec!r}: {check}", " (--check-timeout)")
        kind, value = said
        if kind == "failed":
            raise SmokeFailure.from_dict(value)
        if kind == "bad":
            raise ValueError(value)
        sizes, caps = value
        return DoorPass(
            block_sizes=None if sizes is None else tuple(sizes), capabilities=frozenset(caps)
        )
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        ours.close()


def _heard(conn, proc, timeout_s: float, what: str, flag: str = ""):
    """The checking worker's next word, within timeout_s: ValueError (one line) if it says
    nothing in time or ends without a word."""
    if not conn.poll(timeout_s):
        raise ValueError(f"{what} did not finish within {timeout_s:g} s{flag}")
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise ValueError(f"{what} ended the process: {exit_status(proc.exitcode)}") from None


def _validate(spec: str, cwd: str, env: dict, conn) -> None:
    from kvchaos.engine.protocols import capabilities, declared_block_sizes
    from kvchaos.harness.run.user_code import SmokeFailure, load_object, validate_manager

    os.chdir(cwd)  # where the caller runs: a module there is importable, as in a run
    seed = os.environ.get("PYTHONHASHSEED")
    os.environ.clear()  # the caller's environment now, as a run's worker has it
    os.environ.update(env)
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = seed
    try:
        load_object(spec)  # the import, first: the check's clock starts after it
        conn.send(("loaded", None))
        bm = validate_manager(spec)
        conn.send(("ok", (declared_block_sizes(bm), sorted(capabilities(bm)))))
    except SmokeFailure as e:
        conn.send(("failed", e.to_dict()))
    except ValueError as e:
        conn.send(("bad", str(e)))
    except BaseException as e:  # noqa: BLE001  SystemExit included: one line, never a crash
        conn.send(("bad", f"{spec!r}: the check before any run raised {type(e).__name__}: {e}"))
