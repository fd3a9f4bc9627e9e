"""The soak's worker: a spawned process that runs one job at a time, so a hang can be killed;
and the ERROR result recorded for a run it gave no result for."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
import traceback
from pathlib import Path

from kvchaos.harness.judge.verdict import ERROR, EXIT_CODES
from kvchaos.harness.tools.fingerprint import fingerprints


def _worker_main(conn) -> None:
    """Runs jobs until told to stop. Lives in a spawned process, so the parent can kill a hang."""
    from kvchaos.harness.judge.runner import run_scenario
    from kvchaos.harness.judge.scenario import parse_scenario
    from kvchaos.harness.report.render import publish  # noqa: F401  imported before ready

    conn.send({"ready": True})  # imports done: run deadlines start counting from here
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        if job.get("hang"):
            while True:  # the injected hang: only the parent's kill ends it
                time.sleep(3600)
        try:
            conn.send(_execute(job, run_scenario, parse_scenario))
        except Exception:  # the harness's own bug: the parent records it as this run's ERROR
            conn.send({"worker_error": traceback.format_exc()})


def _execute(job: dict, run_scenario, parse_scenario) -> dict:
    from kvchaos.harness.report.render import publish

    # no file of its own: the runner's scenario.toml in the run folder is the one copy
    sc = parse_scenario(job["scenario"], f"<soak seed {job['seed']}>")
    if job["op"] == "replay":
        r = run_scenario(sc, job["seed"], job["device"], None, timeout_s=job["timeout_s"])
        return {"digest": r.results["history_digest"], "verdict": r.verdict}
    r = publish(
        run_scenario(sc, job["seed"], job["device"], job["runs_dir"], timeout_s=job["timeout_s"]),
        index=False,
        batch=job.get("batch"),
    )
    res = r.results
    return {
        "run_dir": str(r.run_dir),
        "verdict": r.verdict,
        "summary": r.summary,
        "steps": res["steps"],
        "wall_s": res["wall_s"],
        "digest": res["history_digest"],
        "command": res["replay"],
        "fingerprints": fingerprints(res, job["scenario"].get("faults", [])),
    }


class Worker:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None

    def ready(self, deadline: float, tick) -> bool:
        """Start the worker if there is none, and wait until its imports are done (a fresh worker
        must not spend a run's time limit importing torch). False if the deadline came first."""
        if self.proc is not None and self.proc.is_alive():
            return True
        self.kill()
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(
            target=_worker_main, args=(child,), daemon=True, name="kvchaos-soak-worker"
        )
        self.proc.start()
        child.close()
        self.conn = parent
        while time.monotonic() < deadline:
            try:
                if self.conn.poll(0.25):
                    return self.conn.recv().get("ready", False)
            except (EOFError, OSError):
                break
            if not self.proc.is_alive():
                break
            tick()
        self.kill()
        if time.monotonic() < deadline:
            raise RuntimeError("the soak's worker process could not start (see the error above)")
        return False

    def call(self, job: dict, deadline: float, tick) -> tuple[str, dict | None]:
        """('ok', result) | ('worker_error', {traceback}) | ('timeout', None) | ('died', None);
        tick() runs while it waits."""
        self.conn.send(job)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return "timeout", None
            try:
                if self.conn.poll(min(0.25, left)):
                    got = self.conn.recv()
                    return ("worker_error", got) if "worker_error" in got else ("ok", got)
            except (EOFError, OSError):
                self.kill()
                return "died", None
            if not self.proc.is_alive():
                self.kill()
                return "died", None
            tick()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.conn.close()
        self.proc = self.conn = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except OSError:
                pass
        self.kill()

    def rss(self) -> int:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss if self.proc is not None else 0
        except psutil.Error:
            return 0


def killed_run(
    job: dict, why: str, detail: str, runs_dir: Path, limit_s: float, commit: str, device: str
) -> dict:
    """Record a run the worker gave no result for: in its own folder if it made one."""
    from kvchaos.harness.judge.runner import new_run_dir
    from kvchaos.harness.judge.toml_writer import dumps

    seed = job["seed"]
    found = sorted(runs_dir.glob(f"*-soak-{seed}-s{seed}"))
    run_dir = found[0] if found else new_run_dir(runs_dir, f"soak-{seed}", seed)
    if not (run_dir / "scenario.toml").exists():  # the runner writes it when it got that far
        (run_dir / "scenario.toml").write_text(dumps(job["scenario"]), encoding="utf-8")
    last_line = (detail.strip().splitlines() or [""])[-1]
    name, message = {
        "timeout": (
            "Timeout",
            f"no result within {limit_s:g} s: the run was killed",
        ),
        "died": ("WorkerDied", "the worker process died during the run"),
        "worker_error": ("WorkerError", f"the soak's worker failed: {last_line}"),
    }[why]
    error = {
        "error": name,
        "message": message,
        "traceback": detail,
        "injected_hang": job["hang"],
    }
    cmd = f"kvchaos run {run_dir / 'scenario.toml'} --seed {seed} --device {device}"
    results = {
        "scenario": f"soak-{seed}",
        "seed": seed,
        "verdict": ERROR,
        "summary": f"run error: {message}",
        "exit_code": EXIT_CODES[ERROR],
        "commit": commit,
        "config_hash": None,
        "device": device,
        "steps": 0,
        "wall_s": None,
        "reason": why,
        "error": error,
        "expectation": job["scenario"]["expect"],
        "time_to_detect_steps": {},
        "credits": [],
        "fault_verify": {},
        "checkers": [],
        "history_digest": None,
        "metrics": {},
        "replay": cmd,
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    _report(run_dir, results)
    return {
        "run_dir": str(run_dir),
        "verdict": ERROR,
        "summary": results["summary"],
        "steps": 0,
        "wall_s": None,
        "digest": None,
        "command": cmd,
        "fingerprints": fingerprints(results, job["scenario"].get("faults", [])),
    }


def _report(run_dir: Path, results: dict) -> None:
    """report.html for a killed run too, so the summary's link to it resolves."""
    from kvchaos.harness.report.render import write_reports

    for events in (None, []):  # its partial history if readable, else none
        try:
            write_reports(run_dir, results, events, plots=False)
            return
        except Exception as e:  # the results are on disk: the report is a convenience
            results["report_error"] = f"{type(e).__name__}: {e}"
    (run_dir / "results.json").write_text(json.dumps(results, indent=1))
